-- usage.lua: a user's budget and one page of its live spend events (the audit
-- trail). The budget comes from the running totals; a page reads at most
-- limit + 1 log entries, so a call costs O(page) whatever the number of live
-- events (and the amortised expiry every budget script does).
-- KEYS[1] plan, KEYS[2] holds, KEYS[3] audit, KEYS[4] log, KEYS[5] meta,
-- KEYS[6] cancelled
--   (see budget/lib/state.lua)
-- ARGV[1] cursor: '' for the first page, else the log entry ID '<ms>-<seq>'
--   after which the page starts (the next_cursor of the page before; the
--   entry may have left since)
-- ARGV[2] limit: events per page, 1..50 (EventPage::MAX_LIMIT)
-- ARGV[3..] export maxlen, retention, then the plan table (budget/lib/state.lua)
-- Returns { plan, now_ms, windows..., next_cursor, id_1, at_1, cost_1,
-- operation_1, estimate_1, id_2, ... } with the events in the plan's longest
-- window (the log may keep older ones for another plan's longer window),
-- oldest first; next_cursor is '' when the page reached the newest event;
-- operation is '' for a plain reserve, estimate -1 unless the charge was
-- settled. windows: see push_windows in budget/lib/events.lua.
-- A member's reply has its organisation's plan name and windows right after
-- its own windows, a user in no organisation's '' there:
-- { plan, now_ms, windows..., org_plan | '', [org windows...], next_cursor, ... }.
-- Errors: TOLLGATE_BAD_PAGE (a cursor or limit out of shape).

local cursor, limit = ARGV[1], tonumber(ARGV[2])
if cursor ~= '' and not string.match(cursor, '^%d+%-%d+$') then
  return redis.error_reply('TOLLGATE_BAD_PAGE cursor must be <ms>-<seq>')
end
if not limit or limit < 1 or limit > 50 or limit ~= math.floor(limit) then
  return redis.error_reply('TOLLGATE_BAD_PAGE limit must be an integer in 1..50')
end

local now, used, org, limits, name = open_budget(3)
-- Every model limit of the plan shows (budget/lib/model_limits.lua).
model_select('*', now)
local out = push_windows({ name, now }, limits, used, now)
if org then
  org_windows(out, org, now)
else
  out[#out + 1] = ''
end
-- A page starts inside the plan's longest window, and after the cursor.
-- (A plan of periods only: the events the log keeps.)
local lo = now - (limits.nw > 0 and limits[1].window or RETAIN) + 1
local start = int(lo)
if cursor ~= '' and tonumber(string.match(cursor, '^(%d+)')) >= lo then
  start = '(' .. cursor
end
local batch = redis.call('XRANGE', LOG, start, '+', 'COUNT', limit + 1)
out[#out + 1] = #batch > limit and batch[limit][1] or ''
for i = 1, math.min(#batch, limit) do
  local e = batch[i]
  local ev = at_entry(e[1], e[2][2])
  if ev then
    out[#out + 1] = ev.rec.id
    out[#out + 1] = spent(ev)
    out[#out + 1] = ev.cost
    out[#out + 1] = ev.rec.op or ''
    out[#out + 1] = ev.estimate or -1
  end
end
return out
