-- lib/bucket.lua: shared by every throttle script; the `scripts` module prepends
-- it to throttle_*.lua before loading them.
--
-- A provider's token bucket is one hash (the `bucket` key of the provider):
--   tokens  tokens left at time `at` (a float: refill is continuous)
--   at      Redis TIME of the last write, in µs
-- A missing bucket is full. `rate` (tokens/s) and `burst` (capacity) come from the
-- caller's config as ARGV. Time is Redis TIME: pod clocks never decide a slot.
-- Over any interval t the bucket hands out at most burst + rate * t tokens.
--
-- A pause (the upstream refused: throttle_pause.lua) writes `tokens` 0 and
-- `at` the moment it ends, in the future: the bucket refills only from then,
-- so no script grants before it (read here as when Redis TIME went back), and
-- after it the rate comes back from an empty bucket. A pause only takes
-- tokens away: the bound holds through it. Its own fields: `until` (the end
-- of the last pause) and `strikes` (back-offs in a row).
--
-- An adaptive provider (`adaptive = true`: AIMD) refills at an effective
-- rate: a refusal halves it (throttle_pause.lua writes `aimd`, the rate
-- then, and `aimd_at`, the pause's end), and from then it grows back by a
-- tenth of `rate` per second, up to `rate`. Without those fields it is `rate`.
-- Never above `rate`: the bound holds.

local function int(n)
  return string.format('%d', n)
end

local function now_us()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end

-- The effective rate at time `t` of a bucket whose `aimd` fields are
-- `e` and `since` (nil: none, the full `rate`).
local function aimd_rate(e, since, rate, t)
  e, since = tonumber(e), tonumber(since)
  if not e or not since then
    return rate
  end
  return math.min(rate, e + math.max(0, t - since) * rate / 10000000)
end

-- Tokens available at `now` (refilled, capped at burst), the time they refer
-- to, and the effective rate now (`rate` unless adaptive). The refill since
-- the last write counts at the effective rate of then (a growing rate: never
-- more than it allows).
local function bucket_read(bucket, now, rate, burst)
  local v = redis.call('HMGET', bucket, 'tokens', 'at', 'aimd', 'aimd_at')
  local tokens, at = tonumber(v[1]), tonumber(v[2])
  if not tokens or not at then
    return burst, now, rate
  end
  if now > at then
    local r = aimd_rate(v[3], v[4], rate, at)
    tokens = math.min(burst, tokens + (now - at) * r / 1000000)
  else
    now = at -- Redis TIME went back (failover): never refill twice
  end
  return tokens, now, aimd_rate(v[3], v[4], rate, now)
end

-- `eff` is the effective rate bucket_read gave, `rate` the configured one.
local function bucket_write(bucket, tokens, at, eff, burst, rate)
  redis.call('HSET', bucket, 'tokens', string.format('%.17g', tokens), 'at', int(at))
  -- Once full again the bucket equals a missing one: let the key go then
  -- (an adaptive one once its rate is back too: at most 10 s more).
  local ttl = math.ceil((burst - tokens) / eff * 1000) + 1000
  if rate and eff < rate then
    ttl = ttl + 10000
  end
  redis.call('PEXPIRE', bucket, int(ttl))
end

-- µs from `now` until one whole token is due, for a bucket read at `at`
-- (bucket_read): past `now` when the bucket is paused until then.
local function until_token(tokens, rate, at, now)
  return math.max(1, math.ceil((1 - tokens) * 1000000 / rate) + math.max(0, at - now))
end

-- Splits a `waiting` value "<deadline_us> <inbox channel>".
local function parse_waiting(v)
  local sp = string.find(v, ' ', 1, true)
  if not sp then
    return 0, ''
  end
  return tonumber(string.sub(v, 1, sp - 1)) or 0, string.sub(v, sp + 1)
end

-- A provider's `max_concurrent` (0: none): the `inflight` sorted set holds
-- ticket -> the end of its slot's lease (µs). A slot is taken with its grant,
-- renewed by its holder while the call runs and ended by it after
-- (throttle_slot.lua); the slot of a holder that died ends with its lease.
-- Slots free now (math.huge without a cap); expired slots are dropped.
local function slots_free(inflight, cap, now)
  if cap == 0 then
    return math.huge
  end
  redis.call('ZREMRANGEBYSCORE', inflight, '-inf', '(' .. int(now))
  return cap - redis.call('ZCARD', inflight)
end

local function slot_take(inflight, ticket, now, lease)
  redis.call('ZADD', inflight, int(now + lease), ticket)
  redis.call('PEXPIRE', inflight, int(lease / 1000 + 1000))
end

-- µs until the first slot's lease ends (at least 1).
local function slot_next(inflight, now)
  local first = redis.call('ZRANGE', inflight, 0, 0, 'WITHSCORES')
  return math.max(1, (tonumber(first[2]) or now) - now)
end
