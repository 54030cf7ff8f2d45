-- lib/budget.lua: shared by every budget script; the `scripts` module loads it
-- with the budget scripts as one function library (FUNCTION LOAD), each script
-- the body of a function that starts with `begin(keys, args)`.
--
-- One user's budget lives in keys sharing the user's hash tag. A live spend
-- event is one entry of the log stream plus one entry of an index bucket, both
-- kept listpack-encoded by Redis (no per-event allocation): about 60 B of Redis
-- memory per reserve and 100 B per charge with the ids the api generates, where
-- a sorted set and hashes keyed by request id cost 230-390 B.
--   KEYS[7] log     stream: one entry per live event, its ID '<at_ms>-<seq>' (the
--                   time the tokens were spent; Redis keeps IDs increasing, so
--                   the log is in time order and XRANGE reads a window), one
--                   field 'r': what never changes, packed: the request id (a
--                   UUID or 'idem-' + 32 hex as 16 bytes, any other id as is),
--                   and for a charge taken by charge.lua its nonce, request
--                   fingerprint (hex packed), deadline and operation.
--   index buckets   hashes '<base>:e:<n>' (base: KEYS[8] without ':meta'): the
--                   first 6 bytes of the SHA-1 of the request id (or, when they
--                   collide with a live event's, '::::::' .. id) -> what
--                   changes, packed: at_ms (6 bytes), state ('r' a plain
--                   reserve; 'h' a charge held by its submission: no job has
--                   claimed it yet; 'j' owned by its job), then
--                   '<seq> <cost>[ <estimate>]' (the estimate once settle.lua
--                   settled a charge). Linear hashing keeps every bucket under
--                   Redis' 128-entry listpack limit: a bucket splits when the
--                   log holds more than LOAD events per bucket. Field '~': the
--                   time (ms) the bucket's expiry was last set to.
--   KEYS[8] meta    hash: 't' '<total>' the running sum of the costs of every
--                   event in the log, followed by ' <window_ms> <total>
--                   <cursor_ms>' per window of the user's plan shorter than the
--                   retention, its running total (events at or before the
--                   cursor were subtracted); 'l', 's': the bucket count's power
--                   of two and split pointer (absent: 1 and 0); 'x': the time
--                   (ms) the log's and meta's expiry was last set to.
--   KEYS[3] plan    string: the user's plan name (absent: the default plan)
--   '<base>:limits' string: limits an admin set for this user, in the plan
--                   table's 'limit:window_ms,...' form; they replace its
--                   plan's (the plan is then named 'custom:<plan>'), read in
--                   the same step; absent: the plan's.
--   KEYS[5] holds   sorted set: request id -> end of the hold (ms) of each 'h'
--                   charge: its job's deadline plus a grace. A charge still held
--                   then has no job that can run (a job past its deadline never
--                   starts), so the next budget step releases it.
--   KEYS[9] cancelled sorted set: nonce -> end of the hold of a held charge an
--                   operator refunded (refund.lua): its job is cancelled, and
--                   its claim refused until then (claim.lua).
--   KEYS[6] audit   stream: with [export] configured, every spend, refund and
--                   settle, in order (XADD MAXLEN ~): fields kind (spend | refund
--                   | settle), id, cost (settle: the new cost), prev (settle: the
--                   old one), at (when the event was spent, ms), op (spend of a
--                   job's charge). It outlives the window; billing jobs read it.
--   KEYS[1] events, KEYS[2] costs, KEYS[4] owners: the previous layout (a sorted
--                   set id -> at, a hash id -> cost plus ':total', a hash id ->
--                   '<state> <nonce> <deadline> <op> <fp>[ <estimate>]'). A
--                   user found with them is moved to this layout first,
--                   MIGRATE_BATCH events per call (oldest first): a call that
--                   leaves some answers the error TOLLGATE_MIGRATING, and the
--                   caller calls again.
-- The ARGV tail is the export's maxlen (0: no export), the retention (ms: the
-- longest window of any configured plan), then the plan table as pairs (name,
-- limits), the default plan first; limits is 'limit:window_ms,...', longest
-- window first, then, with alerts, '|' and per threshold '<basis points>:<tokens
-- in limit 1>:<tokens in limit 2>...', comma separated (see `alert_marks`). The log keeps every event for the retention, whatever the
-- user's plan, so a plan change never erases spend; a reservation must fit
-- every window of the user's plan.
-- Time is Redis TIME: pod clocks never decide a budget.

-- The library is loaded once per Redis as a function library (FUNCTION LOAD):
-- its top level runs at load, not per call, and every value below that a call
-- sets is set again by `begin` at the start of each call (no call sees
-- another's state).
local KEYS, ARGV
local EVENTS, COSTS, PLAN, OWNERS, HOLDS, AUDIT, LOG, META, CANCELLED, BASE
-- Log entries read per command in a walk: the time bound below is checked
-- between two batches.
local BATCH = 25
-- Events of the previous layout moved per call (each a handful of writes).
local MIGRATE_BATCH = 250
-- How many log entries one call may read while it brings the windows to now
-- or walks toward a retry_after (each entry a bucket read): a bound on how
-- long any budget script holds Redis (under 1 ms on a quiet core), whatever
-- the log holds. Work left over is kept (each step leaves the totals
-- consistent) and the script answers TOLLGATE_AGAIN: the caller calls again
-- (see `expire`); a retry_after walk answers where it stopped (`retry_walk`).
local SLICE = 100
-- Log entries this call may still read (SLICE at the start of each call).
local WORK = 0
-- And a bound in time, for a machine where an entry costs more than here:
-- once a call has run SLICE_US microseconds (Redis TIME, from its first
-- `now_ms`), it reads no further batch (`spend`). A call always reads one
-- batch, so every call makes progress.
local SLICE_US = 1000
-- This call's start in microseconds (Redis TIME), set by its first `now_ms`.
local T0 = nil
-- Events per bucket before one splits: a bucket not yet split this round holds
-- up to twice that, which must stay under Redis' hash-max-listpack-entries (128).
local LOAD = 40
-- The field prefix of an event whose digest is taken by another live event.
local LONG = '::::::'
-- The running totals of the plan's windows shorter than the retention
-- ({ window, total, cursor }, in the order of limits[FIRST..]), read by expire;
-- written back with the total. FIRST is 2 when limits[1] spans the retention
-- (its total is the log's), else 1.
local SHORTS, SHORTS_STALE, FIRST = {}, false, 2
-- The sum of the costs of every event in the log (the retention's total).
local TOTAL = 0
-- The export stream's approximate maxlen; 0: no export.
local EXPORT = 0
-- The bucket table (linear hashing: SIZE buckets of this round, SPLIT of them
-- split already) and the retention (the log's span, the keys' time to live).
local SIZE, SPLIT, RETAIN = 1, 0, 0
-- Until when (ms) the log and meta are kept (meta's 'x'; 0: unknown). A write
-- past a retention before it sets their expiry a retention and a slack on, so
-- that most writes leave the keys' expiry alone.
local KEPT = 0
-- Parsed plan limits by their text, across the calls of one library load.
local PARSED, PARSED_N = {}, 0
-- Alerts (see `crossed`): the limits of the subject's plan (their `marks`:
-- thresholds), the outbox pointers the caller must add (this call queued an
-- alert or found one whose pointer may be lost; then the reply is wrapped,
-- see `finish`), and meta's 'a': when an alert was queued that no deliverer
-- has looked at since. LIMITS and PENDING are the subject's (see `use`).
local LIMITS, POINTS, PENDING = nil, nil, nil
-- An outbox no deliverer looked at this long after an alert was queued has
-- its pointer added again by the next call's caller (its first caller may
-- have died before adding it).
local REPOINT_MS = 10000
-- A subject's outbox: at most this many alerts (OUTBOX_MAX in
-- tollgate_core::alerts), kept this long (ms) past its last write (more than
-- the longest `[alerts] keep`).
local OUTBOX_MAX = 1000
local OUTBOX_TTL = 8 * 86400 * 1000

-- Organisations. A member's budget keys (KEYS[1..9]) live under its
-- organisation's hash tag, next to the organisation's own budget (KEYS[10..18]):
-- the same structure over the organisation's plan, whose events are keyed by
-- '<request>/<user>' (ids never hold '/'). `use` switches every per-call
-- state above between the two subjects ('user', 'org'), so that `expire`,
-- `fits`, `record`, `remove` and `recost` apply to either; a member's script
-- applies them to both. A member is a call with more than 9 KEYS.
-- The subject in use, and the other one's saved state.
local SUBJECT, SAVED = 'user', nil
-- Requests whose held charge `expire` released this call (the organisation
-- releases its copies of them: `org_open`).
local RELEASED = nil
-- Events moved in from another location with their past time (`insert`) when
-- the log already held later ones: appended to the log at the move's time and
-- kept in the sorted set MOVED (request -> real time, ms), walked by `expire`
-- so that each still leaves each window at its real time. MV: the moved
-- walk's cursor per shorter window (nil: the set is empty). MOVED is
-- '<base>:mv'.
local MV = nil
-- Where the user lives. At a member's location the marker '<base>:at' says
-- 'here' while the user lives there, 'moving <to>' while a move freezes it.
-- At a user's own tag, meta's field 'w' (read with the totals: no extra
-- command for a user in no organisation): absent while the user lives there,
-- 'moving <to>' while a move freezes it, 'o:<org>' once it lives in that
-- organisation (meta then never expires); '<base>:at' there is the pointer
-- callers read (the same values). A script at a location the user left
-- answers TOLLGATE_MOVED, at a frozen one TOLLGATE_MOVING.
-- Set by the move scripts: they read and write a frozen location.
local NOCHECK = false

local function set_keys(keys, o)
  EVENTS, COSTS, PLAN, OWNERS, HOLDS, AUDIT, LOG, META, CANCELLED =
    keys[o + 1], keys[o + 2], keys[o + 3], keys[o + 4], keys[o + 5], keys[o + 6], keys[o + 7],
    keys[o + 8], keys[o + 9]
  BASE = string.sub(META, 1, -6)
end

-- The location's marker and moved set (built when needed: most calls need
-- neither).
local function at_key()
  return BASE .. ':at'
end

local function moved_key()
  return BASE .. ':mv'
end

-- Starts one call: its keys and arguments, and the state above reset.
local function begin(keys, args)
  KEYS, ARGV = keys, args
  set_keys(keys, 0)
  SHORTS, SHORTS_STALE, FIRST, TOTAL, EXPORT, SIZE, SPLIT, RETAIN = {}, false, 2, 0, 0, 1, 0, 0
  KEPT, WORK, T0 = 0, SLICE, nil
  LIMITS, POINTS, PENDING = nil, nil, nil
  -- SAVED and RELEASED are made when first needed: most calls need neither.
  SUBJECT, SAVED, RELEASED, MV, NOCHECK = 'user', nil, nil, nil, false
end

-- Switches the per-call state to `subject` ('user' or 'org': a member's
-- organisation, KEYS[10..18]), saving the other's. The organisation keeps no
-- export (EXPORT 0): the export is per user.
local function use(subject)
  if subject == SUBJECT then
    return
  end
  SAVED = SAVED or {}
  SAVED[SUBJECT] = { EVENTS, COSTS, PLAN, OWNERS, HOLDS, AUDIT, LOG, META, CANCELLED, BASE,
    SHORTS, SHORTS_STALE, FIRST, TOTAL, EXPORT, SIZE, SPLIT, KEPT, MV, LIMITS, PENDING }
  local s = SAVED[subject]
  if s then
    EVENTS, COSTS, PLAN, OWNERS, HOLDS, AUDIT, LOG, META, CANCELLED, BASE, SHORTS,
      SHORTS_STALE, FIRST, TOTAL, EXPORT, SIZE, SPLIT, KEPT, MV, LIMITS, PENDING = unpack(s, 1, 21)
  else
    set_keys(KEYS, subject == 'org' and 9 or 0)
    SHORTS, SHORTS_STALE, FIRST, TOTAL, SIZE, SPLIT, KEPT, MV = {}, false, 2, 0, 1, 0, 0, nil
    EXPORT, LIMITS, PENDING = 0, nil, nil
  end
  SUBJECT = subject
end

-- Whether this call is a member's (its organisation's keys follow its own).
local function is_member()
  return #KEYS > 9
end

local function int(n)
  return string.format('%d', n)
end

-- Microseconds since the epoch, Redis TIME.
local function now_us()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end

local function now_ms()
  local us = now_us()
  T0 = T0 or us
  return math.floor(us / 1000)
end

-- Counts `k` log entries read against WORK; once the call has run SLICE_US,
-- WORK is spent whatever is left of it.
local function spend(k)
  WORK = WORK - k
  if k > 0 and WORK > 0 then
    local us = now_us()
    T0 = T0 or us
    if us - T0 >= SLICE_US then
      WORK = 0
    end
  end
end

-- Hex text <-> bytes, 8 hex digits (4 bytes) at a time where they can be.
local function unhex(h)
  local out, i = {}, 1
  while i + 7 <= #h do
    out[#out + 1] = struct.pack('>I4', tonumber(string.sub(h, i, i + 7), 16))
    i = i + 8
  end
  for j = i, #h - 1, 2 do
    out[#out + 1] = string.char(tonumber(string.sub(h, j, j + 1), 16))
  end
  return table.concat(out)
end

local function tohex(s)
  local out, i = {}, 1
  while i + 3 <= #s do
    out[#out + 1] = string.format('%08x', (struct.unpack('>I4', string.sub(s, i, i + 3))))
    i = i + 4
  end
  for j = i, #s do
    out[#out + 1] = string.format('%02x', string.byte(s, j))
  end
  return table.concat(out)
end

-- Reads a plan's alert thresholds ('<bp>:<tokens>:<tokens>,...': per
-- threshold its basis points, then the token count that reaches it in each
-- limit, in the limits' order) into each limit's `marks` ({ bp, at }).
local function alert_marks(limits, text)
  for group in string.gmatch(text, '[^,]+') do
    local bp, k = nil, 0
    for n in string.gmatch(group, '%d+') do
      if not bp then
        bp = tonumber(n)
      else
        k = k + 1
        local l = limits[k]
        if l then
          l.marks = l.marks or {}
          l.marks[#l.marks + 1] = { bp = bp, at = tonumber(n) }
          limits.alerting = true
        end
      end
    end
  end
end

-- Answers TOLLGATE_MOVING when the user's location is frozen by a move, and
-- TOLLGATE_MOVED when the user does not live here (see AT): the caller reads
-- the user's pointer again and calls the location it names.
local function check_at(at)
  if at and string.sub(at, 1, 6) == 'moving' then
    error({ err = 'TOLLGATE_MOVING the user is moving between organisations: call again shortly' })
  end
  if is_member() then
    if at ~= 'here' then
      error({ err = 'TOLLGATE_MOVED the user is not a member of this organisation' })
    end
  elseif at then
    error({ err = 'TOLLGATE_MOVED ' .. at })
  end
end

-- At a user's own tag: meta's 'w' (see AT).
local function check_home(w)
  if w and SUBJECT == 'user' and not NOCHECK and not is_member() then
    check_at(w)
  end
end

-- Returns the name and limits ({ limit, window } each, longest window first) of
-- the user's plan, reading the export's maxlen from ARGV[i], the table after it.
local function resolve_plan(i)
  EXPORT = tonumber(ARGV[i]) or 0
  RETAIN = tonumber(ARGV[i + 1]) or 0
  i = i + 2
  local got
  if SUBJECT == 'user' and not NOCHECK and is_member() then
    got = redis.call('MGET', PLAN, BASE .. ':limits', at_key())
    check_at(got[3])
  else
    got = redis.call('MGET', PLAN, BASE .. ':limits')
  end
  local stored, custom = got[1], got[2]
  -- No stored plan, or one the config no longer has: the default.
  local name, spec = ARGV[i], ARGV[i + 1]
  if stored then
    for j = i, #ARGV - 1, 2 do
      if ARGV[j] == stored then
        name, spec = ARGV[j], ARGV[j + 1]
        break
      end
    end
  end
  -- The user's own limits (no plan name has a ':').
  if custom then
    name, spec = 'custom:' .. name, custom
  end
  spec = spec or ''
  local limits = PARSED[spec]
  if not limits then
    limits = {}
    local bar = string.find(spec, '|', 1, true)
    for l, w in string.gmatch(bar and string.sub(spec, 1, bar - 1) or spec, '(%d+):(%d+)') do
      limits[#limits + 1] = { limit = tonumber(l), window = tonumber(w) }
    end
    if bar then
      alert_marks(limits, string.sub(spec, bar + 1))
    end
    if PARSED_N >= 64 then
      PARSED, PARSED_N = {}, 0
    end
    PARSED[spec], PARSED_N = limits, PARSED_N + 1
  end
  local longest = limits[1] and limits[1].window or 0
  if RETAIN < longest then
    RETAIN = longest
  end
  FIRST = longest >= RETAIN and 2 or 1
  LIMITS = limits
  return name, limits
end

-- The largest cost the plan could ever admit: its smallest limit.
local function max_cost(limits)
  local m = nil
  for _, l in ipairs(limits) do
    if not m or l.limit < m then
      m = l.limit
    end
  end
  return m or 0
end

-- Whether `cost` is no cost at all or one `limits` could never admit (past
-- their smallest limit). Answered only where the user lives: at a place it
-- left (a pod's stale idea of where it lives) the caller gets TOLLGATE_MOVED
-- first, not the refusal of a plan or limits the user no longer has there.
-- (A member's place was checked by `resolve_plan`; at the user's own tag the
-- marker is read here, on this refusal's path only.)
local function too_costly(limits, cost)
  if cost and cost >= 1 and cost <= max_cost(limits) then
    return false
  end
  if SUBJECT == 'user' and not NOCHECK and not is_member() then
    check_home(redis.call('HGET', META, 'w'))
  end
  return true
end

-- The packed request id: 'u' + 16 bytes (a lowercase UUID), 'i' + 16 bytes
-- ('idem-' + 32 lowercase hex), else 'x' + its length + the id.
-- A lowercase UUID; 'idem-' and 32 lowercase hex digits. (Literal: a function
-- library's top level has no string library.)
local UUID = '^[0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f]%-[0-9a-f][0-9a-f][0-9a-f][0-9a-f]%-[0-9a-f][0-9a-f][0-9a-f][0-9a-f]%-[0-9a-f][0-9a-f][0-9a-f][0-9a-f]%-'
  .. '[0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f]$'
local IDEM = '^idem%-[0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f]'
  .. '[0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f]$'

local function hex(s, i, j)
  return tonumber(string.sub(s, i, j), 16)
end

local function pack_id(id)
  if #id == 36 and string.find(id, UUID) then
    return 'u' .. struct.pack('>I4I2I2I2I2I4', hex(id, 1, 8), hex(id, 10, 13), hex(id, 15, 18),
      hex(id, 20, 23), hex(id, 25, 28), hex(id, 29, 36))
  end
  if #id == 37 and string.find(id, IDEM) then
    return 'i' .. struct.pack('>I4I4I4I4', hex(id, 6, 13), hex(id, 14, 21), hex(id, 22, 29), hex(id, 30, 37))
  end
  return 'x' .. string.char(#id) .. id
end

-- The request id at the start of a packed record, and the position after it.
local function unpack_id(r)
  local tag = string.sub(r, 1, 1)
  if tag == 'u' then
    return string.format('%08x-%04x-%04x-%04x-%04x%08x', struct.unpack('>I4I2I2I2I2I4', r, 2)), 18
  elseif tag == 'i' then
    return string.format('idem-%08x%08x%08x%08x', struct.unpack('>I4I4I4I4', r, 2)), 18
  end
  local n = string.byte(r, 2)
  return string.sub(r, 3, 2 + n), 3 + n
end

-- A nonce or fingerprint, packed: its length byte (+128: lowercase hex, packed).
local function pack_token(s)
  if #s % 2 == 0 and #s <= 254 and not string.find(s, '[^0-9a-f]') then
    return string.char(128 + #s / 2) .. unhex(s)
  end
  return string.char(#s) .. s
end

local function unpack_token(r, i)
  local n = string.byte(r, i)
  if n >= 128 then
    return tohex(string.sub(r, i + 1, i + n - 128)), i + 1 + n - 128
  end
  return string.sub(r, i + 1, i + n), i + 1 + n
end

-- The record of the log: id, and for a charge nonce, fp, deadline, op. An
-- organisation's: the request id packed, then the user ('<request>/<user>').
local function pack_record(id, o)
  if SUBJECT == 'org' then
    local request, user = string.match(id, '^([^/]+)/(.+)$')
    return pack_id(request) .. user
  end
  local r = pack_id(id)
  if o then
    r = r .. pack_token(o.nonce) .. pack_token(o.fp) .. struct.pack('>I6', o.deadline) .. o.op
  end
  return r
end

local function unpack_record(r)
  local id, i = unpack_id(r)
  if SUBJECT == 'org' then
    local user = string.sub(r, i)
    return { id = id .. '/' .. user, request = id, user = user }
  end
  local rec = { id = id }
  if i <= #r then
    rec.nonce, i = unpack_token(r, i)
    rec.fp, i = unpack_token(r, i)
    rec.deadline = struct.unpack('>I6', string.sub(r, i, i + 5))
    rec.op = string.sub(r, i + 6)
  end
  return rec
end

-- An index value: { at, seq, state, cost, estimate, real }: `at` and `seq`
-- name its log entry; `real`, only for an event moved in with its past time
-- behind later ones (see MOVED), the time it was spent.
local function pack_value(ev)
  local v = struct.pack('>I6', ev.at) .. ev.state .. int(ev.seq) .. ' ' .. int(ev.cost)
  if ev.estimate then
    v = v .. ' ' .. int(ev.estimate)
  end
  if ev.real then
    v = v .. ' @' .. int(ev.real)
  end
  return v
end

local function unpack_value(v)
  local seq, cost, est, real = string.match(string.sub(v, 8), '^(%d+) (%d+) ?(%d*) ?@?(%d*)$')
  return { at = struct.unpack('>I6', string.sub(v, 1, 6)), state = string.sub(v, 7, 7),
    seq = tonumber(seq), cost = tonumber(cost), estimate = tonumber(est), real = tonumber(real) }
end

-- When an event was spent (its log entry's time, or a moved one's real time).
local function spent(ev)
  return ev.real or ev.at
end

-- The digest field of a request id and the 32-bit hash that picks its bucket.
local function digest(id)
  local h = redis.sha1hex(id)
  local top = hex(h, 1, 8)
  return struct.pack('>I4I2', top, hex(h, 9, 12)), top
end

local function bucket_key(h)
  local b = h % SIZE
  if b < SPLIT then
    b = h % (2 * SIZE)
  end
  return BASE .. ':e:' .. int(b)
end

-- The hash of a bucket's field (a digest, or LONG .. id).
local function field_hash(f)
  if #f == 6 then
    return (struct.unpack('>I4', f))
  end
  local _, h = digest(string.sub(f, #LONG + 1))
  return h
end

local function entry_id(ev)
  return int(ev.at) .. '-' .. int(ev.seq)
end

-- The record of a log entry ID.
local function read_record(sid)
  local e = redis.call('XRANGE', LOG, sid, sid)
  if #e == 0 then
    return nil
  end
  return unpack_record(e[1][2][2])
end

-- The live event of a request id: its index value plus key, field and record;
-- or nil, and where `record` puts it: { key = its bucket, field = the digest
-- (or LONG .. id when another entry holds the digest), kept = the bucket's
-- '~' }.
local function find(request)
  local dig, h = digest(request)
  local key = bucket_key(h)
  local long = LONG .. request
  local vals = redis.call('HMGET', key, dig, long, '~')
  for k, field in ipairs({ dig, long }) do
    if vals[k] then
      local ev = unpack_value(vals[k])
      ev.key, ev.field = key, field
      ev.rec = read_record(entry_id(ev))
      if ev.rec and ev.rec.id == request then
        return ev
      end
    end
  end
  return nil, { key = key, field = vals[1] and long or dig, kept = tonumber(vals[3]) or 0 }
end

-- The live event of a log entry (ID, packed record).
local function at_entry(sid, packed)
  local rec = unpack_record(packed)
  local dig, h = digest(rec.id)
  local key = bucket_key(h)
  local vals = redis.call('HMGET', key, dig, LONG .. rec.id)
  for k, field in ipairs({ dig, LONG .. rec.id }) do
    if vals[k] then
      local ev = unpack_value(vals[k])
      if entry_id(ev) == sid then
        ev.key, ev.field, ev.rec = key, field, rec
        return ev
      end
    end
  end
  return nil
end

-- Writes back an event's index value (state, cost or estimate changed).
local function update(ev)
  redis.call('HSET', ev.key, ev.field, pack_value(ev))
end

-- The slack added to a key's expiry when a write sets it: a key's expiry is
-- set again only when a write finds it less than the time to live the key
-- needs away, so once per slack at most.
local function slack()
  return math.floor(RETAIN / 8)
end

-- A bucket lives two windows from its last write, the log and meta one. An
-- entry of the log leaves at the first budget step past its window; if none came
-- within a window after that, no step wrote the log either, so the log and meta
-- are gone by then too. A bucket written once early in a window therefore still
-- holds its events' costs when they leave, though only other buckets were
-- written since; a bucket outliving its log holds entries no log entry
-- points to, which `find` and `at_entry` ignore.
-- A bucket's '~' field is the time (ms) its expiry was set to (written first
-- in a new bucket, where reading it costs least).
local function keep_bucket(key, now)
  local at = int(now + 2 * RETAIN + slack())
  redis.call('HSET', key, '~', at)
  redis.call('PEXPIREAT', key, at)
end

-- Splits the next bucket when the log holds more than LOAD events per bucket.
-- Returns the number of entries of the log.
local function grow(now)
  local n = redis.call('XLEN', LOG)
  if n <= LOAD * (SIZE + SPLIT) then
    return n
  end
  local from = BASE .. ':e:' .. int(SPLIT)
  local to = BASE .. ':e:' .. int(SPLIT + SIZE)
  local all = redis.call('HGETALL', from)
  local moved, gone = {}, {}
  for i = 1, #all, 2 do
    if all[i] ~= '~' and field_hash(all[i]) % (2 * SIZE) ~= SPLIT then
      moved[#moved + 1] = all[i]
      moved[#moved + 1] = all[i + 1]
      gone[#gone + 1] = all[i]
    end
  end
  if #gone > 0 then
    keep_bucket(to, now)
    redis.call('HSET', to, unpack(moved))
    redis.call('HDEL', from, unpack(gone))
  end
  SPLIT = SPLIT + 1
  if SPLIT == SIZE then
    SIZE, SPLIT = 2 * SIZE, 0
  end
  redis.call('HSET', META, 'l', int(SIZE), 's', int(SPLIT))
  return n
end

-- The sum of the costs of live events in start..hi (XRANGE bounds), reading
-- at most WORK entries. Returns the sum, and the ID of the last entry read when
-- WORK ran out first (nil: the sum reached hi).
local function sum_slice(start, hi)
  local sum = 0
  while true do
    local n = math.min(BATCH, WORK)
    if n <= 0 then
      return sum, nil, true
    end
    local batch = redis.call('XRANGE', LOG, start, hi, 'COUNT', n)
    spend(#batch)
    for _, e in ipairs(batch) do
      local ev = at_entry(e[1], e[2][2])
      if ev and not ev.real then
        sum = sum + ev.cost
      end
    end
    if #batch < n then
      return sum, nil, false
    end
    start = '(' .. batch[#batch][1]
    if WORK <= 0 then
      return sum, batch[#batch][1], true
    end
  end
end

-- The sum of the costs of the moved events (MOVED) spent in (lo, hi], reading
-- at most WORK of them. Returns the sum, the cursor reached (hi, or short of it
-- when WORK ran out: whole milliseconds only) and whether WORK ran out.
local function moved_slice(lo, hi)
  local n = math.max(math.min(BATCH, WORK), 1)
  local rows = redis.call('ZRANGE', moved_key(), '(' .. int(lo), int(hi), 'BYSCORE', 'LIMIT', 0, n + 1,
    'WITHSCORES')
  local count = #rows / 2
  spend(count)
  local stop, out = nil, false
  if count > n then
    -- Stop before the last millisecond read, unless it is the only one: then
    -- read all of that millisecond.
    local last = tonumber(rows[2 * count])
    if tonumber(rows[2]) == last then
      rows = redis.call('ZRANGE', moved_key(), int(last), int(last), 'BYSCORE', 'WITHSCORES')
      stop = last
    else
      stop = last - 1
    end
    out = true
  end
  local sum = 0
  for i = 1, #rows, 2 do
    local at = tonumber(rows[i + 1])
    if not stop or at <= stop then
      local ev = find(rows[i])
      if ev and ev.real then
        sum = sum + ev.cost
      end
    end
  end
  return sum, stop or hi, out
end

-- Reads the totals of the windows shorter than the retention. A plan whose
-- windows changed (a plan change, or a log written before there were any) has
-- them rebuilt: each starts as the log's total with nothing subtracted yet
-- (cursor 0), and `expire` subtracts what is older than its window, a slice
-- per call. A one-limit plan spanning the retention has none: its next write
-- drops any left.
local function load_shorts(raw, limits)
  SHORTS, SHORTS_STALE = {}, false
  local ok = true
  if raw then
    for w, t, c in string.gmatch(raw, '(%d+) (%-?%d+) (%-?%d+)') do
      SHORTS[#SHORTS + 1] = { window = tonumber(w), total = tonumber(t), cursor = tonumber(c) }
    end
  end
  if #SHORTS ~= #limits - FIRST + 1 then
    ok = false
  else
    for k = FIRST, #limits do
      if SHORTS[k - FIRST + 1].window ~= limits[k].window then
        ok = false
      end
    end
  end
  if ok then
    return
  end
  SHORTS, SHORTS_STALE = {}, true
  for k = FIRST, #limits do
    SHORTS[k - FIRST + 1] = { window = limits[k].window, total = TOTAL, cursor = 0 }
  end
end

-- The running totals: the log's, and the text of the windows'. Reads the
-- bucket table too. Totals that went missing (eviction, the end of a
-- migration) are rebuilt from the log a slice per call, the sum so far kept
-- in meta's 'r' ('<sum> <ID of the last entry summed>'); a call that leaves
-- some answers TOLLGATE_AGAIN.
local function read_total()
  local m = redis.call('HMGET', META, 't', 'l', 's', 'x', 'r', 'v', 'w', 'a')
  check_home(m[7])
  SIZE, SPLIT = tonumber(m[2]) or 1, tonumber(m[3]) or 0
  KEPT = tonumber(m[4]) or 0
  PENDING = tonumber(m[8])
  MV = nil
  if m[6] then
    MV = {}
    for c in string.gmatch(m[6], '%-?%d+') do
      MV[#MV + 1] = tonumber(c)
    end
  end
  local raw = m[1]
  if raw then
    local used = tonumber(raw)
    if used then
      return used, nil, false
    end
    local first, rest = string.match(raw, '^(%-?%d+) (.*)$')
    if first then
      return tonumber(first), rest, false
    end
  end
  local sum, start = 0, '-'
  local partial, after = string.match(m[5] or '', '^(%d+) (%d+%-%d+)$')
  if partial then
    sum, start = tonumber(partial), '(' .. after
  end
  local more, stop = sum_slice(start, '+')
  sum = sum + more
  if stop then
    redis.call('HSET', META, 'r', int(sum) .. ' ' .. stop)
    error({ err = 'TOLLGATE_AGAIN rebuilding the totals from the log: call again' })
  end
  if partial then
    redis.call('HDEL', META, 'r')
  end
  return sum, nil, sum > 0
end

-- Writes the totals (TOTAL, and the windows'); returns the longest window's.
-- Keeps the log and meta a retention past `now` (see KEPT).
local function write_total(now)
  if TOTAL < 0 then
    TOTAL = 0
  end
  local value = int(TOTAL)
  if #SHORTS > 0 then
    local parts = { value }
    for _, s in ipairs(SHORTS) do
      if s.total < 0 then
        s.total = 0
      end
      parts[#parts + 1] = int(s.window) .. ' ' .. int(s.total) .. ' ' .. int(s.cursor)
    end
    value = table.concat(parts, ' ')
  end
  SHORTS_STALE = false
  if MV then
    local parts = { 'm' }
    for k = 1, #SHORTS do
      parts[#parts + 1] = int(MV[k] or 0)
    end
    redis.call('HSET', META, 'v', table.concat(parts, ' '))
  end
  if KEPT < now + RETAIN then
    KEPT = now + RETAIN + slack()
    redis.call('HSET', META, 't', value, 'x', int(KEPT))
    redis.call('PEXPIREAT', LOG, int(KEPT))
    redis.call('PEXPIREAT', META, int(KEPT))
    if MV then
      redis.call('PEXPIREAT', moved_key(), int(KEPT))
    end
  else
    redis.call('HSET', META, 't', value)
  end
  if FIRST == 1 then
    return SHORTS[1].total
  end
  return TOTAL
end

-- Appends one change to the export stream (when there is one).
local function export(kind, request, cost, at, prev, op)
  if EXPORT > 0 then
    redis.call('XADD', AUDIT, 'MAXLEN', '~', int(EXPORT), '*', 'kind', kind, 'id', request,
      'cost', int(cost), 'prev', int(prev or 0), 'at', int(at or 0), 'op', op or '')
  end
end

-- Takes `cost` off every shorter window the event at `at` is still inside.
local function unshort(at, cost, now)
  for _, s in ipairs(SHORTS) do
    if at and at > now - s.window then
      s.total = s.total - cost
    end
  end
end

-- Drops one event from the log and its index (not from the totals).
local function drop(ev)
  redis.call('HDEL', ev.key, ev.field)
  redis.call('XDEL', LOG, entry_id(ev))
  if ev.real then
    redis.call('ZREM', moved_key(), ev.rec.id)
  end
end

-- Moves up to MIGRATE_BATCH events of the previous layout (oldest first) into
-- this one; when none is left, drops the previous keys and the totals, which
-- the next read rebuilds from the log (with the shorter windows' totals).
-- Returns true when events of the previous layout are left.
local function migrate(now)
  if redis.call('EXISTS', EVENTS, COSTS, OWNERS) == 0 then
    return false
  end
  local m = redis.call('HMGET', META, 'l', 's')
  SIZE, SPLIT = tonumber(m[1]) or 1, tonumber(m[2]) or 0
  local batch = redis.call('ZRANGE', EVENTS, 0, MIGRATE_BATCH - 1, 'WITHSCORES')
  local ids = {}
  for i = 1, #batch, 2 do
    ids[#ids + 1] = batch[i]
  end
  if #ids > 0 then
    local costs = redis.call('HMGET', COSTS, unpack(ids))
    local owners = redis.call('HMGET', OWNERS, unpack(ids))
    for k, id in ipairs(ids) do
      local cost = tonumber(costs[k])
      if cost then
        local o, state, est = nil, 'r', nil
        if owners[k] then
          local st, nonce, deadline, op, fp, e = string.match(owners[k], '^(%S+) (%S+) (%S+) (%S+) (%S+) ?(%d*)$')
          if st then
            o = { nonce = nonce, deadline = tonumber(deadline), op = op, fp = fp }
            state, est = st, tonumber(e)
          end
        end
        local at = tonumber(batch[2 * k])
        local sid = redis.pcall('XADD', LOG, int(at) .. '-*', 'r', pack_record(id, o))
        if type(sid) ~= 'string' then
          sid = redis.call('XADD', LOG, '*', 'r', pack_record(id, o))
        end
        local ms, seq = string.match(sid, '^(%d+)-(%d+)$')
        local ev = { at = tonumber(ms), seq = tonumber(seq), state = state, cost = cost, estimate = est }
        local dig, h = digest(id)
        local key = bucket_key(h)
        if redis.call('HSETNX', key, dig, pack_value(ev)) == 0 then
          redis.call('HSET', key, LONG .. id, pack_value(ev))
        end
        keep_bucket(key, now)
        grow(now)
      end
    end
    redis.call('ZREM', EVENTS, unpack(ids))
    redis.call('HDEL', COSTS, unpack(ids))
    redis.call('HDEL', OWNERS, unpack(ids))
    redis.call('PEXPIRE', LOG, int(RETAIN))
    KEPT = 0
  end
  if redis.call('ZCARD', EVENTS) > 0 then
    return true
  end
  redis.call('DEL', EVENTS, COSTS, OWNERS)
  redis.call('HDEL', META, 't')
  return false
end

-- The subject of this call's budget, from its keys' hash tag (BASE ends
-- '{u:<user>}'): its kind, its name, and its outbox pointer (BASE after the
-- prefix and schema: the deliverer builds the outbox keys from it).
-- A member's budget is '{o:<org>}:u:<user>', its organisation's '{o:<org>}:org'.
local function subject()
  local pointer = string.match(BASE, '({.*)$') or BASE
  local user = string.match(pointer, '^{u:([^{}]+)}$') or string.match(pointer, '^{o:[^{}]+}:u:([^:{}]+)$')
  if user then
    return 'user', user, pointer
  end
  local org = string.match(pointer, '^{o:([^{}]+)}:org$')
  if org then
    return 'org', org, pointer
  end
  return '?', '', pointer
end

-- Notes that the caller must add this subject's outbox pointer to the due
-- set (`finish`): a member's call may have to add its own and its
-- organisation's.
local function point()
  local _, _, pointer = subject()
  POINTS = POINTS or {}
  for _, p in ipairs(POINTS) do
    if p == pointer then
      return
    end
  end
  POINTS[#POINTS + 1] = pointer
end

-- An alert was queued and no deliverer has looked at the outbox for
-- REPOINT_MS: its caller may have died before adding the outbox's pointer to
-- the due set, so this call's caller adds it (again; adding is idempotent).
local function repoint(now)
  if PENDING and now - PENDING >= REPOINT_MS then
    redis.call('HSET', META, 'a', int(now))
    point()
  end
end

-- Appends an alert to the subject's outbox (keys '<base>:alerts', a hash id ->
-- '<window_ms> <bp> <used> <limit> <at_ms> <kind> <name>' plus 'n:<id>' its
-- attempts, '#' the id counter, '!' alerts dropped when full; and
-- '<base>:alertq', a sorted set id -> when it is due: queued, retried, or its
-- lease's end). Its id is '<kind>:<name>:<at_ms>-<n>'. The caller adds the
-- outbox's pointer to the due set (the reply says so, see `finish`).
local function queue_alert(l, bp, used, now)
  local kind, name = subject()
  local box, due = BASE .. ':alerts', BASE .. ':alertq'
  if redis.call('ZCARD', due) >= OUTBOX_MAX then
    local old = redis.call('ZPOPMIN', due)
    redis.call('HDEL', box, old[1], 'n:' .. old[1])
    redis.call('HINCRBY', box, '!', 1)
  end
  local id = kind .. ':' .. name .. ':' .. int(now) .. '-' .. int(redis.call('HINCRBY', box, '#', 1))
  redis.call('HSET', box, id, int(l.window) .. ' ' .. int(bp) .. ' ' .. int(used) .. ' '
    .. int(l.limit) .. ' ' .. int(now) .. ' ' .. kind .. ' ' .. name)
  redis.call('ZADD', due, now, id)
  redis.call('PEXPIRE', box, OUTBOX_TTL)
  redis.call('PEXPIRE', due, OUTBOX_TTL)
  if not PENDING then
    PENDING = now
    redis.call('HSET', META, 'a', int(now))
  end
  point()
end

-- A script's reply, wrapped as { 'TOLLGATE_ALERT', <outbox pointer>...,
-- reply } when the caller must add outbox pointers to the due set (this call
-- queued an alert, or found one no deliverer looked at; see `repoint`): the
-- user's, its organisation's, or both. The ledger unwraps it. Errors pass as
-- they are.
local function finish(r)
  if not POINTS or (type(r) == 'table' and r.err) then
    return r
  end
  local out = { 'TOLLGATE_ALERT' }
  for _, p in ipairs(POINTS) do
    out[#out + 1] = p
  end
  out[#out + 1] = r
  return out
end

-- Saves the totals and answers TOLLGATE_AGAIN: this call read its SLICE of
-- the log before every window reached `now`. What it did is kept, and
-- consistent (each window's total matches its cursor), so the next call goes
-- on from there; the caller calls again.
local function again(now, what)
  write_total(now)
  error({ err = 'TOLLGATE_AGAIN ' .. what .. ': call again' })
end

-- Brings every window to `now`: subtracts what left each window shorter than
-- the retention since its cursor, drops events at or past the retention (time +
-- retention <= now), and releases charges still held past their hold (their
-- submission died before a job claimed them). Each event leaves each window
-- once, so the cost is amortised O(1) per call whatever the number of live
-- events; and no call reads more than SLICE entries of the log: one that would
-- (a whole log leaving at once after a quiet spell, a plan's new window being
-- rebuilt) keeps its progress and answers TOLLGATE_AGAIN (see `again`). The
-- windows are caught up in that order, so an event is dropped or released only
-- once every window's total has seen it leave. Sets TOTAL; returns the plan's
-- longest window's total. A user still in the previous layout is moved first.
local function expire(now, limits)
  if migrate(now) then
    error({ err = 'TOLLGATE_MIGRATING events of the previous layout are left: call again' })
  end
  local used, shorts, changed = read_total()
  TOTAL = used
  repoint(now)
  load_shorts(shorts, limits)
  changed = changed or SHORTS_STALE
  local behind = false
  for _, s in ipairs(SHORTS) do
    local edge = now - s.window
    if edge > s.cursor then
      local left, stop, out = sum_slice(int(s.cursor + 1), int(edge))
      local cursor = edge
      if stop then
        -- The rest of the last millisecond read (a cursor is a millisecond).
        cursor = tonumber(string.match(stop, '^(%d+)'))
        local rest = redis.call('XRANGE', LOG, '(' .. stop, int(cursor))
        spend(#rest)
        for _, e in ipairs(rest) do
          local ev = at_entry(e[1], e[2][2])
          if ev and not ev.real then
            left = left + ev.cost
          end
        end
      elseif out then
        cursor = s.cursor
      end
      behind = behind or out
      if left > 0 or cursor ~= s.cursor and out then
        s.total, s.cursor, changed = s.total - left, cursor, true
      end
    end
  end
  if MV then
    -- Windows rebuilt from the log start their moved walk over.
    if SHORTS_STALE or #MV ~= #SHORTS then
      for k = 1, #SHORTS do
        MV[k] = 0
      end
      changed = true
    end
    for k, s in ipairs(SHORTS) do
      local edge = now - s.window
      if edge > MV[k] then
        local left, cursor, out = moved_slice(MV[k], edge)
        behind = behind or out
        if left > 0 or cursor ~= MV[k] then
          s.total, MV[k], changed = s.total - left, cursor, true
        end
      end
    end
  end
  if behind then
    again(now, 'events are leaving a window')
  end
  while MV do
    local n = math.min(BATCH, WORK)
    local ids = redis.call('ZRANGE', moved_key(), '-inf', int(now - RETAIN), 'BYSCORE', 'LIMIT', 0, math.max(n, 1))
    if #ids == 0 then
      if redis.call('EXISTS', moved_key()) == 0 then
        MV = nil
        redis.call('HDEL', META, 'v')
      end
      break
    end
    if n <= 0 then
      again(now, 'moved events are leaving the retention')
    end
    spend(#ids)
    for _, id in ipairs(ids) do
      local ev = find(id)
      if ev and ev.real then
        TOTAL = TOTAL - ev.cost
        drop(ev)
      end
    end
    redis.call('ZREM', moved_key(), unpack(ids))
    changed = true
  end
  while true do
    local n = math.min(BATCH, WORK)
    local batch = redis.call('XRANGE', LOG, '-', int(now - RETAIN), 'COUNT', math.max(n, 1))
    if #batch == 0 then
      break
    end
    if n <= 0 then
      again(now, 'events are leaving the retention')
    end
    spend(#batch)
    local sids = {}
    for _, e in ipairs(batch) do
      local ev = at_entry(e[1], e[2][2])
      if ev then
        TOTAL = TOTAL - ev.cost
        redis.call('HDEL', ev.key, ev.field)
      end
      sids[#sids + 1] = e[1]
    end
    redis.call('XDEL', LOG, unpack(sids))
    changed = true
  end
  while true do
    local n = math.min(BATCH, WORK)
    local ids = redis.call('ZRANGE', HOLDS, '-inf', now, 'BYSCORE', 'LIMIT', 0, math.max(n, 1))
    if #ids == 0 then
      break
    end
    if n <= 0 then
      again(now, 'charges past their hold are being released')
    end
    spend(#ids)
    for _, id in ipairs(ids) do
      local ev = find(id)
      if ev then
        -- A released hold is a refund; an event leaving the window is not a change.
        TOTAL = TOTAL - ev.cost
        unshort(spent(ev), ev.cost, now)
        export('refund', id, ev.cost, spent(ev))
        drop(ev)
        RELEASED = RELEASED or {}
        RELEASED[#RELEASED + 1] = id
      end
    end
    redis.call('ZREM', HOLDS, unpack(ids))
    changed = true
  end
  if changed then
    write_total(now)
  end
  if FIRST == 1 then
    return SHORTS[1].total
  end
  return TOTAL
end

-- Tokens spent in limit k's window (after expire). `used`, kept for the
-- scripts' calls, is ignored: the totals are read from TOTAL and SHORTS.
local function window_used(k, _used)
  if k < FIRST then
    return TOTAL
  end
  return SHORTS[k - FIRST + 1].total
end

-- Every window's total, in the plan's order, when its plan has alert
-- thresholds (else nil): taken before a change, for `crossed`.
local function snapshot()
  if not (LIMITS and LIMITS.alerting) then
    return nil
  end
  local t = {}
  for k = 1, #LIMITS do
    t[k] = window_used(k)
  end
  return t
end

-- Queues an alert for each threshold a change crossed: a window's total went
-- from below the threshold's tokens (`before`, from `snapshot`) to at or
-- above them. Called by `record` and `recost`, where a total goes up, so
-- exactly one call sees each crossing; a total that fell back below (events
-- leaving, refunds) crosses anew when it rises again.
local function crossed(before, now)
  if not before then
    return
  end
  for k, l in ipairs(LIMITS) do
    if l.marks then
      local after = window_used(k)
      for _, m in ipairs(l.marks) do
        if before[k] < m.at and after >= m.at then
          queue_alert(l, m.bp, after, now)
        end
      end
    end
  end
end

-- Whether `cost` fits every limit (`used`: ignored, see window_used).
local function fits(limits, used, cost)
  for k, l in ipairs(limits) do
    if window_used(k, used) + cost > l.limit then
      return false
    end
  end
  return true
end

-- Walks the log from `start` (an XRANGE bound) adding the live events' costs
-- to `freed` until they reach `need`: the exact retry_after (ms after `now`)
-- is when that event leaves a window of `window` ms. Reads at most WORK
-- entries: where it runs out, answers 'more <bound> <freed> <need>', which the
-- caller passes to `retry.lua` to go on (a slice per call). Terminates within
-- the log because cost <= limit; answers a full window if the totals and the
-- log disagree.
local function retry_walk(window, need, freed, start, now)
  while true do
    local n = math.min(BATCH, WORK)
    if n <= 0 then
      return 'more ' .. start .. ' ' .. int(freed) .. ' ' .. int(need)
    end
    local batch = redis.call('XRANGE', LOG, start, '+', 'COUNT', n)
    spend(#batch)
    for _, e in ipairs(batch) do
      local ev = at_entry(e[1], e[2][2])
      -- A moved event (MOVED) is not in time order here: leaving it out
      -- only ever answers later, never too early.
      if ev and not ev.real then
        freed = freed + ev.cost
        if freed >= need then
          return ev.at + window - now
        end
      end
    end
    if #batch < n then
      return window
    end
    start = '(' .. batch[#batch][1]
  end
end

-- The exact retry_after of a cost in limit k's window: walk its oldest events
-- until their costs free enough room (0: it fits). See `retry_walk`.
local function retry_after(k, l, used, cost, now)
  local need = window_used(k, used) + cost - l.limit
  if need <= 0 then
    return 0
  end
  return retry_walk(l.window, need, 0, int(now - l.window + 1), now)
end

-- Appends to `out` the number of limits, then per limit: used, limit, window_ms,
-- reset_after_ms (until its oldest event leaves it; -1 when none is in it) and
-- retry_after_ms (with `cost`: until that cost fits it; else 0; or, when the
-- walk to it ran out of this call's slice, the text 'more <bound> <freed>
-- <need>': the caller goes on with `retry.lua`).
local function push_windows(out, limits, used, now, cost)
  out[#out + 1] = #limits
  for k, l in ipairs(limits) do
    local oldest = redis.call('XRANGE', LOG, k < FIRST and '-' or int(now - l.window + 1), '+', 'COUNT', 1)
    local reset = -1
    if #oldest > 0 then
      reset = tonumber(string.match(oldest[1][1], '^(%d+)')) + l.window - now
    end
    out[#out + 1] = window_used(k, used)
    out[#out + 1] = l.limit
    out[#out + 1] = l.window
    out[#out + 1] = reset
    out[#out + 1] = cost and retry_after(k, l, used, cost, now) or 0
  end
  return out
end

-- Removes one live event (from `find`); returns the longest window's total
-- after (`used`: ignored, see window_used).
local function remove(ev, _used, now)
  if #SHORTS > 0 or EXPORT > 0 then
    unshort(spent(ev), ev.cost, now)
    export('refund', ev.rec.id, ev.cost, spent(ev))
  end
  drop(ev)
  redis.call('ZREM', HOLDS, ev.rec.id)
  TOTAL = TOTAL - ev.cost
  return write_total(now)
end

-- Sets a live event's cost (from `find`; >= 1) in every window it is inside;
-- returns the longest window's total after.
local function recost(ev, cost, now)
  local before = snapshot()
  local previous = ev.cost
  if #SHORTS > 0 or EXPORT > 0 then
    unshort(spent(ev), previous - cost, now)
    export('settle', ev.rec.id, cost, spent(ev), previous)
  end
  ev.cost = cost
  update(ev)
  TOTAL = TOTAL - previous + cost
  local used = write_total(now)
  crossed(before, now)
  return used
end

-- Records a spend event of `cost` at `now` (inside every window); `o`: the
-- owner of a charge (nonce, deadline, op, fp), held by its submission; `slot`:
-- where `find` answered the id goes. The keys expire with it, so an idle user
-- leaves nothing behind. Returns the total and the event's time: now, or the
-- log's last time if the clock went back. (`limits`, `used`: ignored.)
local function record(request, cost, now, limits, used, o, slot)
  local before = snapshot()
  local packed = pack_record(request, o)
  local sid = redis.pcall('XADD', LOG, int(now) .. '-*', 'r', packed)
  if type(sid) ~= 'string' then
    sid = redis.call('XADD', LOG, '*', 'r', packed)
  end
  local ms, seq = string.match(sid, '^(%d+)-(%d+)$')
  local ev = { at = tonumber(ms), seq = tonumber(seq), state = o and 'h' or 'r', cost = cost }
  if slot.kept < now + 2 * RETAIN then
    local at = int(now + 2 * RETAIN + slack())
    redis.call('HSET', slot.key, '~', at, slot.field, pack_value(ev))
    redis.call('PEXPIREAT', slot.key, at)
  else
    redis.call('HSET', slot.key, slot.field, pack_value(ev))
  end
  export('spend', request, cost, ev.at, nil, o and o.op)
  for _, s in ipairs(SHORTS) do
    s.total = s.total + cost
  end
  TOTAL = TOTAL + cost
  -- A log this entry started has no expiry yet, whatever meta says.
  if grow(now) == 1 then
    KEPT = 0
  end
  used = write_total(now)
  if o then
    redis.call('PEXPIRE', HOLDS, int(RETAIN))
  end
  crossed(before, now)
  return used, ev.at
end

-- Inserts an event moved in from another location (a user moving between
-- organisations), after `expire`, with the time `at` it was spent (inside the
-- retention): appended to the log in time order when nothing later is there,
-- else appended now and kept in MOVED by its real time, so that it still
-- leaves each window at `at`. Counted in every window it is still inside.
-- `ev`: { state, cost, estimate }; `o`: a charge's owner record; `slot`: from
-- `find`.
local function insert(request, at, ev, o, now, slot)
  local packed = pack_record(request, o)
  local sid = redis.pcall('XADD', LOG, int(at) .. '-*', 'r', packed)
  if type(sid) ~= 'string' then
    sid = redis.pcall('XADD', LOG, int(now) .. '-*', 'r', packed)
    if type(sid) ~= 'string' then
      sid = redis.call('XADD', LOG, '*', 'r', packed)
    end
    ev.real = at
    if not MV then
      -- After `expire` every window's moved walk starts at its edge.
      MV = {}
      for k, s in ipairs(SHORTS) do
        MV[k] = now - s.window
      end
    end
    redis.call('ZADD', moved_key(), int(at), request)
  end
  local ms, seq = string.match(sid, '^(%d+)-(%d+)$')
  ev.at, ev.seq = tonumber(ms), tonumber(seq)
  local keep_until = int(now + 2 * RETAIN + slack())
  redis.call('HSET', slot.key, '~', keep_until, slot.field, pack_value(ev))
  redis.call('PEXPIREAT', slot.key, keep_until)
  for _, s in ipairs(SHORTS) do
    -- After `expire` nothing in (cursor, now - window] is left to subtract
    -- (its walk may leave the cursor behind when it found nothing): move it
    -- up, so that an event appended in order that already left the window
    -- is not subtracted later.
    if s.cursor < now - s.window then
      s.cursor = now - s.window
    end
    if at > now - s.window then
      s.total = s.total + ev.cost
    end
  end
  TOTAL = TOTAL + ev.cost
  grow(now)
  KEPT = 0
  write_total(now)
  if ev.real then
    redis.call('PEXPIREAT', moved_key(), int(KEPT))
  end
end

-- A member's organisation. MEMBER: the user (from its keys' names).
local MEMBER = nil

local function org_id(request)
  return request .. '/' .. MEMBER
end

-- Opens the organisation's side of a member's call, after the user's
-- `expire`: resolves the organisation's plan (ARGV from `i`, as
-- `resolve_plan`), brings its windows to now and removes its copies of the
-- charges the user's `expire` released. Returns { name, limits }, or nil for
-- a user in no organisation. Leaves the user's subject in use.
local function org_open(now, i)
  if not is_member() then
    return nil
  end
  MEMBER = string.match(BASE, ':u:([^:]+)$')
  local released = RELEASED or {}
  RELEASED = nil
  use('org')
  local name, limits = resolve_plan(i)
  EXPORT = 0
  expire(now, limits)
  for _, id in ipairs(released) do
    local ev = find(org_id(id))
    if ev then
      remove(ev, 0, now)
    end
  end
  use('user')
  return { name = name, limits = limits }
end

-- The start of a step on the budget (the plan table from ARGV[i]): resolve
-- the plan, expire, then open the organisation. Returns now, what `expire`
-- left used, the organisation (`org_open`), the plan's limits and its name.
local function open_budget(i)
  local name, limits = resolve_plan(i)
  local now = now_ms()
  local used = expire(now, limits)
  return now, used, org_open(now, i), limits, name
end

-- The start of a step that spends `cost` on `request` (the plan table from
-- ARGV[i]): expire, open the organisation, then find the request's event.
-- Returns the reply { -1, max_cost } when the cost can never fit the user's
-- plan or its organisation's (the smaller max_cost of the two), else nil,
-- limits, now, used, org, the event and slot of `find`, and the user's plan
-- name (`resolve_plan`'s).
local function open_spend(request, cost, i)
  local name, limits = resolve_plan(i)
  local most = max_cost(limits)
  if too_costly(limits, cost) then
    return { -1, most }
  end
  local now = now_ms()
  local used = expire(now, limits)
  local org = org_open(now, i)
  if org and cost > max_cost(org.limits) then
    return { -1, math.min(most, max_cost(org.limits)) }
  end
  local ev, slot = find(request)
  return nil, limits, now, used, org, ev, slot, name
end

-- Whether `cost` fits every window of the organisation's plan too.
local function org_fits(org, cost)
  if not org then
    return true
  end
  use('org')
  local ok = fits(org.limits, 0, cost)
  use('user')
  return ok
end

-- Records the organisation's copy of a member's new event.
local function org_record(org, request, cost, now)
  if not org then
    return
  end
  use('org')
  local ev, slot = find(org_id(request))
  if not ev then
    record(org_id(request), cost, now, org.limits, 0, nil, slot)
  end
  use('user')
end

-- Sets (cost >= 1) or removes (0) the organisation's copy of a member's event.
local function org_recost(org, request, cost, now)
  if not org then
    return
  end
  use('org')
  local ev = find(org_id(request))
  if ev and cost == 0 then
    remove(ev, 0, now)
  elseif ev and ev.cost ~= cost then
    recost(ev, cost, now)
  end
  use('user')
end

-- Appends the organisation's plan name and windows (see push_windows; with
-- `cost`: its retry_after per window) to a member's reply.
local function org_windows(out, org, now, cost)
  if not org then
    return out
  end
  use('org')
  out[#out + 1] = org.name
  push_windows(out, org.limits, 0, now, cost)
  use('user')
  return out
end
