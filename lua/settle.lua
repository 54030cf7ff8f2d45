-- settle.lua: correct a spend event to what the call really cost.
-- KEYS[1] events, KEYS[2] costs, KEYS[3] plan, KEYS[4] owners, KEYS[5] holds
--   (see lib/budget.lua)
-- ARGV[1] request id
-- ARGV[2] actual cost (integer >= 0; 0 removes the event)
-- ARGV[3..] plan table: name, limit, window_ms triples, default first
-- Returns { 1, previous_cost, cost, used } settled, or { 0, used } when no live
-- event has the id. The event keeps its time: settling never extends a window.

local request, actual = ARGV[1], tonumber(ARGV[2])
local _, _, window = resolve_plan(3)
if not actual or actual < 0 then
  return redis.error_reply('settle: actual cost must be an integer >= 0')
end
local used = expire(now_ms(), window)
local previous = redis.call('HGET', COSTS, request)
if not previous then
  return { 0, used }
end
previous = tonumber(previous)
if actual == 0 then
  local _, after = remove(request, used)
  return { 1, previous, 0, after }
end
redis.call('HSET', COSTS, request, int(actual))
used = write_total(used - previous + actual)
return { 1, previous, actual, used }
