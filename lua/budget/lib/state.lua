-- budget/lib/state.lua: the first part of the prelude shared by every budget
-- script; the parts follow one another in the order of `PRELUDE` in
-- crates/tollgate-redis/src/scripts/budget.rs (state, plan, codec, index,
-- windows, alerts, expire, events, orgs), one Lua chunk in which each part sees
-- the locals of the parts before it. The `scripts` module loads the prelude
-- with the budget scripts as one function library (FUNCTION LOAD), each script
-- the body of a function that starts with `begin(keys, args)`.
--
-- One user's budget lives in keys sharing the user's hash tag. A live spend
-- event is one entry of the log stream plus one entry of an index bucket, both
-- kept listpack-encoded by Redis (no per-event allocation): about 60 B of Redis
-- memory per reserve and 100 B per charge with the ids the api generates, where
-- a sorted set and hashes keyed by request id cost 230-390 B.
--   KEYS[4] log     stream: one entry per live event, its ID '<at_ms>-<seq>' (the
--                   time the tokens were spent; Redis keeps IDs increasing, so
--                   the log is in time order and XRANGE reads a window), one
--                   field 'r': what never changes, packed: the request id (a
--                   UUID or 'idem-' + 32 hex as 16 bytes, any other id as is),
--                   and for a charge taken by charge.lua its nonce, request
--                   fingerprint (hex packed), deadline and operation.
--   index buckets   hashes '<base>:e:<n>' (base: KEYS[5] without ':meta'): the
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
--   KEYS[5] meta    hash: 't' '<total>' the running sum of the costs of every
--                   event in the log, followed by ' <window_ms> <total>
--                   <cursor_ms>' per window of the user's plan shorter than the
--                   retention, its running total (events at or before the
--                   cursor were subtracted); 'l', 's': the bucket count's power
--                   of two and split pointer (absent: 1 and 0); 'x': the time
--                   (ms) the log's and meta's expiry was last set to.
--                   'q' (plans with alert thresholds, once one was crossed):
--                   per limit '<released>:<until_ms>:<flags>', comma
--                   separated, the thresholds crossed and not re-armed (see
--                   `latches` in budget/lib/alerts.lua).
--   KEYS[1] plan    string: the user's plan name (absent: the default plan)
--   '<base>:limits' string: limits an admin set for this user, in the plan
--                   table's 'limit:window_ms,...' form; they replace its
--                   plan's (the plan is then named 'custom:<plan>'), read in
--                   the same step; absent: the plan's.
--   KEYS[2] holds   sorted set: request id -> end of the hold (ms) of each 'h'
--                   charge: its job's deadline plus a grace. A charge still held
--                   then has no job that can run (a job past its deadline never
--                   starts), so the next budget step releases it.
--   KEYS[6] cancelled sorted set: nonce -> end of the hold of a held charge an
--                   operator refunded (refund.lua): its job is cancelled, and
--                   its claim refused until then (claim.lua).
--   KEYS[3] audit   stream: with [export] configured, every spend, refund and
--                   settle, in order (XADD MAXLEN ~): fields kind (spend | refund
--                   | settle), id, cost (settle: the new cost), prev (settle: the
--                   old one), at (when the event was spent, ms), op (spend of a
--                   job's charge), forced ('1' on an operator's forced
--                   correction, else absent). It outlives the window; billing
--                   jobs read it.
--   '<base>:su', '<base>:sd'  hashes: the spend rollups, hourly and daily,
--                   and the dimensions' dictionary (budget/lib/rollups.lua);
--                   meta's 'k' the code and dimensions of the user's last
--                   charge.
--   '<base>:p'      hash: the totals of the plan's calendar periods, one field
--                   per period '<start_ms>-<end_ms>' -> total (see
--                   budget/lib/periods.lua); expires after the last period
--                   it counts ends.
-- The ARGV tail is the export's maxlen (0: no export), the retention (ms: the
-- longest window of any configured plan, at least a day with a period limit),
-- the spend rollups' keeps ('<hourly_ms> <daily_ms>'), the calendars' count n and n boundaries ('<prev start> <start> <end> <next
-- end>', see budget/lib/periods.lua), then the plan table as pairs (name,
-- limits), the default plan first; limits is 'limit:window_ms,...', longest
-- window first, then each period limit as 'limit:p<calendar>', then, with alerts, '|' and per threshold '<basis points>:<tokens
-- in limit 1>:<tokens in limit 2>...', comma separated (see `alert_marks`). The log keeps every event for the retention, whatever the
-- user's plan, so a plan change never erases spend; a reservation must fit
-- every window of the user's plan.
-- Time is Redis TIME: pod clocks never decide a budget.

-- The library is loaded once per Redis as a function library (FUNCTION LOAD):
-- its top level runs at load, not per call, and every value below that a call
-- sets is set again by `begin` at the start of each call (no call sees
-- another's state).
local KEYS, ARGV
local PLAN, HOLDS, AUDIT, LOG, META, CANCELLED, BASE
-- Log entries read per command in a walk: the time bound below is checked
-- between two batches.
local BATCH = 25
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
-- The prices a priced job's charge was reserved at (price/applied.rs's text)
-- for its spend entry in the export: set by charge.lua, '' otherwise. The
-- library's state outlives a call: resolve_plan clears it on every call.
local PRICE = ''
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
-- The thresholds each subject's windows keep crossed (meta's 'q', see
-- `latches`), by meta key, read at most once a call.
local LATCHES = nil
-- An outbox no deliverer looked at this long after an alert was queued has
-- its pointer added again by the next call's caller (its first caller may
-- have died before adding it).
local REPOINT_MS = 10000
-- A subject's outbox: at most this many alerts (OUTBOX_MAX in
-- tollgate_core::alerts), kept this long (ms) past its last write (more than
-- the longest `[alerts] keep`).
local OUTBOX_MAX = 1000
local OUTBOX_TTL = 8 * 86400 * 1000

-- Calendar periods (budget/lib/periods.lua): each calendar's boundaries
-- from ARGV ({ prev start, start, end, next end }, by calendar number), and
-- the subject's current periods' totals by field (nil: its plan has none),
-- whether one changed, whether one is new (its field was absent).
local CALS, PERIODS, PERIODS_DIRTY, PERIODS_NEW = {}, nil, false, false
-- How long a period's totals are kept past its end (ms).
local PERIOD_GRACE = 3600 * 1000

-- Organisations. A member's budget keys (KEYS[1..6]) live under its
-- organisation's hash tag, next to the organisation's own budget (KEYS[7..12]):
-- the same structure over the organisation's plan, whose events are keyed by
-- '<request>/<user>' (ids never hold '/'). `use` switches every per-call
-- state above between the two subjects ('user', 'org'), so that `expire`,
-- `fits`, `record`, `remove` and `recost` apply to either; a member's script
-- applies them to both. A member is a call with more than 6 KEYS.
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
  PLAN, HOLDS, AUDIT, LOG, META, CANCELLED =
    keys[o + 1], keys[o + 2], keys[o + 3], keys[o + 4], keys[o + 5], keys[o + 6]
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
  LIMITS, POINTS, PENDING, LATCHES = nil, nil, nil, nil
  CALS, PERIODS, PERIODS_DIRTY, PERIODS_NEW = {}, nil, false, false
  -- SAVED and RELEASED are made when first needed: most calls need neither.
  SUBJECT, SAVED, RELEASED, MV, NOCHECK = 'user', nil, nil, nil, false
end

-- Switches the per-call state to `subject` ('user' or 'org': a member's
-- organisation, KEYS[7..12]), saving the other's. The organisation keeps no
-- export (EXPORT 0): the export is per user.
local function use(subject)
  if subject == SUBJECT then
    return
  end
  SAVED = SAVED or {}
  SAVED[SUBJECT] = { PLAN, HOLDS, AUDIT, LOG, META, CANCELLED, BASE,
    SHORTS, SHORTS_STALE, FIRST, TOTAL, EXPORT, SIZE, SPLIT, KEPT, MV, LIMITS, PENDING,
    PERIODS, PERIODS_DIRTY, PERIODS_NEW }
  local s = SAVED[subject]
  if s then
    PLAN, HOLDS, AUDIT, LOG, META, CANCELLED, BASE, SHORTS,
      SHORTS_STALE, FIRST, TOTAL, EXPORT, SIZE, SPLIT, KEPT, MV, LIMITS, PENDING,
      PERIODS, PERIODS_DIRTY, PERIODS_NEW = unpack(s, 1, 21)
  else
    set_keys(KEYS, subject == 'org' and 6 or 0)
    SHORTS, SHORTS_STALE, FIRST, TOTAL, SIZE, SPLIT, KEPT, MV = {}, false, 2, 0, 1, 0, 0, nil
    EXPORT, LIMITS, PENDING = 0, nil, nil
    PERIODS, PERIODS_DIRTY, PERIODS_NEW = nil, false, false
  end
  SUBJECT = subject
end

-- Whether this call is a member's (its organisation's keys follow its own).
local function is_member()
  return #KEYS > 6
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
