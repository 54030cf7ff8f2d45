-- throttle_cancel.lua: a waiter gives up (timeout, or its caller went away).
-- KEYS[1] queue, KEYS[2] waiting, KEYS[3] granted, KEYS[4] bucket
--   (see throttle_grant.lua)
-- ARGV[1] ticket, ARGV[2] rate, ARGV[3] burst
-- Returns 1 when the ticket was still waiting (removed: no token was spent),
-- 2 when a grant had been made for it meanwhile (the token goes back to the
-- bucket), 0 when there is neither (served and consumed, or never queued).
-- With the grant script this decides exactly once who owns a token: the grant
-- record is removed either here or never (a waiter that resumed does not cancel).

local QUEUE, WAITING, GRANTED, BUCKET = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local ticket, rate, burst = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
if not rate or rate <= 0 or not burst or burst < 1 then
  return redis.error_reply('throttle_cancel: bad rate or burst')
end
if redis.call('HDEL', WAITING, ticket) == 1 then
  -- Usually still queued; if a throttler holds it in its processing list, the
  -- grant script drops it there, finding no `waiting` entry.
  redis.call('LREM', QUEUE, 1, ticket)
  return 1
end
if redis.call('ZREM', GRANTED, ticket) == 1 then
  local tokens, at = bucket_read(BUCKET, now_us(), rate, burst)
  bucket_write(BUCKET, math.min(burst, tokens + 1), at, rate, burst)
  return 2
end
return 0
