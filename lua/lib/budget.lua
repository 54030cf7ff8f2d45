-- lib/budget.lua: shared by every budget script; the `scripts` module prepends it
-- to reserve.lua, refund.lua, settle.lua and usage.lua before loading them.
--
-- One user's budget lives in three keys sharing the user's hash tag:
--   KEYS[1] events  sorted set: request id -> time (ms) the tokens were spent
--   KEYS[2] costs   hash: request id -> cost, plus the field ':total', the running
--                   sum of live costs (':' never occurs in a request id)
--   KEYS[3] plan    string: the user's plan name (absent: the default plan)
-- The plan table comes from the caller's config as ARGV triples
-- (name, limit, window_ms), the default plan first.
-- Time is Redis TIME: pod clocks never decide a budget.

local EVENTS, COSTS, PLAN = KEYS[1], KEYS[2], KEYS[3]
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

-- Drops events at or past their expiry (time + window <= now) and subtracts their
-- costs from the total. Each event is dropped once, so the cost is amortised O(log n)
-- per call whatever the number of live events.
local function expire(now, window)
  local used = read_total()
  local changed = false
  while true do
    local ids = redis.call('ZRANGE', EVENTS, '-inf', now - window, 'BYSCORE', 'LIMIT', 0, BATCH)
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
    changed = true
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
  return tonumber(c), write_total(used - tonumber(c))
end

