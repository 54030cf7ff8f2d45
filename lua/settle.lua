-- settle.lua: correct a spend event to what the call really cost.
-- KEYS[1] events, KEYS[2] costs, KEYS[3] plan, KEYS[4] owners, KEYS[5] holds
--   (see lib/budget.lua)
-- ARGV[1] request id
-- ARGV[2] actual cost (integer >= 0; 0 removes the event)
-- ARGV[3..] plan table: name, limits pairs, default first
-- Returns { 1, previous_cost, cost, used } settled, or { 0, used } when no live
-- event has the id; `used` is the longest window's. The event keeps its time:
-- settling never extends a window. A raised cost may take a window past its
-- limit: reserves then wait until it fits again.

local request, actual = ARGV[1], tonumber(ARGV[2])
local _, limits = resolve_plan(3)
if not actual or actual < 0 then
  return redis.error_reply('settle: actual cost must be an integer >= 0')
end
local now = now_ms()
local used = expire(now, limits)
local previous = redis.call('HGET', COSTS, request)
if not previous then
  return { 0, used }
end
previous = tonumber(previous)
if actual == 0 then
  local _, after = remove(request, used, now)
  return { 1, previous, 0, after }
end
if #SHORTS > 0 then
  unshort(tonumber(redis.call('ZSCORE', EVENTS, request)), previous - actual, now)
end
used = write_total(used - previous + actual, request, actual)
return { 1, previous, actual, used }
