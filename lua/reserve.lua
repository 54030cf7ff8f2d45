-- reserve.lua: atomically expire, check and record one spend event.
-- KEYS[1] events, KEYS[2] costs, KEYS[3] plan   (see lib/budget.lua)
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
  -- Exact retry_after: walk the oldest events until their costs free enough room.
  -- Terminates within the log because cost <= limit.
  local need, freed, start = used + cost - limit, 0, 0
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
    for k = 1, #ids do
      freed = freed + (tonumber(costs[k]) or 0)
      if freed >= need then
        return { 0, used, limit, tonumber(batch[2 * k]) + window - now, now }
      end
    end
    start = start + BATCH
  end
  -- Unreachable while the total matches the log; the safe answer is a full window.
  return { 0, used, limit, window, now }
end

redis.call('ZADD', EVENTS, int(now), request)
redis.call('HSET', COSTS, request, int(cost))
used = write_total(used + cost)
-- The newest event expires with the keys: an idle user leaves nothing behind.
redis.call('PEXPIRE', EVENTS, int(window))
redis.call('PEXPIRE', COSTS, int(window))
return { 1, used, limit, now, now, reset_after(now, window) }
