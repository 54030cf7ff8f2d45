-- throttle_grant.lua: a throttler serves one provider's waiters from its bucket.
-- KEYS[1] queue       list of tickets, oldest first
-- KEYS[2] processing  this throttler's list of tickets it popped (BLMOVE) but not served
-- KEYS[3] waiting     hash: ticket -> "<deadline_us> <inbox channel>"
-- KEYS[4] granted     sorted set: ticket -> grant time (µs); the readiness record
-- KEYS[5] bucket      the token bucket (lib/bucket.lua)
-- KEYS[6] active, KEYS[7] capped, KEYS[8] idle, KEYS[9] fair, KEYS[10] shares
--   (lib/fair.lua)
-- ARGV[1] rate (tokens/s), ARGV[2] burst
-- ARGV[3] most grants in this call
-- ARGV[4] how long a readiness record lives, µs
-- ARGV[5] idle ttl in ms of the provider's keys
-- ARGV[6] the provider's key base (for the per-user keys of its fair queue)
-- Serves the processing list first, then the queue head, in order (FIFO
-- tickets; bells are dropped), then the fair queue's users, least start tag
-- first (lib/fair.lua), each in its own order: a ticket nobody
-- waits for any more (cancelled, or past its deadline) is dropped without a token;
-- a waited-for ticket gets a token, a readiness record and a PUBLISH of
-- "<ticket> <granted_at_us>" on its inbox, all in this one atomic step. An
-- inbox under the provider's key base (`<base>:inbox:<process>`, what waiters
-- use on a Redis Cluster) gets an SPUBLISH instead: sharded pub/sub, sent on
-- the shard that owns the provider rather than to every node.
-- Returns { granted, skipped, wait_us, more, capped_us }: wait_us > 0 when the
-- bucket ran dry with tickets left (the exact time until the next token), more
-- = 1 when the grant limit stopped the call with tickets left, capped_us > 0
-- when only users held back by their cap have tickets left (the time until the
-- first of their slots frees itself: a throttler blocks no longer than that).

local QUEUE, PROCESSING, WAITING, GRANTED, BUCKET = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local F = { active = KEYS[6], capped = KEYS[7], idle = KEYS[8], fair = KEYS[9],
  shares = KEYS[10], base = ARGV[6] }
local rate, burst = tonumber(ARGV[1]), tonumber(ARGV[2])
local limit, ready_ttl, idle = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
if not rate or rate <= 0 or not burst or burst < 1 or not limit or not ready_ttl or not idle
    or not F.base or F.base == '' then
  return redis.error_reply('throttle_grant: bad rate, burst or limits')
end

-- PUBLISH, or SPUBLISH on a channel in the provider's slot (see above).
local function publish(inbox, payload)
  if string.sub(inbox, 1, #F.base + 1) == F.base .. ':' then
    redis.call('SPUBLISH', inbox, payload)
  else
    redis.call('PUBLISH', inbox, payload)
  end
end

local now = now_us()
redis.call('ZREMRANGEBYSCORE', GRANTED, '-inf', '(' .. int(now - ready_ttl))
local tokens, at = bucket_read(BUCKET, now, rate, burst)
local granted, skipped, wait, more = 0, 0, 0, 0
while true do
  local src = PROCESSING
  local ticket = redis.call('LINDEX', PROCESSING, 0)
  if not ticket then
    src = QUEUE
    ticket = redis.call('LINDEX', QUEUE, 0)
  end
  if not ticket then
    break
  end
  if ticket == BELL then
    redis.call('LPOP', src)
  elseif granted >= limit then
    more = 1
    break
  else
    local w = redis.call('HGET', WAITING, ticket)
    local deadline, inbox = 0, ''
    if w then
      deadline, inbox = parse_waiting(w)
    end
    if not w or deadline < now then
      redis.call('LPOP', src)
      redis.call('HDEL', WAITING, ticket)
      skipped = skipped + 1
    elseif tokens >= 1 then
      tokens = tokens - 1
      redis.call('LPOP', src)
      redis.call('HDEL', WAITING, ticket)
      redis.call('ZADD', GRANTED, int(now), ticket)
      publish(inbox, ticket .. ' ' .. int(now))
      granted = granted + 1
    else
      wait = until_token(tokens, rate)
      break
    end
  end
end

-- The fair queue. Users whose oldest slot freed itself (a caller that never
-- said its call ended) rejoin first.
local fifo_left = wait > 0 or more == 1
-- Whether the fair queue had anyone (its keys' lives are renewed below).
local fair_touched = false
if not fifo_left then
  for _, user in ipairs(redis.call('ZRANGE', F.capped, '-inf', int(now), 'BYSCORE', 'LIMIT', 0, 100)) do
    fair_touched = true
    local _, cap = fair_share(F, user)
    local held, first = fair_held(F, user, now)
    if held < cap then
      fair_activate(F, user)
    else
      redis.call('ZADD', F.capped, int(first), user)
    end
  end
end
-- Each user's share, read once per call.
local shares_of = {}
local function share_of(user)
  local s = shares_of[user]
  if not s then
    s = { fair_share(F, user) }
    shares_of[user] = s
  end
  return s[1], s[2], s[3]
end
-- The user being served, taken out of `active` (ZPOPMIN) with its start tag
-- `tag`: it goes on while its tag stays the least, then goes back (ZADD) or
-- leaves. `nxt_user`/`nxt_tag`: the least of the others (read once per user
-- served: nothing else changes `active` meanwhile). `v`: the virtual clock,
-- written once at the end.
local user, tag, fq, nxt_user, nxt_tag, peeked, v
while not fifo_left and wait == 0 and more == 0 do
  if not user then
    local top = redis.call('ZPOPMIN', F.active)
    if not top[1] then
      break
    end
    user, tag, peeked = top[1], tonumber(top[2]), false
    fq = fq_key(F.base, user)
    fair_touched = true
  end
  local ticket = redis.call('LPOP', fq)
  local w = ticket and redis.call('HGET', WAITING, ticket)
  local deadline, inbox = 0, ''
  if w then
    deadline, inbox = parse_waiting(w)
  end
  local served, stop = false, false
  if not ticket then
    -- Nothing left: leaves below.
  elseif not w or deadline < now then
    if w then
      redis.call('HDEL', WAITING, ticket)
    end
    skipped = skipped + 1
  else
    local weight, cap, hold = share_of(user)
    local held, first = 0, nil
    if cap > 0 then
      held, first = fair_held(F, user, now)
    end
    if cap > 0 and held >= cap then
      -- At its cap: out of the rotation until a slot ends (throttle_done.lua).
      redis.call('LPUSH', fq, ticket)
      redis.call('ZADD', F.idle, float(tag), user)
      redis.call('ZADD', F.capped, int(first), user)
      user = nil
    elseif granted >= limit or tokens < 1 then
      redis.call('LPUSH', fq, ticket)
      if granted >= limit then
        more = 1
      else
        wait = until_token(tokens, rate)
      end
      stop = true
    else
      tokens = tokens - 1
      redis.call('HDEL', WAITING, ticket)
      redis.call('ZADD', GRANTED, int(now), ticket)
      publish(inbox, ticket .. ' ' .. int(now))
      granted = granted + 1
      v = tag
      if cap > 0 then
        local hk = held_key(F.base, user)
        redis.call('ZADD', hk, int(now + hold), ticket)
        redis.call('PEXPIRE', hk, int(hold / 1000 + 1000))
      end
      tag = tag + 1 / weight
      served = true
    end
  end
  if user and not stop then
    if not ticket or redis.call('LLEN', fq) == 0 then
      -- No ticket left: out of the rotation, back at `tag` when it waits again.
      redis.call('ZADD', F.idle, float(tag), user)
      redis.call('HDEL', F.shares, user)
      user = nil
    elseif served then
      if not peeked then
        local top = redis.call('ZRANGE', F.active, 0, 0, 'WITHSCORES')
        nxt_user, nxt_tag, peeked = top[1], tonumber(top[2]), true
      end
      if nxt_user and (nxt_tag < tag or (nxt_tag == tag and nxt_user < user)) then
        redis.call('ZADD', F.active, float(tag), user)
        user = nil
      end
    end
  end
end
if user then
  redis.call('ZADD', F.active, float(tag), user)
end
if v then
  redis.call('HSET', F.fair, 'v', float(v))
end
fair_settle(F)
if fair_touched then
  -- Written above (or by throttle_cancel/done since): they live `idle` from
  -- now, as the enqueue script's keys do.
  for _, key in ipairs({ F.active, F.capped, F.idle, F.fair }) do
    redis.call('PEXPIRE', key, int(idle))
  end
end
local capped_us = 0
if wait == 0 and more == 0 then
  local first = redis.call('ZRANGE', F.capped, 0, 0, 'WITHSCORES')
  if first[2] then
    capped_us = math.max(1, tonumber(first[2]) - now)
  end
end

if granted > 0 then
  bucket_write(BUCKET, tokens, at, rate, burst)
  redis.call('PEXPIRE', GRANTED, int(idle))
end
return { granted, skipped, wait, more, capped_us }
