-- throttle_enqueue_fair.lua: a waiter asks for a slot of a fair provider: its
-- ticket gets its start tag and joins the provider's tickets (throttle/lib/fair.lua).
-- KEYS[1] queue    list: only bells here (a throttler's wake-up, see throttle/lib/fair.lua)
-- KEYS[2] waiting  hash: ticket -> its entry (throttle/lib/fair.lua)
-- KEYS[3] bucket   the token bucket (throttle/lib/bucket.lua)
-- KEYS[4] tickets, KEYS[5] capped, KEYS[6] tags (throttle/lib/fair.lua)
-- ARGV[1] ticket (unique per acquire: "<request id>~<random>")
-- ARGV[2] inbox channel the waiter's process is subscribed to (before this call)
-- ARGV[3] max_wait in µs: after that the ticket is worth nothing
-- ARGV[4] idle ttl in ms of the provider's keys
-- ARGV[5] rate (tokens/s), ARGV[6] burst
-- ARGV[7] the waiter's share: "<weight> <max_in_flight> <slot lease> <user>":
--         weight >= 1, max_in_flight 0 for none, its slots' lease under the cap, µs > 0,
--         user "" for the anonymous queue. It is the tail of the ticket's
--         `waiting` entry as it stands: one argument, checked by one pattern
--         and copied (four checked one by one cost the enqueue ~1 µs).
-- ARGV[8] the provider's key base (for the per-user keys)
-- KEYS[7] inflight the provider's slots (throttle/lib/bucket.lua)
-- ARGV[9] max_concurrent (0: none), ARGV[10] a slot's lease, µs
-- ARGV[11] the provider's other limits (throttle/lib/bucket.lua; "" for none); the
--          ticket's weight is its "*<weight>" tail. An error when it would be
--          granted on the way in but weighs more than a limit's burst (the
--          waiter refuses those before; a queued one is dropped by the grant).
-- ARGV[12] "1" for a provider with a pool of members (throttle/lib/pool.lua):
--          the grant script chooses the member, so its tickets always queue
-- Returns { 2, now_us } granted at once: nobody waits, the bucket has a token
-- and the user is below its cap; { 1, now_us } queued for a throttler;
-- { 0 } when the ticket is already waiting.

-- count, finish of a `tags` field, and the finish as written (0, 0, '0'
-- for none).
local function fair_user(field)
  if not field then
    return 0, 0, '0'
  end
  local sp = string.find(field, ' ', 1, true)
  local finish = string.sub(field, sp + 1)
  return tonumber(string.sub(field, 1, sp - 1)), tonumber(finish), finish
end

-- A `tags` field: `count` tickets waiting, finish tag `finish` (written
-- exactly: a whole number as one, which is most tags, and faster).
local function fair_field(count, finish)
  if finish % 1 == 0 and finish < 9007199254740992 then
    return string.format('%d %d', count, finish)
  end
  return string.format('%d %.17g', count, finish)
end

local QUEUE, WAITING, BUCKET = KEYS[1], KEYS[2], KEYS[3]
local TICKETS, CAPPED, TAGS = KEYS[4], KEYS[5], KEYS[6]
local ticket, inbox, share, base = ARGV[1], ARGV[2], ARGV[7], ARGV[8]
local max_wait, idle = tonumber(ARGV[3]), tonumber(ARGV[4])
local weight, cap, cap_lease, user = string.match(share or '', '^(%d+) (%d+) (%d+) (.*)$')
weight = tonumber(weight)
if not max_wait or max_wait < 0 or not idle or idle < 1 or not weight or weight < 1
    or not base or base == '' or inbox == '' or string.find(inbox, ' ', 1, true) then
  return redis.error_reply('throttle_enqueue_fair: bad arguments')
end
-- Numbers are read only where they are used (a tonumber costs about as much
-- as a Redis command called from here): the lease under a cap, the bucket's
-- rate and burst when the provider is idle; checked before any write.
if cap == '0' then
  cap = 0
else
  cap, cap_lease = tonumber(cap), tonumber(cap_lease)
  if cap_lease < 1 then
    return redis.error_reply('throttle_enqueue_fair: bad arguments')
  end
end
local now = now_us()
-- The user's count and finish tag, v, and the users waiting: one read (and
-- one write below).
local state = redis.call('HMGET', TAGS, user, ':v', ':n')
-- Nobody waiting (so neither is this ticket): the provider was idle. (`:n`
-- counts the users with tickets queued or parked, throttle/lib/fair.lua: the one read
-- answers this too. Tickets of the FIFO queue left from before a switch to
-- "fair" are not counted: they are served first by the next grant call, but
-- one arrival may take a free token past them.)
local idle_before = not state[3] or state[3] == '0'
if idle_before and ARGV[12] ~= '1' and (cap == 0 or fair_held({ base = base }, user, now) < cap) then
  local rate, burst = tonumber(ARGV[5]), tonumber(ARGV[6])
  if not rate or rate <= 0 or not burst or burst < 1 then
    return redis.error_reply('throttle_enqueue_fair: bad arguments')
  end
  local slots, lease = tonumber(ARGV[9]), tonumber(ARGV[10])
  if not slots or slots < 0 or not lease or lease < 1 then
    return redis.error_reply('throttle_enqueue_fair: bad arguments')
  end
  -- The other limits are read only here: a saturated provider's enqueue
  -- (the common case under load) only queues.
  local L = limits_parse(ARGV[11])
  if L == false then
    return redis.error_reply('throttle_enqueue_fair: bad arguments')
  end
  local w = L and weight_of(ticket) or 1
  if L then
    limits_read(BUCKET, L, now)
    if limits_wait(L, w, now) == math.huge then
      return redis.error_reply('throttle_enqueue_fair: the ticket weighs more than a limit holds')
    end
  end
  local tokens, at, eff, hi = bucket_read(BUCKET, now, rate, burst)
  if tokens >= 1 and slots_free(KEYS[7], slots, now) > 0 and (not L or limits_wait(L, w, now) == 0) then
    bucket_write(BUCKET, tokens - 1, at, eff, burst, rate, tokens, hi)
    if L then
      limits_take(L, w, 1)
      bucket_keep(BUCKET, limits_write(BUCKET, L) + 1000)
    end
    if slots > 0 then
      slot_take(KEYS[7], ticket, now, lease)
    end
    if cap > 0 then
      local held = held_key(base, user)
      redis.call('ZADD', held, int(now + cap_lease), ticket)
      redis.call('PEXPIRE', held, int(cap_lease / 1000 + 1000))
    end
    return { 2, now }
  end
end
local count, finish, start_s = fair_user(state[1])
local start = tonumber(state[2]) or 0
if finish > start then
  start = finish
else
  start_s = state[2] or '0'
end
local stamp = fair_stamp(now)
if redis.call('HSETNX', WAITING, ticket, fair_entry(now + max_wait, inbox, stamp, share)) == 0 then
  return { 0 }
end
if count == 0 then
  -- It starts waiting.
  redis.call('HSET', TAGS, user, fair_field(1, start + 1 / weight), ':n', (tonumber(state[3]) or 0) + 1)
else
  redis.call('HSET', TAGS, user, fair_field(count + 1, start + 1 / weight))
end
-- A user with parked tickets queues behind them (its own order).
local into = TICKETS
if cap > 0 and redis.call('ZSCORE', CAPPED, user) then
  into = parked_key(base, user)
end
redis.call('ZADD', into, start_s, stamp .. ticket)
-- Keys written here live `idle` from now. While tickets wait, the provider's
-- keys exist and every grant call renews them (throttle_grant.lua): only an
-- idle provider's (maybe new) keys, and a parked ticket's, need it here.
if idle_before then
  for _, key in ipairs({ WAITING, TICKETS, TAGS }) do
    redis.call('PEXPIRE', key, int(idle))
  end
end
if into ~= TICKETS then
  redis.call('PEXPIRE', into, int(idle))
end
if ring(QUEUE) then
  redis.call('PEXPIRE', QUEUE, int(idle))
end
return { 1, now }
