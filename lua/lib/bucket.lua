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

local function int(n)
  return string.format('%d', n)
end

local function now_us()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end

-- Tokens available at `now` (refilled, capped at burst), and the time they refer to.
local function bucket_read(bucket, now, rate, burst)
  local v = redis.call('HMGET', bucket, 'tokens', 'at')
  local tokens, at = tonumber(v[1]), tonumber(v[2])
  if not tokens or not at then
    return burst, now
  end
  if now > at then
    tokens = math.min(burst, tokens + (now - at) * rate / 1000000)
  else
    now = at -- Redis TIME went back (failover): never refill twice
  end
  return tokens, now
end

local function bucket_write(bucket, tokens, at, rate, burst)
  redis.call('HSET', bucket, 'tokens', string.format('%.17g', tokens), 'at', int(at))
  -- Once full again the bucket equals a missing one: let the key go then.
  redis.call('PEXPIRE', bucket, int(math.ceil((burst - tokens) / rate * 1000) + 1000))
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
