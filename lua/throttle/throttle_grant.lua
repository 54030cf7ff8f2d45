-- throttle_grant.lua: a throttler serves one provider's waiters from its bucket.
-- KEYS[1] queue       list of tickets, oldest first
-- KEYS[2] processing  this throttler's list of tickets it popped (BLMOVE) but not served
-- KEYS[3] waiting     hash: ticket -> "<deadline_us> <inbox channel>"
-- KEYS[4] granted     sorted set: ticket -> grant time (µs); the readiness record
-- KEYS[5] bucket      the token bucket (throttle/lib/bucket.lua)
-- KEYS[6] tickets, KEYS[7] capped, KEYS[8] tags (throttle/lib/fair.lua)
-- KEYS[9] inflight    the provider's slots (throttle/lib/bucket.lua)
-- ARGV[1] rate (tokens/s), ARGV[2] burst
-- ARGV[3] most grants in this call
-- ARGV[4] how long a readiness record lives, µs
-- ARGV[5] idle ttl in ms of the provider's keys
-- ARGV[6] the provider's key base (for the per-user keys of its fair queue)
-- ARGV[7] max_concurrent (0: none), ARGV[8] a slot's lease, µs: a grant takes
--         a slot too; with none free, nothing is granted
-- ARGV[9] the provider's other limits (throttle/lib/bucket.lua; "" for none): a grant
--         takes from each too (one request, or its ticket's weight); a
--         ticket waits, in its turn, until every one holds enough, and one
--         heavier than a limit's burst (refused at enqueue; left by a config
--         change) is dropped
-- ARGV[10] the provider's pool (throttle/lib/pool.lua; "" for a provider served as
--         one upstream): each grant takes from one member's buckets, the
--         provider's own (KEYS[5], KEYS[9], ARGV[7], ARGV[9]) are not used,
--         and the readiness payload names the member: "<ticket> <granted_at_us>
--         <member>"
-- Serves the processing list first, then the queue head, in order (FIFO
-- tickets; bells are dropped), then the fair queue's tickets, least start
-- tag first (throttle/lib/fair.lua; a ticket of a user at its cap is parked), popped
-- as many at a time as there are tokens and grants left (one ZPOPMIN, HMGET,
-- HDEL and ZADD for them all, but a PUBLISH each): a ticket nobody
-- waits for any more (cancelled, or past its deadline) is dropped without a token;
-- a waited-for ticket gets a token, a readiness record and a PUBLISH of
-- "<ticket> <granted_at_us>" on its inbox, all in this one atomic step. An
-- inbox under the provider's key base (`<base>:inbox:<process>`, what waiters
-- use on a Redis Cluster) gets an SPUBLISH instead: sharded pub/sub, sent on
-- the shard that owns the provider rather than to every node.
-- Returns { granted, skipped, wait_us, more, capped_us }: wait_us > 0 when the
-- bucket ran dry with tickets left (the exact time until the next token, a
-- pause's end included: throttle/lib/bucket.lua), more
-- = 1 when the grant limit stopped the call with tickets left, capped_us > 0
-- when only users held back by their cap, or the provider's max_concurrent,
-- hold tickets back (the time until the first of their slots frees itself: a
-- throttler blocks no longer than that; a slot that ends rings it awake).

local QUEUE, PROCESSING, WAITING, GRANTED, BUCKET = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local F = { tickets = KEYS[6], capped = KEYS[7], tags = KEYS[8], waiting = KEYS[3],
  base = ARGV[6], idle = tonumber(ARGV[5]) }
local rate, burst = tonumber(ARGV[1]), tonumber(ARGV[2])
local limit, ready_ttl, idle = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local INFLIGHT, slots, lease = KEYS[9], tonumber(ARGV[7]), tonumber(ARGV[8])
if not slots or slots < 0 or not lease or lease < 1 then
  return redis.error_reply('throttle_grant: bad max_concurrent or lease')
end
local L = limits_parse(ARGV[9])
if L == false then
  return redis.error_reply('throttle_grant: bad limits')
end
local P = pool_parse(ARGV[10], ARGV[6] or '')
if P == false then
  return redis.error_reply('throttle_grant: bad pool')
end
if P then
  -- The pool's members each have their own: the provider's are not read.
  L, slots = nil, 0
end
if not rate or rate <= 0 or not burst or burst < 1 or not limit or not ready_ttl or not idle
    or not F.base or F.base == '' then
  return redis.error_reply('throttle_grant: bad rate, burst or limits')
end

-- PUBLISH, or SPUBLISH on a channel in the provider's slot (see above).
local sharded = F.base .. ':'
local function publish(inbox, payload)
  if string.sub(inbox, 1, #sharded) == sharded then
    redis.call('SPUBLISH', inbox, payload)
  else
    redis.call('PUBLISH', inbox, payload)
  end
end

local now = now_us()
if P then
  pool_trim(P, GRANTED, now - ready_ttl)
end
redis.call('ZREMRANGEBYSCORE', GRANTED, '-inf', '(' .. int(now - ready_ttl))
local tokens, at, eff, hi, pre, free
if P then
  -- What the members hold, once read (throttle/lib/pool.lua): these stand
  -- for any of them until a ticket is matched to one.
  tokens, free = math.huge, math.huge
else
  tokens, at, eff, hi = bucket_read(BUCKET, now, rate, burst)
  pre = tokens
  if L then
    limits_read(BUCKET, L, now)
  end
  free = slots_free(INFLIGHT, slots, now)
end

-- What a grant of `ticket` (weight `w`) takes: a token, its weight of the
-- other limits, and a slot of the provider's max_concurrent.
local function take(ticket, w)
  tokens = tokens - 1
  free = free - 1
  if L then
    limits_take(L, w, 1)
  end
  if slots > 0 then
    slot_take(INFLIGHT, ticket, now, lease)
  end
end

-- A pool's grant of `ticket` (weight `w`, of `user`: nil for FIFO) on
-- member m; its payload names m.
local function take_on(m, ticket, user, w)
  pool_take(P, m, ticket, user, w, now, lease)
end

-- Tickets wait for a slot of the provider's max_concurrent (a pool: of
-- every member that could grant them; `pool_slot`, µs until the first ends).
local full, pool_slot = false, nil
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
    elseif free < 1 then
      full = true
      break
    elseif P then
      local w = weight_of(ticket)
      local m = pool_choose(P, nil, w, now)
      if m then
        take_on(m, ticket, nil, w)
        redis.call('LPOP', src)
        redis.call('HDEL', WAITING, ticket)
        redis.call('ZADD', GRANTED, int(now), ticket)
        publish(inbox, ticket .. ' ' .. int(now) .. ' ' .. m.name)
        granted = granted + 1
      else
        local pw, slotted = pool_wait(P, w, now)
        if pw == math.huge then
          redis.call('LPOP', src)
          redis.call('HDEL', WAITING, ticket)
          skipped = skipped + 1
        elseif slotted then
          full, pool_slot = true, pw
          break
        else
          wait = pw
          break
        end
      end
    else
      local w = L and weight_of(ticket) or 1
      local lw = L and limits_wait(L, w, now) or 0
      if lw == math.huge then
        redis.call('LPOP', src)
        redis.call('HDEL', WAITING, ticket)
        skipped = skipped + 1
      elseif tokens >= 1 and lw == 0 then
        take(ticket, w)
        redis.call('LPOP', src)
        redis.call('HDEL', WAITING, ticket)
        redis.call('ZADD', GRANTED, int(now), ticket)
        publish(inbox, ticket .. ' ' .. int(now))
        granted = granted + 1
      else
        wait = math.max(tokens >= 1 and 0 or until_token(tokens, eff, at, now), lw)
        break
      end
    end
  end
end

-- The fair queue. Users with parked tickets whose oldest slot freed itself
-- (a caller that never said its call ended) get them back first.
local fifo_left = wait > 0 or more == 1 or full
-- Whether the fair queue had anyone (its keys' lives are renewed below).
local fair_touched = false
-- The virtual clock: the tag of the last grant, written once at the end.
local v
if not fifo_left then
  for _, user in ipairs(redis.call('ZRANGE', F.capped, '-inf', int(now), 'BYSCORE', 'LIMIT', 0, 100)) do
    fair_touched = true
    v = v or fair_v(F)
    fair_unpark(F, user, v, now)
  end
end
-- The tag of the last grant in this call, as popped.
local granted_v
-- Tickets gone per user in this call (each user's count goes down once, at
-- the end), and those users in the order met.
local gone, gone_users = {}, {}
local function gone_of(user)
  local n = gone[user]
  if not n then
    gone_users[#gone_users + 1] = user
  end
  gone[user] = (n or 0) + 1
end
-- Tickets are known to be left.
local left = false
-- `tickets` was found empty; then, with `capped` empty too, nobody waits.
local drained, nobody = false, false
local now_s = int(now)
while not fifo_left and wait == 0 and more == 0 do
  -- A pool: what its members could grant now (tokens and free slots alike).
  local room = P and pool_room(P, now)
  if granted >= limit or tokens < 1 or free < 1 or room == 0 then
    if redis.call('ZCARD', F.tickets) > 0 then
      fair_touched, left = true, true
      if granted >= limit then
        more = 1
      elseif P then
        local pw, slotted = pool_wait(P, 1, now)
        if slotted then
          full, pool_slot = true, pw
        else
          wait = math.max(1, pw)
        end
      elseif tokens < 1 then
        wait = until_token(tokens, eff, at, now)
      else
        full = true
      end
    end
    break
  end
  -- As many tickets as could be granted, popped at once, least tag first:
  -- each is granted (a token), dropped (none) or parked (none).
  local k = math.min(limit - granted, room or math.floor(tokens), BATCH, free)
  local top = redis.call('ZPOPMIN', F.tickets, k)
  local n = #top / 2
  if n == 0 then
    drained = true
    break
  end
  fair_touched = true
  local ids = {}
  for i = 1, n do
    ids[i] = string.sub(top[2 * i - 1], STAMP + 1)
  end
  local entries = redis.call('HMGET', WAITING, unpack(ids))
  local done, grants = {}, {}
  -- A ticket parked: `tickets` may have changed (the user's older parked
  -- tickets went back), so the rest of the batch goes back too.
  local parked_at
  -- A ticket the other limits cannot grant yet: it and the rest go back.
  local stop_at
  for i = 1, n do
    -- The tag as popped (a string: read as a number only where compared).
    local ticket, tag = ids[i], top[2 * i]
    local deadline, inbox, cap, hold, user
    if entries[i] then
      deadline, inbox, cap, hold, user = fair_fields(entries[i])
    end
    local w, lw, m = 1, 0, nil
    if P and deadline and deadline >= now then
      w = weight_of(ticket)
      m = pool_choose(P, user, w, now)
      if not m then
        local slotted
        lw, slotted = pool_wait(P, w, now)
        lw = math.max(1, lw)
        if slotted and lw < math.huge then
          full, pool_slot = true, lw
        end
      end
    elseif L and deadline and deadline >= now then
      w = weight_of(ticket)
      lw = limits_wait(L, w, now)
    end
    if not deadline then
      -- No entry (its keys expired): nobody to serve.
      skipped = skipped + 1
    elseif deadline < now or lw == math.huge then
      done[#done + 1] = ticket
      gone_of(user)
      skipped = skipped + 1
    elseif lw > 0 then
      stop_at = i
      if not full then
        wait = lw
      end
      break
    elseif cap == 0 or fair_fits(F, user, top[2 * i - 1], tonumber(tag), cap,
        granted_v and tonumber(granted_v) or v or fair_v(F), now) then
      if m then
        take_on(m, ticket, user, w)
        publish(inbox, ticket .. ' ' .. now_s .. ' ' .. m.name)
      else
        take(ticket, w)
        publish(inbox, ticket .. ' ' .. now_s)
      end
      done[#done + 1] = ticket
      grants[#grants + 1] = now_s
      grants[#grants + 1] = ticket
      granted = granted + 1
      granted_v = tag
      gone_of(user)
      if cap > 0 then
        local hk = held_key(F.base, user)
        redis.call('ZADD', hk, int(now + hold), ticket)
        redis.call('PEXPIRE', hk, int(hold / 1000 + 1000))
      end
    else
      parked_at = i
      break
    end
  end
  local back_from = stop_at or (parked_at and parked_at + 1)
  if back_from and back_from <= n then
    local back = {}
    for i = 2 * back_from - 1, #top, 2 do
      back[#back + 1] = top[i + 1]
      back[#back + 1] = top[i]
    end
    redis.call('ZADD', F.tickets, unpack(back))
  end
  if #done > 0 then
    redis.call('HDEL', WAITING, unpack(done))
  end
  if #grants > 0 then
    redis.call('ZADD', GRANTED, unpack(grants))
  end
  if stop_at then
    fair_touched, left = true, true
    break
  end
  if n < k and not parked_at then
    drained = true
    break
  end
end
if fair_touched and drained and redis.call('ZCARD', F.capped) == 0 then
  -- Nobody waits: the tags start again at 0 (throttle/lib/fair.lua), every count is 0.
  nobody = true
  redis.call('DEL', F.tags)
elseif fair_touched then
  if #gone_users > 0 then
    -- The counts of the users served or dropped, v (one HSET), and a slice
    -- of the hash swept when it has grown.
    fair_account(F, gone, gone_users, granted_v and tonumber(granted_v) or v,
      granted_v and { ':v', granted_v } or {}, true)
  end
  if not left then
    fair_settle(F)
  end
  -- Written above (or by the enqueue, cancel and done scripts since): they
  -- live `idle` from now (the enqueue script leaves it to this while tickets
  -- wait). They were given it together: renewed together, when `tickets`
  -- (the one an enqueue may create while others wait) has none, or half of it
  -- is gone, or is gone itself while tickets are parked.
  local ttl = redis.call('PTTL', F.tickets)
  if ttl == -1 or (ttl >= 0 and ttl < idle / 2)
      or (ttl == -2 and redis.call('ZCARD', F.capped) > 0) then
    for _, key in ipairs({ WAITING, F.tickets, F.capped, F.tags }) do
      redis.call('PEXPIRE', key, int(idle))
    end
  end
end
local capped_us = 0
if wait == 0 and more == 0 and not nobody then
  local first = redis.call('ZRANGE', F.capped, 0, 0, 'WITHSCORES')
  if first[2] then
    capped_us = math.max(1, tonumber(first[2]) - now)
  end
end
if full and wait == 0 and more == 0 then
  local slot_us = P and (pool_slot or 1) or slot_next(INFLIGHT, now)
  capped_us = capped_us > 0 and math.min(capped_us, slot_us) or slot_us
end

if granted > 0 and P then
  pool_write(P, idle)
  redis.call('PEXPIRE', GRANTED, int(idle))
elseif granted > 0 then
  bucket_write(BUCKET, tokens, at, eff, burst, rate, pre, hi)
  if L then
    bucket_keep(BUCKET, limits_write(BUCKET, L) + 1000)
  end
  redis.call('PEXPIRE', GRANTED, int(idle))
end
return { granted, skipped, wait, more, capped_us }
