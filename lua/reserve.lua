-- reserve.lua: atomically expire, check and record one spend event.
-- KEYS[1] events, KEYS[2] costs, KEYS[3] plan, KEYS[4] owners, KEYS[5] holds
--   (see lib/budget.lua)
-- ARGV[1] request id
-- ARGV[2] cost (integer >= 1; checked by the caller too)
-- ARGV[3..] plan table: name, limit, window_ms triples, default first
-- Returns one of
--   { 1, used, limit, at_ms, now_ms, reset_after_ms }  recorded
--   { 2, used, limit, at_ms, now_ms, reset_after_ms }  already recorded (idempotent retry)
--   { 0, used, limit, retry_after_ms, now_ms }         denied: does not fit
--   { -1, limit }                                      cost can never fit this plan
-- Idempotent per request id; two requests in one millisecond are two events.

local request, cost = ARGV[1], tonumber(ARGV[2])
local _, limit, window = resolve_plan(3)
if not cost or cost < 1 or cost > limit then
  return { -1, limit }
end

local now = now_ms()
local used = expire(now, window)

local at = redis.call('ZSCORE', EVENTS, request)
if at then
  return { 2, used, limit, tonumber(at), now, reset_after(now, window) }
end

if used + cost > limit then
  return { 0, used, limit, retry_after(used, cost, limit, now, window), now }
end

used = record(request, cost, now, window, used)
return { 1, used, limit, now, now, reset_after(now, window) }
