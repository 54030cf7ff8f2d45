-- throttle/lib/fair.lua: a provider's fair queue, shared by the throttle scripts: part of
-- the throttle library's prelude, after throttle/lib/bucket.lua.
-- `crates/tollgate-core/src/fair.rs` is the same queue in process.
--
-- Start-time fair queuing with a tag per ticket, given when it is queued:
-- start = max(v, the finish tag of its user's last ticket), finish = start +
-- 1/weight. Every ticket of the provider waits in ONE sorted set by start tag
-- (ties: arrival order, a time stamp heads the member); a grant pops the least
-- (ZPOPMIN) and sets the virtual clock v to its tag. A user's tickets are
-- spaced 1/weight apart, so a user of weight 4 gets four grants for each one
-- of a user of weight 1 while both wait; a user that starts waiting starts at
-- v (idle time banks no credit); with one user waiting this is FIFO. Queueing
-- and granting are O(log n) in the tickets waiting, with no key per user:
-- a tag per ticket, rather than a queue per user served in turn, is what keeps
-- it near the cost of the FIFO queue (a queue per user made nearly every
-- enqueue over many users create a key and move its user between sets;
-- docs/history/benchmarks-fairness.md, "The cost of it"). A user's state is
-- one hash field, read with v by one HMGET and written by one HSET: the
-- enqueue writes one sorted set, `tickets`, as the FIFO enqueue writes one
-- list (a user's finish tag,
-- its count and v in three sorted sets cost 7-10% more Redis CPU per grant).
--
-- Keys, all on the provider's hash tag; the per-user ones are built here from
-- `base`, the provider's key prefix (ARGV; user ids cannot contain ':' or '{'):
--   tickets sorted set: "<stamp><ticket>" -> start tag (stamp: 14 hex digits
--           of the enqueue's µs, so that equal tags are served in arrival order)
--   capped  sorted set: user -> when to look at its slots again (µs): users
--           with tickets parked by their max_in_flight
--   tags    hash: user -> "<count> <finish>": its tickets waiting (queued or
--           parked) and the finish tag of its last ticket. Kept while the
--           user waits, and after while its finish tag is above v (a user
--           served a moment ago queues again behind what it was given, not
--           at v, ahead of the others); a field of count 0 at or below v is
--           worth nothing: dropped when met, or by a sweep once the fields
--           doubled since the last one (each grant call sweeps a slice: O(1);
--           fair.rs prunes its map alike). Also ':v' -> v, the virtual clock
--           (the start tag of the last grant); ':n' -> the users waiting
--           (count > 0; '0' or none: the provider is idle, the enqueue's
--           test); ':p' -> fields after the last sweep; ':c' -> the
--           sweep's HSCAN cursor while one is under way
--   <base>:held:<user>    sorted set: ticket -> when the slot frees itself
--                         (µs): the user's calls in flight (only under a cap)
--   <base>:parked:<user>  sorted set: "<stamp><ticket>" -> start tag: the
--                         tickets of a user at its cap, out of `tickets` until
--                         a slot ends; they go back at max(v, their tag)
-- A ticket's `waiting` entry is "<deadline_us> <inbox> <stamp> <weight>
-- <max_in_flight, 0 for none> <slot lease µs> <user>": what its grant needs.
-- With nobody waiting, `tags` is dropped: start tags (and v) start again at 0.

-- Every throttle script, FIFO ones too, runs this file's top level on each
-- call: a constant used by a function costs an upvalue each time, so the
-- fields of `tags` that are no user's (':v', ':n', ':p', ':c': no user id
-- contains ':') are written as literals.
--
-- A queue entry that only wakes a throttler (BLMOVE): it is no ticket.
local BELL = '!bell'
-- Hex digits of the stamp heading a member of `tickets`.
local STAMP = 14
-- Most tickets a grant call pops at once.
local BATCH = 128


local function held_key(base, user)
  return base .. ':held:' .. user
end

local function parked_key(base, user)
  return base .. ':parked:' .. user
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

local function fair_stamp(now)
  return string.format('%014x', now) -- STAMP hex digits
end

-- A fair ticket's `waiting` entry; `share`: "<weight> <max_in_flight> <slot lease>
-- <user>" (throttle_enqueue_fair.lua's ARGV[7], checked there).
local function fair_entry(deadline, inbox, stamp, share)
  return int(deadline) .. ' ' .. inbox .. ' ' .. stamp .. ' ' .. share
end

-- deadline, inbox, stamp, weight, cap, lease, user of a fair `waiting` entry
-- (nil when it is not one).
local function fair_parse(w)
  local d, inbox, stamp, weight, cap, lease, user =
    string.match(w, '^(%d+) (%S+) (%x+) (%d+) (%d+) (%d+) (.*)$')
  if not d then
    return nil
  end
  return tonumber(d), inbox, stamp, tonumber(weight), tonumber(cap), tonumber(lease), user
end

-- deadline, inbox, cap, lease, user of a fair `waiting` entry (nil when it is
-- not one): what a grant needs, found by position (the grant's hot path, once
-- per ticket: a pattern over the entry costs about twice as much), and the
-- lease read only under a cap (0 without one).
local function fair_fields(w)
  local sp = string.find(w, ' ', 1, true)
  local sp2 = sp and string.find(w, ' ', sp + 1, true)
  -- The weight starts after the stamp's STAMP digits and a space.
  local sp3 = sp2 and string.find(w, ' ', sp2 + STAMP + 2, true)
  local sp4 = sp3 and string.find(w, ' ', sp3 + 1, true)
  local sp5 = sp4 and string.find(w, ' ', sp4 + 1, true)
  if not sp5 or string.sub(w, sp2 + STAMP + 1, sp2 + STAMP + 1) ~= ' ' then
    return nil
  end
  local cap, lease = string.sub(w, sp3 + 1, sp4 - 1), 0
  if cap == '0' then
    cap = 0
  else
    cap, lease = tonumber(cap), tonumber(string.sub(w, sp4 + 1, sp5 - 1))
  end
  local deadline = tonumber(string.sub(w, 1, sp - 1))
  if not deadline or not cap or not lease then
    return nil
  end
  return deadline, string.sub(w, sp + 1, sp2 - 1), cap, lease, string.sub(w, sp5 + 1)
end

local function fair_v(F)
  return tonumber(redis.call('HGET', F.tags, ':v')) or 0
end

-- Once `tags` has twice the fields it had after the last sweep (`swept`),
-- a slice of it per grant call (128 fields, HSCAN's COUNT, from `cursor`,
-- where the last left off) is swept of the fields worth nothing (count 0, finish at or below
-- v): O(1) per call, and the hash stays within about twice what it has to
-- remember (the users of about the last round), as fair.rs prunes its map.
local function fair_sweep(F, v, swept, cursor)
  if not cursor then
    if redis.call('HLEN', F.tags) <= 2 * math.max(swept, 128) then
      return
    end
    cursor = '0'
  end
  local r = redis.call('HSCAN', F.tags, cursor, 'COUNT', 128)
  local forget = {}
  for i = 1, #r[2], 2 do
    local user, field = r[2][i], r[2][i + 1]
    if string.sub(field, 1, 2) == '0 ' and string.sub(user, 1, 1) ~= ':'
        and tonumber(string.sub(field, 3)) <= v then
      forget[#forget + 1] = user
    end
  end
  if #forget > 0 then
    redis.call('HDEL', F.tags, unpack(forget))
  end
  if r[1] == '0' then
    redis.call('HDEL', F.tags, ':c')
    redis.call('HSET', F.tags, ':p', redis.call('HLEN', F.tags))
  else
    redis.call('HSET', F.tags, ':c', r[1])
  end
end

-- `gone[user]` tickets of each of `users` less waiting (a grant call, or a
-- cancel: one ticket), v at `v` (nil: as it stands): one read and one write
-- of their fields whatever the tickets, and `set` (field, value, ...) written
-- with them. A user left with none is no longer counted as waiting, and is
-- forgotten unless its finish tag is above v. With `sweep`, a slice of the
-- hash is swept too (fair_sweep).
local function fair_account(F, gone, users, v, set, sweep)
  local fields = redis.call('HMGET', F.tags, ':n', ':v', ':p', ':c', unpack(users))
  local n = tonumber(fields[1]) or 0
  v = v or tonumber(fields[2]) or 0
  local forget = {}
  for i, user in ipairs(users) do
    local field = fields[i + 4]
    if field then
      local sp = string.find(field, ' ', 1, true)
      local count = tonumber(string.sub(field, 1, sp - 1))
      local left = count - gone[user]
      if left > 0 then
        set[#set + 1] = user
        set[#set + 1] = left .. string.sub(field, sp)
      else
        if count > 0 then
          n = n - 1
        end
        if tonumber(string.sub(field, sp + 1)) <= v then
          forget[#forget + 1] = user
        else
          set[#set + 1] = user
          set[#set + 1] = '0' .. string.sub(field, sp)
        end
      end
    end
  end
  set[#set + 1] = ':n'
  set[#set + 1] = math.max(0, n)
  redis.call('HSET', F.tags, unpack(set))
  if #forget > 0 then
    redis.call('HDEL', F.tags, unpack(forget))
  end
  if sweep then
    fair_sweep(F, v, tonumber(fields[3]) or 0, fields[4])
  end
end

-- One ticket of `user` less waiting (a cancel).
local function fair_gone(F, user)
  fair_account(F, { [user] = 1 }, { user }, nil, {}, false)
end

-- Slots `user` holds at `now` (freed ones dropped), and when the oldest frees itself.
local function fair_held(F, user, now)
  local key = held_key(F.base, user)
  redis.call('ZREMRANGEBYSCORE', key, '-inf', int(now))
  local first = redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')
  return redis.call('ZCARD', key), tonumber(first[2])
end

-- Parked tickets of `user` go back into `tickets` (at max(v, their tag)) as
-- far as its free slots go; it stays in `capped` while any is left.
local function fair_unpark(F, user, v, now)
  local pk = parked_key(F.base, user)
  local head = redis.call('ZRANGE', pk, 0, 0)[1]
  local w = head and redis.call('HGET', F.waiting, string.sub(head, STAMP + 1))
  local cap, lease
  if w then
    local _
    _, _, _, _, cap, lease = fair_parse(w)
  end
  if not head then
    redis.call('ZREM', F.capped, user)
    return
  end
  if not cap then
    -- Its entry is gone (expired): the ticket is worth nothing.
    redis.call('ZREM', pk, head)
    return fair_unpark(F, user, v, now)
  end
  local held, first = fair_held(F, user, now)
  if held < cap then
    local out = redis.call('ZPOPMIN', pk, cap - held)
    for i = 1, #out, 2 do
      redis.call('ZADD', F.tickets, float(math.max(v, tonumber(out[i + 1]))), out[i])
    end
  end
  if redis.call('EXISTS', pk) == 0 then
    redis.call('ZREM', F.capped, user)
  else
    -- Looked at again when its oldest slot frees itself (or one ends).
    redis.call('ZADD', F.capped, int(first or (now + lease)), user)
  end
end

-- A ticket of a capped user popped at tag `tag`: may it be served now? Not
-- when the user is at its cap, nor when older tickets of it are parked (at
-- max(v, their tag)): then it is parked (and the oldest parked go back as
-- far as slots are free).
local function fair_fits(F, user, member, tag, cap, v, now)
  local pk = parked_key(F.base, user)
  local held = fair_held(F, user, now)
  if held < cap then
    local first = redis.call('ZRANGE', pk, 0, 0, 'WITHSCORES')
    if not first[1] then
      return true
    end
    local ptag = math.max(v, tonumber(first[2]))
    if tag < ptag or (tag == ptag and member < first[1]) then
      return true
    end
  end
  redis.call('ZADD', pk, float(tag), member)
  redis.call('PEXPIRE', pk, int(F.idle))
  fair_unpark(F, user, v, now)
  return false
end

-- With nobody waiting (no ticket queued or parked), the tags start again at
-- 0 (v too): `tags` is dropped.
local function fair_settle(F)
  if redis.call('ZCARD', F.tickets) == 0 and redis.call('ZCARD', F.capped) == 0 then
    redis.call('DEL', F.tags)
  end
end

-- The call of `ticket` ended or its slot was handed back: a user whose
-- tickets are parked gets them back as far as its cap allows (and a
-- throttler is woken). Returns 1 when a slot was held.
local function fair_release(F, queue, user, ticket, now)
  if redis.call('ZREM', held_key(F.base, user), ticket) == 0 then
    return 0
  end
  if redis.call('ZSCORE', F.capped, user) then
    fair_unpark(F, user, fair_v(F), now)
    ring(queue)
  end
  return 1
end
