-- lib/fair.lua: a provider's fair queue (start-time fair queuing over per-user
-- queues), shared by the throttle scripts; the `scripts` module prepends it,
-- after lib/bucket.lua. `crates/tollgate-core/src/fair.rs` is the same queue
-- in process.
--
-- Keys, all on the provider's hash tag; the per-user ones are built here from
-- `base`, the provider's key prefix (ARGV; user ids cannot contain ':' or '{'):
--   active  sorted set: user -> start tag of its head ticket (users to serve)
--   capped  sorted set: user -> when its oldest slot frees itself (µs): users
--           with tickets, held back by their max_in_flight
--   idle    sorted set: user -> its next start tag, while not in active
--   fair    hash: v -> the virtual clock (the start tag of the last grant)
--   shares  hash: user -> "<weight> <max_in_flight, 0 for none> <hold µs>"
--   <base>:fq:<user>    list: the user's tickets, oldest first
--   <base>:held:<user>  sorted set: ticket -> when the slot frees itself (µs):
--                       the user's calls in flight (kept only under a cap)
-- The user with the least start tag is served next (O(log n) in the users
-- waiting); a grant sets v to that tag and moves the user's tag on by
-- 1/weight. A user that starts waiting starts at max(v, its tag): idle time
-- banks no credit. With one user waiting this is FIFO.

-- A queue entry that only wakes a throttler (BLMOVE): it is no ticket.
local BELL = '!bell'

local function fq_key(base, user)
  return base .. ':fq:' .. user
end

local function held_key(base, user)
  return base .. ':held:' .. user
end

local function float(n)
  return string.format('%.17g', n)
end

-- Rings the bell unless one is already rung; returns whether it rang.
local function ring(queue)
  if redis.call('LLEN', queue) == 0 then
    redis.call('RPUSH', queue, BELL)
    return true
  end
  return false
end

-- weight, max_in_flight (0: none), hold (µs) of a user with tickets.
local function fair_share(F, user)
  local s = redis.call('HGET', F.shares, user)
  local w, c, h = string.match(s or '', '^(%S+) (%S+) (%S+)$')
  return tonumber(w) or 1, tonumber(c) or 0, tonumber(h) or 60000000
end

local function fair_v(F)
  return tonumber(redis.call('HGET', F.fair, 'v')) or 0
end

-- Slots `user` holds at `now` (freed ones dropped), and when the oldest frees itself.
local function fair_held(F, user, now)
  local key = held_key(F.base, user)
  redis.call('ZREMRANGEBYSCORE', key, '-inf', int(now))
  local first = redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')
  return redis.call('ZCARD', key), tonumber(first[2])
end

-- `user` (with tickets) joins the rotation at max(v, its tag).
local function fair_activate(F, user)
  local v = fair_v(F)
  local tag = tonumber(redis.call('ZSCORE', F.idle, user))
  if tag then
    redis.call('ZREM', F.idle, user)
  else
    tag = v
  end
  redis.call('ZREM', F.capped, user)
  redis.call('ZADD', F.active, float(math.max(v, tag)), user)
end

-- `user` leaves the rotation; `tag` is where it starts when it comes back.
local function fair_park(F, user, tag)
  redis.call('ZREM', F.active, user)
  redis.call('ZADD', F.idle, float(tag), user)
end

-- `user` has no ticket left: out of the rotation and of the capped set.
local function fair_leave(F, user)
  local tag = tonumber(redis.call('ZSCORE', F.active, user))
  if tag then
    fair_park(F, user, tag)
  end
  redis.call('ZREM', F.capped, user)
  redis.call('HDEL', F.shares, user)
end

-- With nobody waiting, v jumps past every tag and the idle users are
-- forgotten; otherwise the tags at or below v (worth v anyway) are dropped.
local function fair_settle(F)
  if redis.call('ZCARD', F.active) == 0 and redis.call('ZCARD', F.capped) == 0 then
    local top = redis.call('ZRANGE', F.idle, -1, -1, 'WITHSCORES')
    if top[2] then
      redis.call('HSET', F.fair, 'v', float(math.max(fair_v(F), tonumber(top[2]))))
    end
    redis.call('DEL', F.idle)
  else
    redis.call('ZREMRANGEBYSCORE', F.idle, '-inf', float(fair_v(F)))
  end
end

-- The call of `ticket` ended or its slot was handed back: a user held back by
-- its cap rejoins (and a throttler is woken). Returns 1 when a slot was held.
local function fair_release(F, queue, user, ticket, now)
  if redis.call('ZREM', held_key(F.base, user), ticket) == 0 then
    return 0
  end
  if redis.call('ZSCORE', F.capped, user) then
    local _, cap = fair_share(F, user)
    local held, first = fair_held(F, user, now)
    if held < cap then
      fair_activate(F, user)
      ring(queue)
    else
      redis.call('ZADD', F.capped, int(first), user)
    end
  end
  return 1
end
