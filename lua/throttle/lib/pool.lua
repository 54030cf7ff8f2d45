-- throttle/lib/pool.lua: a provider's pool of upstream accounts (`members`
-- in its config), for the grant and cancel scripts. A provider served as
-- one upstream (no members, or a pool of one: its member's limits are the
-- provider's) never reaches this file.
--
-- Each member has its own buckets, under the provider's key base (its hash
-- tag): `<base>:m:<name>:bucket` (its request bucket and its other limits,
-- as throttle/lib/bucket.lua writes a provider's) and `<base>:m:<name>:inflight`
-- (its max_concurrent). A grant takes from one member, chosen in the grant
-- script's one atomic step, so no member ever passes its own limits:
--   1. the user's sticky member (`<base>:sticky`: user -> the member that
--      served its last call), if it holds what the call takes in every limit
--      (providers' prompt caches are per account);
--   2. else the member that holds it with the fewest grants per weight
--      (`<base>:m:n`: member -> its grants while the pool is busy);
--   3. else none: the ticket waits, in its turn, for the first member that
--      will hold it.
-- The member that took a grant is its readiness payload's third word and
-- `<base>:m:granted`'s value (ticket -> member), so the scripts that give a
-- grant back (throttle_cancel.lua) find its bucket.
--
-- The caller gives the members as one ARGV, `spec`: per member
-- "<name> <rate> <burst> <max_concurrent> <weight>[ <limits>]", `limits`
-- being throttle/lib/bucket.lua's spec of its other limits, members
-- separated by "|".

-- Most entries of `<base>:sticky`: past it the hash starts again (users
-- lose their member, not their place).
local STICKY_MAX = 100000

-- The pool of `spec` under `base`: nil for none, false when it is malformed.
local function pool_parse(spec, base)
  if not spec or spec == '' then
    return nil
  end
  local P = { sticky = base .. ':sticky', counts = base .. ':m:n', by = base .. ':m:granted',
    users = {} }
  for part in string.gmatch(spec, '[^|]+') do
    local name, rate, burst, slots, weight, rest =
      string.match(part, '^(%S+) (%S+) (%S+) (%d+) (%d+) ?(.*)$')
    rate, burst, slots, weight = tonumber(rate), tonumber(burst), tonumber(slots), tonumber(weight)
    if not name or not rate or rate <= 0 or not burst or burst < 1 or not slots
        or not weight or weight < 1 or P[name] then
      return false
    end
    local L = limits_parse(rest)
    if L == false then
      return false
    end
    local key = base .. ':m:' .. name
    local m = { name = name, rate = rate, burst = burst, slots = slots, weight = weight,
      L = L, bucket = key .. ':bucket', inflight = key .. ':inflight', took = 0 }
    P[#P + 1] = m
    -- Member names are never numbers' strings only: a string key never
    -- meets the list's integer ones.
    P[name] = m
  end
  return #P > 0 and P or false
end

-- The member `name` of P (nil when the pool no longer lists it).
local function pool_member(P, name)
  local m = name and P[name]
  return type(m) == 'table' and m.bucket and m or nil
end

-- Reads member m's buckets at `now`, once per call.
local function pool_load(m, now)
  if m.tokens then
    return
  end
  m.tokens, m.at, m.eff, m.hi = bucket_read(m.bucket, now, m.rate, m.burst)
  m.pre = m.tokens
  if m.L then
    limits_read(m.bucket, m.L, now)
  end
  m.free = slots_free(m.inflight, m.slots, now)
end

-- Whether m holds what a grant of weight `w` takes, in every limit.
local function pool_fits(m, w, now)
  pool_load(m, now)
  return m.tokens >= 1 and m.free >= 1 and (not m.L or limits_wait(m.L, w, now) == 0)
end

-- The member that takes a grant of weight `w` for `user` (nil: FIFO, no
-- user), or nil when none holds it now.
local function pool_choose(P, user, w, now)
  local sticky
  if user then
    sticky = P.users[user]
    if sticky == nil then
      sticky = redis.call('HGET', P.sticky, user) or false
      P.users[user] = sticky
    end
    local m = pool_member(P, sticky)
    if m and pool_fits(m, w, now) then
      return m
    end
  end
  if not P.counted then
    local names = {}
    for i, m in ipairs(P) do
      names[i] = m.name
    end
    local v = redis.call('HMGET', P.counts, unpack(names))
    for i, m in ipairs(P) do
      m.n = tonumber(v[i]) or 0
    end
    P.counted = true
  end
  local best, score
  for _, m in ipairs(P) do
    if pool_fits(m, w, now) then
      local s = m.n / m.weight
      if not best or s < score then
        best, score = m, s
      end
    end
  end
  return best
end

-- µs until some member holds a grant of weight `w`, and whether every member
-- waits for a slot of its max_concurrent (then the wait is until the first
-- slot's lease ends, and a slot that ends sooner rings a throttler awake);
-- math.huge when no member ever can (`w` past each one's burst).
local function pool_wait(P, w, now)
  local wait, slot, full = math.huge, math.huge, true
  for _, m in ipairs(P) do
    pool_load(m, now)
    local lw = m.L and limits_wait(m.L, w, now) or 0
    if lw < math.huge then
      if m.free < 1 then
        slot = math.min(slot, slot_next(m.inflight, now))
      else
        full = false
        wait = math.min(wait, math.max(m.tokens >= 1 and 0 or until_token(m.tokens, m.eff, m.at, now), lw))
      end
    end
  end
  if full and slot < math.huge then
    return slot, true
  end
  return wait, false
end

-- How many grants the members could make now, at most (each one's whole
-- tokens, at most its free slots): how many tickets to pop at once.
local function pool_room(P, now)
  local room = 0
  for _, m in ipairs(P) do
    pool_load(m, now)
    room = room + math.max(0, math.min(math.floor(m.tokens), m.free))
  end
  return room
end

-- A grant of weight `w` for `ticket` (of `user`, nil for FIFO) takes from m.
local function pool_take(P, m, ticket, user, w, now, lease)
  m.tokens = m.tokens - 1
  m.free = m.free - 1
  if m.L then
    limits_take(m.L, w, 1)
  end
  if m.slots > 0 then
    slot_take(m.inflight, ticket, now, lease)
  end
  m.took = m.took + 1
  m.n = (m.n or 0) + 1
  P.by_args = P.by_args or {}
  P.by_args[#P.by_args + 1] = ticket
  P.by_args[#P.by_args + 1] = m.name
  if user and P.users[user] ~= m.name then
    P.users[user] = m.name
    P.moved = P.moved or {}
    P.moved[#P.moved + 1] = user
    P.moved[#P.moved + 1] = m.name
  end
end

-- Writes what the grants took: each member's buckets, its count, the
-- users' sticky members and the tickets' members; every key lives `idle`
-- (ms) from now, the buckets as throttle/lib/bucket.lua keeps them.
local function pool_write(P, idle)
  local counts = {}
  for _, m in ipairs(P) do
    if m.took > 0 then
      bucket_write(m.bucket, m.tokens, m.at, m.eff, m.burst, m.rate, m.pre, m.hi)
      if m.L then
        bucket_keep(m.bucket, limits_write(m.bucket, m.L) + 1000)
      end
      counts[#counts + 1] = m.name
      counts[#counts + 1] = int(m.n)
    end
  end
  if #counts > 0 then
    redis.call('HSET', P.counts, unpack(counts))
    redis.call('PEXPIRE', P.counts, int(idle))
  end
  if P.moved then
    if redis.call('HLEN', P.sticky) > STICKY_MAX then
      redis.call('DEL', P.sticky)
    end
    redis.call('HSET', P.sticky, unpack(P.moved))
    redis.call('PEXPIRE', P.sticky, int(idle))
  end
  if P.by_args then
    redis.call('HSET', P.by, unpack(P.by_args))
    redis.call('PEXPIRE', P.by, int(idle))
  end
end

-- Forgets the members of the grants `granted` drops (older than `before`,
-- µs): call before trimming it.
local function pool_trim(P, granted, before)
  local old = redis.call('ZRANGE', granted, '-inf', '(' .. int(before), 'BYSCORE')
  if #old > 0 then
    redis.call('HDEL', P.by, unpack(old))
  end
end
