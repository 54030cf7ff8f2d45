-- budget/lib/periods.lua: the totals of a plan's calendar-period limits.
-- Part of the budget library's prelude (see budget/lib/state.lua).
--
-- A period limit ('<limit>:p<k>' in the plan table) counts what was spent in
-- the current period of calendar k. The caller passes each calendar's
-- boundaries around its own clock (ARGV, see `read_calendars`: the previous
-- period's start, the current one's start and end, the next one's end, ms);
-- Redis TIME picks the period among them (`load_periods`), and a time
-- outside them is refused, never guessed: TOLLGATE_PERIOD <now_ms>, and the
-- caller computes them again around that time and calls again.
--
-- Each period's total is one field of the hash '<base>:p' (the subject's
-- hash tag): '<start_ms>-<end_ms>' -> total (and its era, below), so a month
-- of a million charges is one counter. A charge adds to the current period; a refund, release,
-- settle or operator correction lands in the period its charge was spent in
-- (`period_move`): in a period that ended it changes nothing current (that
-- period's field is gone or going). An event leaving the log's retention
-- stays counted: the log keeps events for what refunds need, not for the
-- period. The key expires PERIOD_GRACE after the end of the latest period
-- it counts; the fields of periods that ended are dropped when a field for
-- a new period is made (once per period: amortised O(1)).

local function periods_key()
  return BASE .. ':p'
end

-- Reads the calendars' boundaries from ARGV[i] (their count) and the
-- ARGV after it ('<prev start> <start> <end> <next end>' each); returns the
-- index after them (the plan table's).
local function read_calendars(i)
  local n = tonumber(ARGV[i]) or 0
  CALS = {}
  for k = 1, n do
    local a, b, c, d = string.match(ARGV[i + k] or '', '^(%d+) (%d+) (%d+) (%d+)$')
    CALS[k] = { tonumber(a), tonumber(b), tonumber(c), tonumber(d) }
  end
  return i + 1 + n
end

-- A counter's era: the time from which it has counted the subject's charges
-- of its span without a break, and, once no current limit uses it though its
-- period has not ended (a plan change to another calendar), the time it
-- stopped. A refund, release or settle of an event lands in every counter
-- whose span and era hold the event's time, current or not; an event spent
-- outside them was never counted there (a counter a plan change made after
-- it; another calendar's while it was spent). A counter current again starts
-- a new era: a charge of its first era then gives nothing back (the safe
-- side: it stays counted).
-- Fields: '<start>-<end>' -> the total of a current counter (an integer: a
-- reserve reads and writes that alone), 's<start>-<end>' -> its since
-- (written when the counter is made or reopened; none: 0, an older
-- version's), 'x<start>-<end>' -> '<total>:<since>:<till>' for a counter a
-- plan change left.

-- Reads the whole hash (a few fields), once per call, when the eras matter:
-- a new period or a plan change (a counter to make, reopen or leave), or a
-- correction of an event (`period_move`). A counter no current limit uses
-- leaves now; one left before is read with its era.
local function load_others()
  if PERIODS.others then
    return
  end
  PERIODS.others = true
  local got = redis.call('HGETALL', periods_key())
  local have = {}
  for j = 1, #got, 2 do
    have[got[j]] = got[j + 1]
  end
  local now = PERIODS.now
  for _, c in ipairs(PERIODS.list) do
    local left = have['x' .. c.field]
    if c.total then
      c.since = tonumber(have['s' .. c.field]) or 0
    elseif left then
      c.total = tonumber(string.match(left, '^(%d+)')) or 0
      c.since, c.dirty, c.era = now, true, true
      PERIODS.gone[#PERIODS.gone + 1] = 'x' .. c.field
    else
      PERIODS_NEW = true
      c.total, c.since, c.dirty, c.era = 0, now, true, true
    end
  end
  for j = 1, #got, 2 do
    local f = got[j]
    local x, start, stop = string.match(f, '^(x?)(%d+)%-(%d+)$')
    stop = tonumber(stop)
    local plain = x == ''
    if stop and stop > now and not (plain and PERIODS[f]) and not (not plain and PERIODS[string.sub(f, 2)]) then
      local c = { field = plain and f or string.sub(f, 2), start = tonumber(start), stop = stop }
      if plain then
        c.total, c.since, c.till, c.dirty = tonumber(got[j + 1]) or 0, tonumber(have['s' .. f]) or 0, now, true
        PERIODS.gone[#PERIODS.gone + 1] = f
        PERIODS.gone[#PERIODS.gone + 1] = 's' .. f
      else
        local t, si, ti = string.match(got[j + 1], '^(%d+):(%d+):(%d+)$')
        c.total, c.since, c.till = tonumber(t) or 0, tonumber(si) or 0, tonumber(ti) or now
      end
      PERIODS[c.field] = c
      PERIODS.list[#PERIODS.list + 1] = c
    end
  end
end

-- Picks the period `now` falls in for each period limit of `limits` (its
-- `start`, `stop` and `field`) and reads their totals (one HMGET; the eras
-- only when they matter: `load_others`). Refuses a time outside the
-- boundaries passed. PERIODS: the counters by field, and in `list`; each
-- { field, start, stop, total, since, till (nil: current), dirty (its
-- value to write), era (its since to write) }; `gone`: fields to delete.
local function load_periods(now, limits)
  PERIODS, PERIODS_DIRTY, PERIODS_NEW = nil, false, false
  if limits.nw == #limits then
    return
  end
  PERIODS = { list = {}, gone = {}, now = now }
  local fields = {}
  for k = limits.nw + 1, #limits do
    local l = limits[k]
    local cal = CALS[l.cal]
    if not (cal and cal[4]) or now < cal[1] or now >= cal[4] then
      error({ err = 'TOLLGATE_PERIOD ' .. int(now)
        .. ' the ledger clock is outside the period boundaries passed: call again with boundaries around it' })
    end
    if now < cal[2] then
      l.start, l.stop = cal[1], cal[2]
    elseif now < cal[3] then
      l.start, l.stop = cal[2], cal[3]
    else
      l.start, l.stop = cal[3], cal[4]
    end
    local f = int(l.start) .. '-' .. int(l.stop)
    l.field = f
    if not PERIODS[f] then
      local c = { field = f, start = l.start, stop = l.stop }
      PERIODS[f] = c
      PERIODS.list[#PERIODS.list + 1] = c
      fields[#fields + 1] = f
    end
  end
  local got = redis.call('HMGET', periods_key(), unpack(fields))
  local missing = false
  for j, c in ipairs(PERIODS.list) do
    c.total = tonumber(got[j])
    missing = missing or not c.total
  end
  if missing then
    load_others()
  end
end

-- What limit `l` (a period's) counts now.
local function period_used(l)
  return PERIODS and PERIODS[l.field].total or 0
end

-- Counts `delta` in every counter that counted an event spent at `at` (nil:
-- a new charge, now: every current period). `moved`: the event moves in
-- from the subject's other location (`insert`): counted in the current
-- period it was spent in whenever that was, the era going back to it.
local function period_move(at, delta, moved)
  -- A move's steps (NOCHECK) leave the user's totals alone: move_in.lua
  -- carries them whole; an organisation's follow its member's events.
  if not PERIODS or delta == 0 or (NOCHECK and SUBJECT == 'user') then
    return
  end
  if at then
    load_others()
  end
  for _, c in ipairs(PERIODS.list) do
    local counts
    if not at then
      counts = not c.till
    elseif at < c.start or at >= c.stop then
      counts = false
    elseif moved then
      counts = not c.till
      if counts and at < c.since then
        c.since, c.era = at, true
      end
    else
      counts = at >= c.since and (not c.till or at < c.till)
    end
    if counts then
      local t = c.total + delta
      c.total, c.dirty = t > 0 and t or 0, true
      PERIODS_DIRTY = true
    end
  end
end

-- A counter hash whose fields end in `-<stop ms>` (`pattern` captures it):
-- the fields of ended periods (or that `pattern` does not read) go, and the
-- key lives past the latest period it counts (at least `last`).
local function drop_ended(key, pattern, now, last)
  local old = {}
  for _, f in ipairs(redis.call('HKEYS', key)) do
    local stop = tonumber(string.match(f, pattern))
    if not stop or stop <= now then
      old[#old + 1] = f
    elseif stop > last then
      last = stop
    end
  end
  if #old > 0 then
    redis.call('HDEL', key, unpack(old))
  end
  redis.call('PEXPIREAT', key, int(last + PERIOD_GRACE))
end

-- Writes the totals changed (`write_total` calls it). A field made for a
-- new period drops the fields of periods that ended, and sets the key's
-- expiry past the end of the latest period it counts.
local function save_periods(now)
  if not PERIODS_DIRTY then
    return
  end
  PERIODS_DIRTY = false
  local key, args, last = periods_key(), {}, 0
  for _, c in ipairs(PERIODS.list) do
    if c.dirty then
      c.dirty = false
      if c.till then
        args[#args + 1] = 'x' .. c.field
        args[#args + 1] = int(c.total) .. ':' .. int(c.since) .. ':' .. int(c.till)
      else
        args[#args + 1] = c.field
        args[#args + 1] = int(c.total)
      end
    end
    if c.era then
      c.era = false
      args[#args + 1] = 's' .. c.field
      args[#args + 1] = int(c.since)
    end
    if c.stop > last then
      last = c.stop
    end
  end
  if #args > 0 then
    redis.call('HSET', key, unpack(args))
  end
  if #PERIODS.gone > 0 then
    redis.call('HDEL', key, unpack(PERIODS.gone))
    PERIODS.gone = {}
  end
  if PERIODS_NEW then
    PERIODS_NEW = false
    drop_ended(key, '^[sx]?%d+%-(%d+)$', now, last)
  end
end
