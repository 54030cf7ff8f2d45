-- throttle_cancel.lua: a waiter gives up (timeout, or its caller went away).
-- KEYS[1] queue, KEYS[2] waiting, KEYS[3] granted, KEYS[4] bucket
--   (see throttle_grant.lua)
-- KEYS[5] tickets, KEYS[6] capped, KEYS[7] tags (throttle/lib/fair.lua)
-- KEYS[8] inflight (throttle/lib/bucket.lua): a granted ticket's slot of the
--   provider's max_concurrent ends with it (a throttler is rung)
-- ARGV[1] ticket, ARGV[2] rate, ARGV[3] burst
-- ARGV[4] 'fair' or 'fifo': the queue the ticket was put in
-- ARGV[5] the user of a fair ticket
-- ARGV[6] the provider's key base (for the per-user keys)
-- ARGV[7] the provider's late bound in µs: a grant older than this is never
--         used (the waiters' rule), and its token never comes back either
-- ARGV[8] the provider's other limits (throttle/lib/bucket.lua; "" for none): a grant
--         given back within the late bound gives back what it took of each
--         (the ticket's weight: its "*<weight>" tail), paused or not
-- ARGV[9] the provider's pool (throttle/lib/pool.lua; "" for none): a grant goes
--         back to the member that took it (`<base>:m:granted`), as above
--         with its buckets in place of the provider's; one of a member no
--         longer listed gives back nothing but its record
-- Returns 1 when the ticket was still waiting (removed: no token was spent;
-- a user with no ticket left is no longer counted as waiting), 2 when a grant
-- had been made for it within the late bound (the token goes back to the
-- bucket, the slot to its user's cap), 3 when one had been made longer ago
-- (the slot goes back, the token is lost: given back now, it would add to the
-- tokens the bucket granted since, and a waiter paused for a while, cancelling
-- its many grants at once, would refill the bucket past what time allows),
-- 4 when one had been made within the bound but the bucket is paused since
-- (throttle_pause.lua: the pause emptied the bucket, and a token given back
-- would be granted before the pause ends; the slot goes back, the token does
-- not), 0 when there is neither (served and consumed, or never queued). With
-- the grant script this decides exactly once who owns a token:
-- the grant record is removed either here or never (a waiter that resumed
-- does not cancel). The tag the ticket took stays spent (its user's later
-- tickets keep theirs): at most 1/weight of a round.

local QUEUE, WAITING, GRANTED, BUCKET = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local F = { tickets = KEYS[5], capped = KEYS[6], tags = KEYS[7], waiting = WAITING,
  base = ARGV[6] }
local ticket, rate, burst = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local user = ARGV[4] == 'fair' and ARGV[5] or nil
local late = tonumber(ARGV[7])
local L = limits_parse(ARGV[8])
if L == false then
  return redis.error_reply('throttle_cancel: bad limits')
end
if not rate or rate <= 0 or not burst or burst < 1 or not F.base or F.base == ''
    or not late or late < 0 then
  return redis.error_reply('throttle_cancel: bad rate, burst, key base or late bound')
end
local P = pool_parse(ARGV[9], F.base)
if P == false then
  return redis.error_reply('throttle_cancel: bad pool')
end
local w = redis.call('HGET', WAITING, ticket)
if w then
  redis.call('HDEL', WAITING, ticket)
  local _, _, stamp, _, _, _, owner = fair_parse(w)
  if stamp then
    local member = stamp .. ticket
    if redis.call('ZREM', F.tickets, member) == 0 then
      local pk = parked_key(F.base, owner)
      redis.call('ZREM', pk, member)
      if redis.call('EXISTS', pk) == 0 then
        redis.call('ZREM', F.capped, owner)
      end
    end
    fair_gone(F, owner)
    fair_settle(F)
  else
    -- Usually still queued; if a throttler holds it in its processing list,
    -- the grant script drops it there, finding no `waiting` entry.
    redis.call('LREM', QUEUE, 1, ticket)
  end
  return 1
end
local granted_at = tonumber(redis.call('ZSCORE', GRANTED, ticket))
local INFLIGHT = KEYS[8]
if granted_at and P then
  -- The member that took it, in place of the provider.
  local m = pool_member(P, redis.call('HGET', P.by, ticket))
  redis.call('HDEL', P.by, ticket)
  if not m then
    redis.call('ZREM', GRANTED, ticket)
    if user then
      fair_release(F, QUEUE, user, ticket, now_us())
    end
    return 3
  end
  BUCKET, INFLIGHT, L, rate, burst = m.bucket, m.inflight, m.L, m.rate, m.burst
end
if granted_at then
  redis.call('ZREM', GRANTED, ticket)
  if redis.call('ZREM', INFLIGHT, ticket) == 1 then
    ring(QUEUE)
  end
  local now = now_us()
  if user then
    fair_release(F, QUEUE, user, ticket, now)
  end
  if now - granted_at > late then
    return 3
  end
  -- The other limits are never paused: what the grant took goes back.
  local keep = 0
  if L then
    limits_read(BUCKET, L, now)
    limits_take(L, weight_of(ticket), -1)
    keep = limits_write(BUCKET, L) + 1000
  end
  local tokens, at, eff, hi = bucket_read(BUCKET, now, rate, burst)
  if at > now then
    return 4
  end
  bucket_write(BUCKET, math.min(burst, tokens + 1), at, eff, burst, rate, tokens, hi)
  if L then
    bucket_keep(BUCKET, keep)
  end
  return 2
end
return 0
