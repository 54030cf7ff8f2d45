-- usage.lua: a user's budget and live spend events (the audit trail).
-- KEYS[1] events, KEYS[2] costs, KEYS[3] plan, KEYS[4] owners, KEYS[5] holds,
-- KEYS[6] audit
--   (see lib/budget.lua)
-- ARGV[1..] export maxlen, then the plan table (lib/budget.lua)
-- Returns { plan, now_ms, windows..., id_1, at_1, cost_1, operation_1, estimate_1,
-- id_2, ... } with events oldest first; operation is '' for a plain reserve,
-- estimate -1 unless the charge was settled. windows: see push_windows in
-- lib/budget.lua.
-- Expired events are dropped on the way, as every budget script does.

local name, limits = resolve_plan(1)
local now = now_ms()
local used = expire(now, limits)
local out = push_windows({ name, now }, limits, used, now)
local start = 0
while true do
  local batch = redis.call('ZRANGE', EVENTS, start, start + BATCH - 1, 'WITHSCORES')
  if #batch == 0 then
    break
  end
  local ids = {}
  for i = 1, #batch, 2 do
    ids[#ids + 1] = batch[i]
  end
  local costs = redis.call('HMGET', COSTS, unpack(ids))
  local owners = redis.call('HMGET', OWNERS, unpack(ids))
  for k = 1, #ids do
    out[#out + 1] = ids[k]
    out[#out + 1] = tonumber(batch[2 * k])
    out[#out + 1] = tonumber(costs[k]) or 0
    local op, est = '', -1
    if owners[k] then
      local o, e = string.match(owners[k], '^%S+ %S+ %S+ (%S+) %S+ ?(%d*)$')
      op, est = o or '', tonumber(e) or -1
    end
    out[#out + 1] = op
    out[#out + 1] = est
  end
  start = start + BATCH
end
return out
