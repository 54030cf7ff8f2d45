-- throttle_usage.lua: an answer reported the tokens its call used: the
-- difference from what its grant took (its weight) goes back to the
-- provider's token limits, or is taken from them.
-- KEYS[1] bucket   the provider's bucket hash (throttle/lib/bucket.lua: its other
--                  limits are fields of it)
-- ARGV[1] the provider's other limits (throttle/lib/bucket.lua), not ""
-- ARGV[2] the weight the grant took, ARGV[3] the tokens the call used
-- Each token limit is refilled to now, then moved by weight - used, never
-- past its burst nor below minus its burst; request limits are left alone
-- (the call was one request whatever it weighed). Given back, the tokens are
-- as if the grant had taken only what was used: the limit never holds more
-- than then, so the upstream's bound holds for what it counts. Taken, they
-- are the debt of a declared weight too low (a client's max_tokens of 1 on
-- a call that used 500): the level goes below empty, and later grants wait
-- for the refill to pay it, so no declaration buys more than the upstream
-- allows over time. The debt is bounded by a minute of the limit's refill
-- (or its burst, if more): a report past any sense delays the provider by
-- about a minute at most, not forever.
-- Sent once, as every bucket script (a lost reply is not sent again).
-- Returns the signed difference asked for (weight - used).

local L = limits_parse(ARGV[1])
local weight, used = tonumber(ARGV[2]), tonumber(ARGV[3])
if not L or not weight or weight < 1 or not used or used < 0 then
  return redis.error_reply('throttle_usage: bad limits, weight or usage')
end
local delta = weight - used
if delta == 0 then
  return 0
end
local now = now_us()
limits_read(KEYS[1], L, now)
for _, l in ipairs(L) do
  if l.weighted then
    l.level = math.max(-math.max(l.cap, l.rate * 60), math.min(l.cap, l.level + delta))
  end
end
bucket_keep(KEYS[1], limits_write(KEYS[1], L) + 1000)
return delta
