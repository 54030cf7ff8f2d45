-- usage.lua: a user's budget and live spend events (the audit trail).
-- KEYS[1] events, KEYS[2] costs, KEYS[3] plan, KEYS[4] owners, KEYS[5] holds,
-- KEYS[6] audit, KEYS[7] log, KEYS[8] meta, KEYS[9] cancelled
--   (see lib/budget.lua)
-- ARGV[1..] export maxlen, retention, then the plan table (lib/budget.lua)
-- Returns { plan, now_ms, windows..., id_1, at_1, cost_1, operation_1, estimate_1,
-- id_2, ... } with the events in the plan's longest window, oldest first (the
-- log may keep older ones for another plan's longer window); operation is '' for a plain reserve,
-- estimate -1 unless the charge was settled. windows: see push_windows in
-- lib/budget.lua.
-- Expired events are dropped on the way, as every budget script does.

local name, limits = resolve_plan(1)
local now = now_ms()
local used = expire(now, limits)
local out = push_windows({ name, now }, limits, used, now)
local start = int(now - limits[1].window + 1)
while true do
  local batch = redis.call('XRANGE', LOG, start, '+', 'COUNT', BATCH)
  for _, e in ipairs(batch) do
    local ev = at_entry(e[1], e[2][2])
    if ev then
      out[#out + 1] = ev.rec.id
      out[#out + 1] = ev.at
      out[#out + 1] = ev.cost
      out[#out + 1] = ev.rec.op or ''
      out[#out + 1] = ev.estimate or -1
    end
  end
  if #batch < BATCH then
    break
  end
  start = '(' .. batch[#batch][1]
end
return out
