-- throttle_cancel.lua: a waiter gives up (timeout, or its caller went away).
-- KEYS[1] queue, KEYS[2] waiting, KEYS[3] granted, KEYS[4] bucket
--   (see throttle_grant.lua)
-- KEYS[5] active, KEYS[6] capped, KEYS[7] idle, KEYS[8] fair, KEYS[9] shares
--   (lib/fair.lua)
-- ARGV[1] ticket, ARGV[2] rate, ARGV[3] burst
-- ARGV[4] 'fair' or 'fifo': the queue the ticket was put in
-- ARGV[5] the user whose queue holds a fair ticket
-- ARGV[6] the provider's key base (for the per-user keys)
-- Returns 1 when the ticket was still waiting (removed: no token was spent;
-- a user with no ticket left leaves the rotation), 2 when a grant had been made
-- for it meanwhile (the token goes back to the bucket, the slot to its user's
-- cap), 0 when there is neither (served and consumed, or never queued).
-- With the grant script this decides exactly once who owns a token: the grant
-- record is removed either here or never (a waiter that resumed does not cancel).

local QUEUE, WAITING, GRANTED, BUCKET = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local F = { active = KEYS[5], capped = KEYS[6], idle = KEYS[7], fair = KEYS[8],
  shares = KEYS[9], base = ARGV[6] }
local ticket, rate, burst = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local user = ARGV[4] == 'fair' and ARGV[5] or nil
if not rate or rate <= 0 or not burst or burst < 1 or not F.base or F.base == '' then
  return redis.error_reply('throttle_cancel: bad rate, burst or key base')
end
if redis.call('HDEL', WAITING, ticket) == 1 then
  if user then
    local fq = fq_key(F.base, user)
    redis.call('LREM', fq, 1, ticket)
    if redis.call('LLEN', fq) == 0 then
      fair_leave(F, user)
      fair_settle(F)
    end
  else
    -- Usually still queued; if a throttler holds it in its processing list,
    -- the grant script drops it there, finding no `waiting` entry.
    redis.call('LREM', QUEUE, 1, ticket)
  end
  return 1
end
if redis.call('ZREM', GRANTED, ticket) == 1 then
  local now = now_us()
  local tokens, at = bucket_read(BUCKET, now, rate, burst)
  bucket_write(BUCKET, math.min(burst, tokens + 1), at, rate, burst)
  if user then
    fair_release(F, QUEUE, user, ticket, now)
  end
  return 2
end
return 0
