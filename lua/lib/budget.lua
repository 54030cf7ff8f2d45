-- lib/budget.lua: shared by every budget script; the `scripts` module prepends it
-- to reserve.lua, refund.lua, settle.lua and usage.lua before loading them.
--
-- One user's budget lives in five keys sharing the user's hash tag:
--   KEYS[1] events  sorted set: request id -> time (ms) the tokens were spent
--   KEYS[2] costs   hash: request id -> cost, plus the field ':total', the running
--                   sum of live costs (':' never occurs in a request id)
--   KEYS[3] plan    string: the user's plan name (absent: the default plan)
--   KEYS[4] owners  hash: request id -> '<state> <nonce> <deadline_ms> <operation>
--                   <fingerprint>' for a charge taken by charge.lua, the record of
--                   who owns it: state 'h' (held by its submission: no job has
--                   claimed it yet) or 'j' (owned by its job). A plain reserve has
--                   no entry. An entry leaves with its event.
--   KEYS[5] holds   sorted set: request id -> end of the hold (ms) of each 'h'
--                   charge: its job's deadline plus a grace. A charge still held
--                   then has no job that can run (a job past its deadline never
--                   starts), so the next budget step releases it.
-- The plan table comes from the caller's config as ARGV triples
-- (name, limit, window_ms), the default plan first.
-- Time is Redis TIME: pod clocks never decide a budget.

local EVENTS, COSTS, PLAN, OWNERS, HOLDS = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local TOTAL = ':total'
local BATCH = 500

local function int(n)
  return string.format('%d', n)
end

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- Returns name, limit, window_ms of the user's plan, reading the table from ARGV[i].
local function resolve_plan(i)
  local stored = redis.call('GET', PLAN)
  if stored then
    for j = i, #ARGV - 2, 3 do
      if ARGV[j] == stored then
        return ARGV[j], tonumber(ARGV[j + 1]), tonumber(ARGV[j + 2])
      end
    end
  end
  -- No stored plan, or one the config no longer has: the default.
  return ARGV[i], tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2])
end

-- The running total. If it went missing (eviction), rebuild it once from the costs.
local function read_total()
  local t = redis.call('HGET', COSTS, TOTAL)
  if t then
    return tonumber(t)
  end
  local sum = 0
  for _, c in ipairs(redis.call('HVALS', COSTS)) do
    sum = sum + tonumber(c)
  end
  if sum > 0 then
    redis.call('HSET', COSTS, TOTAL, int(sum))
  end
  return sum
end

local function write_total(used)
  if used < 0 then
    used = 0
  end
  redis.call('HSET', COSTS, TOTAL, int(used))
  return used
end

-- Drops events at or past their expiry (time + window <= now), and charges still
-- held past their hold (their submission died before a job claimed them),
-- subtracting their costs from the total. Each event is dropped once, so the cost
-- is amortised O(log n) per call whatever the number of live events.
local function expire(now, window)
  local used = read_total()
  local changed = false
  for _, source in ipairs({ { EVENTS, now - window }, { HOLDS, now } }) do
    while true do
      local ids = redis.call('ZRANGE', source[1], '-inf', source[2], 'BYSCORE', 'LIMIT', 0, BATCH)
      if #ids == 0 then
        break
      end
      for _, c in ipairs(redis.call('HMGET', COSTS, unpack(ids))) do
        if c then
          used = used - tonumber(c)
        end
      end
      redis.call('HDEL', COSTS, unpack(ids))
      redis.call('ZREM', EVENTS, unpack(ids))
      redis.call('HDEL', OWNERS, unpack(ids))
      redis.call('ZREM', HOLDS, unpack(ids))
      changed = true
    end
  end
  if changed then
    used = write_total(used)
  end
  return used
end

-- Milliseconds until the oldest live event leaves the window, or -1 when none.
local function reset_after(now, window)
  local oldest = redis.call('ZRANGE', EVENTS, 0, 0, 'WITHSCORES')
  if #oldest == 0 then
    return -1
  end
  return tonumber(oldest[2]) + window - now
end

-- Removes one event; returns its cost, or nil when it is not live.
local function remove(request, used)
  local c = redis.call('HGET', COSTS, request)
  if not c then
    return nil, used
  end
  redis.call('HDEL', COSTS, request)
  redis.call('ZREM', EVENTS, request)
  redis.call('HDEL', OWNERS, request)
  redis.call('ZREM', HOLDS, request)
  return tonumber(c), write_total(used - tonumber(c))
end

-- The owner record of a charge: state, nonce, deadline, operation, fingerprint.
local function owner(request)
  local o = redis.call('HGET', OWNERS, request)
  if not o then
    return nil
  end
  local state, nonce, deadline, op, fp = string.match(o, '^(%S+) (%S+) (%S+) (%S+) (%S+)$')
  return { state = state, nonce = nonce, deadline = tonumber(deadline), op = op, fp = fp }
end

-- The exact retry_after of a cost that does not fit: walk the oldest events
-- until their costs free enough room. Terminates within the log because
-- cost <= limit; returns a full window if the total and the log disagree.
local function retry_after(used, cost, limit, now, window)
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
        return tonumber(batch[2 * k]) + window - now
      end
    end
    start = start + BATCH
  end
  return window
end

-- Records a spend event of `cost` at `now`; the keys expire with it, so an idle
-- user leaves nothing behind.
local function record(request, cost, now, window, used)
  redis.call('ZADD', EVENTS, int(now), request)
  redis.call('HSET', COSTS, request, int(cost))
  used = write_total(used + cost)
  for _, key in ipairs({ EVENTS, COSTS, OWNERS, HOLDS }) do
    redis.call('PEXPIRE', key, int(window))
  end
  return used
end

