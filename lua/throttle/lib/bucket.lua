-- throttle/lib/bucket.lua: shared by every throttle script: with throttle/lib/fair.lua, the
-- prelude of the throttle function library (tollgate-redis
-- `scripts::THROTTLE`), each throttle_*.lua the body of one of its functions,
-- which starts with `begin(keys, args)`. This top level runs once, when Redis
-- loads the library, not on every call.
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
-- A grant that reaches its waiter later than its provider's late bound may be
-- re-dated instead of lost (throttle_redate.lua): used now, as if granted now.
-- Moving a take from `g` to `r` leaves the bucket's bound (burst + rate·t over
-- the takes' times) intact exactly when the level, with the take moved, would
-- not have reached the cap in between: a bucket that never took it stands one
-- higher on [g, r), and capped there it would have wasted that token's refill.
-- Each re-dating still open over that time adds one more. So a grant made at
-- `g` is re-dated at `r` only while the level stayed at most `floor` =
-- burst - 1 - margin from g to r (`hi`, below) and at most `margin` other
-- grants were re-dated after g (`rf`): level plus those stays <= burst - 1.
-- Its fields: `hi` the time before which the level may have stood above
-- `floor` (a grant made before it is not re-dated; written by every write,
-- at most `at` + 1), `rf` the times of the last margin + 1 re-datings.
-- A pause since `g` (its `until`) forbids it too: no call in a pause.
local function redate_margin(burst)
  return math.floor((burst - 1) / 2)
end

local function redate_floor(burst)
  return burst - 1 - redate_margin(burst)
end

-- An adaptive provider (`adaptive = true`: AIMD) refills at an effective
-- rate: a refusal halves it (throttle_pause.lua writes `aimd`, the rate
-- then, and `aimd_at`, the pause's end), and from then it grows back by a
-- tenth of `rate` per second, up to `rate`. Without those fields it is `rate`.
-- Never above `rate`: the bound holds.

-- The calling function's KEYS and ARGV, set by `begin` at the start of each
-- call (a function gets them as arguments; the bodies read them as a script
-- reads its own).
local KEYS, ARGV

local function begin(keys, args)
  KEYS, ARGV = keys, args
end

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
-- to, the effective rate now (`rate` unless adaptive) and `hi` (above; nil
-- when unwritten). The refill since the last write counts at the effective
-- rate of then (a growing rate: never more than it allows).
local function bucket_read(bucket, now, rate, burst)
  local v = redis.call('HMGET', bucket, 'tokens', 'at', 'aimd', 'aimd_at', 'hi')
  local tokens, at = tonumber(v[1]), tonumber(v[2])
  if not tokens or not at then
    return burst, now, rate, nil
  end
  if now > at then
    local r = aimd_rate(v[3], v[4], rate, at)
    tokens = math.min(burst, tokens + (now - at) * r / 1000000)
  else
    now = at -- Redis TIME went back (failover): never refill twice
  end
  return tokens, now, aimd_rate(v[3], v[4], rate, now), tonumber(v[5])
end

-- `eff` and `hi` are what bucket_read gave, with `pre` its tokens (before
-- this script took or gave any), `rate` the configured one. The level
-- climbed to `pre` since the last write, and is `tokens` from `at` on: above
-- `floor` either way, no grant made before (or, `tokens`, at) `at` is
-- re-dated (`hi`). Unwritten, `hi` starts at `at`: what came before is not known.
local function bucket_write(bucket, tokens, at, eff, burst, rate, pre, hi)
  local floor = redate_floor(burst)
  local mark = (tokens > floor and at + 1) or (pre > floor and at) or nil
  if hi and mark then
    mark = mark > hi and mark or nil
  elseif not hi then
    mark = mark or at
  end
  if mark then
    redis.call('HSET', bucket, 'tokens', string.format('%.17g', tokens), 'at', int(at), 'hi', int(mark))
  else
    redis.call('HSET', bucket, 'tokens', string.format('%.17g', tokens), 'at', int(at))
  end
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

-- A provider's other limits (`limits` in its config: a request limit past
-- the first, token limits): each a bucket of its own, one field of the
-- provider's `bucket` hash, "<level> <at_us>" (a missing field is full),
-- refilled continuously from `at` and never paused. A grant takes one from
-- each request limit and its ticket's weight from each token limit, with
-- the request bucket's token, in the same script: it is made only when every
-- one of them holds enough. The caller gives them as one ARGV, `spec`:
-- "<field> <burst> <rate> ..." per limit, `field` "r:<per_ms>" or
-- "t:<per_ms>" (the kind, then its window: one field per kind and window),
-- "" for none. A ticket's weight rides at its end: "<ticket>*<weight>"
-- (none: 1).

-- The limits of `spec`: nil for none, false when it is malformed.
local function limits_parse(spec)
  if not spec or spec == '' then
    return nil
  end
  local L = {}
  for field, cap, rate in string.gmatch(spec, '(%S+) (%S+) (%S+)') do
    cap, rate = tonumber(cap), tonumber(rate)
    local kind = string.sub(field, 1, 2)
    if not cap or cap < 1 or not rate or rate <= 0 or (kind ~= 'r:' and kind ~= 't:') then
      return false
    end
    L[#L + 1] = { field = field, cap = cap, rate = rate, weighted = kind == 't:' }
  end
  return #L > 0 and L or false
end

-- A ticket's weight (its "*<weight>" tail; 1 without one).
local function weight_of(ticket)
  return tonumber(string.match(ticket, '%*(%d+)$')) or 1
end

-- Reads every limit's level at `now` (refilled, at most its burst) into L.
local function limits_read(bucket, L, now)
  local fields = {}
  for i, l in ipairs(L) do
    fields[i] = l.field
  end
  local v = redis.call('HMGET', bucket, unpack(fields))
  for i, l in ipairs(L) do
    local level, at
    if v[i] then
      local a, b = string.match(v[i], '^(%S+) (%d+)$')
      level, at = tonumber(a), tonumber(b)
    end
    if not level or not at then
      l.level, l.at = l.cap, now
    elseif now > at then
      l.level, l.at = math.min(l.cap, level + (now - at) * l.rate / 1000000), now
    else
      -- Redis TIME went back (failover): never refill twice.
      l.level, l.at = math.min(l.cap, level), at
    end
  end
end

-- 0 when every limit holds what a grant of weight `w` takes, else the µs
-- until all do; math.huge when one never can (`w` past its burst).
local function limits_wait(L, w, now)
  local wait = 0
  for _, l in ipairs(L) do
    local need = l.weighted and w or 1
    if need > l.cap then
      return math.huge
    end
    if l.level < need then
      wait = math.max(wait, math.ceil((need - l.level) * 1000000 / l.rate) + math.max(0, l.at - now))
    end
  end
  return wait
end

-- A grant of weight `w` takes from every limit (`sign` 1), or gives back
-- (-1; at most to the burst).
local function limits_take(L, w, sign)
  for _, l in ipairs(L) do
    l.level = math.min(l.cap, l.level - sign * (l.weighted and w or 1))
  end
end

-- Writes every limit; returns the ms until the last is full again (the
-- `bucket` key must live that long: a missing field reads as full).
local function limits_write(bucket, L)
  local args, ms = {}, 0
  for _, l in ipairs(L) do
    args[#args + 1] = l.field
    args[#args + 1] = string.format('%.17g', l.level) .. ' ' .. int(l.at)
    ms = math.max(ms, math.ceil((l.cap - l.level) / l.rate * 1000))
  end
  redis.call('HSET', bucket, unpack(args))
  return ms
end

-- Keeps `bucket` at least `ms` more (never shortens its life).
local function bucket_keep(bucket, ms)
  local ttl = redis.call('PTTL', bucket)
  if ttl ~= -2 and ttl < ms then
    redis.call('PEXPIRE', bucket, int(ms))
  end
end
