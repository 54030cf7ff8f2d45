-- throttle_enqueue.lua: a waiter asks for a slot of one provider.
-- KEYS[1] queue    list of tickets, oldest first       (see keys.rs, ThrottleKeys)
-- KEYS[2] waiting  hash: ticket -> "<deadline_us> <inbox channel>"
-- KEYS[3] bucket   the token bucket (throttle/lib/bucket.lua)
-- ARGV[1] ticket (unique per acquire: "<request id>~<random>")
-- ARGV[2] inbox channel the waiter's process is subscribed to (before this call)
-- ARGV[3] max_wait in µs: after that the ticket is worth nothing
-- ARGV[4] idle ttl in ms of the provider's keys
-- ARGV[5] rate (tokens/s), ARGV[6] burst
-- KEYS[4] inflight the provider's slots (throttle/lib/bucket.lua)
-- ARGV[7] max_concurrent (0: none), ARGV[8] a slot's lease, µs
-- ARGV[9] the provider's other limits (throttle/lib/bucket.lua; "" for none); the
--         ticket's weight is its "*<weight>" tail
-- ARGV[10] "1" for a provider with a pool of members (throttle/lib/pool.lua):
--          the grant script chooses the member, so its tickets always queue
-- Returns { 2, now_us } granted at once: nobody is queued and the bucket has a
-- token (and a slot free), which this call takes (the waiter goes ahead: no throttler, no
-- publish, no delay between the grant and its use); { 1, now_us } queued for a
-- throttler; { 0 } when the ticket is already waiting. An error when it
-- would be granted on the way in but weighs more than a limit's burst (the
-- waiter refuses those before: ThrottleError::TooHeavy; a queued one is
-- dropped by the grant script).

local ticket, inbox = ARGV[1], ARGV[2]
local max_wait, idle = tonumber(ARGV[3]), tonumber(ARGV[4])
local rate, burst = tonumber(ARGV[5]), tonumber(ARGV[6])
local slots, lease = tonumber(ARGV[7]), tonumber(ARGV[8])
if not slots or slots < 0 or not lease or lease < 1 then
  return redis.error_reply('throttle_enqueue: bad max_concurrent or lease')
end
if not max_wait or max_wait < 0 or not idle or idle < 1 or not rate or rate <= 0
    or not burst or burst < 1 then
  return redis.error_reply('throttle_enqueue: bad max_wait, idle ttl, rate or burst')
end
if redis.call('HEXISTS', KEYS[2], ticket) == 1 then
  return { 0 }
end
local now = now_us()
-- Nobody queued: not in the queue, and not popped into a throttler's
-- processing list either (a ticket there is still `waiting` until granted or
-- given up). An empty queue alone let a light call pass a heavy one that a
-- throttler held, waiting for its tokens.
if ARGV[10] ~= '1' and redis.call('HLEN', KEYS[2]) == 0 then
  -- The other limits are read only here: a saturated provider's enqueue
  -- (the common case under load) only queues.
  local L = limits_parse(ARGV[9])
  if L == false then
    return redis.error_reply('throttle_enqueue: bad limits')
  end
  local w = L and weight_of(ticket) or 1
  if L then
    limits_read(KEYS[3], L, now)
    if limits_wait(L, w, now) == math.huge then
      return redis.error_reply('throttle_enqueue: the ticket weighs more than a limit holds')
    end
  end
  local tokens, at, eff, hi = bucket_read(KEYS[3], now, rate, burst)
  if tokens >= 1 and slots_free(KEYS[4], slots, now) > 0 and (not L or limits_wait(L, w, now) == 0) then
    bucket_write(KEYS[3], tokens - 1, at, eff, burst, rate, tokens, hi)
    if L then
      limits_take(L, w, 1)
      bucket_keep(KEYS[3], limits_write(KEYS[3], L) + 1000)
    end
    if slots > 0 then
      slot_take(KEYS[4], ticket, now, lease)
    end
    return { 2, now }
  end
end
redis.call('HSET', KEYS[2], ticket, int(now + max_wait) .. ' ' .. inbox)
redis.call('RPUSH', KEYS[1], ticket)
redis.call('PEXPIRE', KEYS[1], int(idle))
redis.call('PEXPIRE', KEYS[2], int(idle))
return { 1, now }
