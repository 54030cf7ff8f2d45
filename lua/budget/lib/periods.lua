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
-- hash tag): '<start_ms>-<end_ms>' -> total, so a month of a million charges
-- is one field (and one for its era, below). A charge adds to the current period; a refund, release,
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
-- of its span without a break (the field 's<start>-<end>'), and, when no
-- current limit uses it though its period has not ended (a plan change to
-- another calendar), the time it stopped ('u<start>-<end>'). A refund,
-- release or settle of an event lands in every counter whose span and era
-- hold the event's time, current or not; an event spent outside them was
-- never counted there (a counter a plan change made after it; another
-- calendar's while it was spent). A counter current again starts a new era:
-- a charge of its first era then gives nothing back (the safe side: it
-- stays counted). A counter of an older version has no since: 0, as before.
local function since_field(f)
  return 's' .. f
end

local function until_field(f)
  return 'u' .. f
end

-- Picks the period `now` falls in for each period limit of `limits` (its
-- `start`, `stop` and `field`) and reads every counter whose period has not
-- ended, with its era (one HGETALL of a few fields). Refuses a time outside
-- the boundaries passed.
local function load_periods(now, limits)
  PERIODS, PERIODS_DIRTY, PERIODS_NEW = nil, false, false
  if limits.nw == #limits then
    return
  end
  local current = {}
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
    l.field = int(l.start) .. '-' .. int(l.stop)
    current[l.field] = { l.start, l.stop }
  end
  local got = redis.call('HGETALL', periods_key())
  local have = {}
  for j = 1, #got, 2 do
    have[got[j]] = tonumber(got[j + 1])
  end
  -- fields: every counter loaded, in order; span, era by field; reopened:
  -- the 'u' fields to delete at the next write.
  PERIODS = { fields = {}, span = {}, reopened = {} }
  for f, span in pairs(current) do
    local total, since, stop = have[f], have[since_field(f)] or 0, have[until_field(f)]
    if not total then
      PERIODS_NEW = true
      total, since = 0, now
    elseif stop then
      since, stop = now, nil
      PERIODS.reopened[#PERIODS.reopened + 1] = until_field(f)
    end
    PERIODS.fields[#PERIODS.fields + 1] = f
    PERIODS.span[f] = span
    PERIODS[f], PERIODS[since_field(f)], PERIODS[until_field(f)] = total, since, nil
  end
  for f, total in pairs(have) do
    local start, stop = string.match(f, '^(%d+)%-(%d+)$')
    start, stop = tonumber(start), tonumber(stop)
    if stop and stop > now and not current[f] then
      PERIODS.fields[#PERIODS.fields + 1] = f
      PERIODS.span[f] = { start, stop }
      PERIODS[f], PERIODS[since_field(f)] = total, have[since_field(f)] or 0
      PERIODS[until_field(f)] = have[until_field(f)] or now
    end
  end
end

-- What limit `l` (a period's) counts now.
local function period_used(l)
  return PERIODS and PERIODS[l.field] or 0
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
  for _, f in ipairs(PERIODS.fields) do
    local span, since, stop = PERIODS.span[f], PERIODS[since_field(f)], PERIODS[until_field(f)]
    local counts
    if not at then
      counts = not stop
    elseif at < span[1] or at >= span[2] then
      counts = false
    elseif moved then
      counts = not stop
      if counts and at < since then
        PERIODS[since_field(f)] = at
      end
    else
      counts = at >= since and (not stop or at < stop)
    end
    if counts then
      local t = PERIODS[f] + delta
      PERIODS[f] = t > 0 and t or 0
      PERIODS_DIRTY = true
    end
  end
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
  for _, f in ipairs(PERIODS.fields) do
    args[#args + 1] = f
    args[#args + 1] = int(PERIODS[f])
    args[#args + 1] = since_field(f)
    args[#args + 1] = int(PERIODS[since_field(f)])
    if PERIODS[until_field(f)] then
      args[#args + 1] = until_field(f)
      args[#args + 1] = int(PERIODS[until_field(f)])
    end
    if PERIODS.span[f][2] > last then
      last = PERIODS.span[f][2]
    end
  end
  redis.call('HSET', key, unpack(args))
  if #PERIODS.reopened > 0 then
    redis.call('HDEL', key, unpack(PERIODS.reopened))
    PERIODS.reopened = {}
  end
  if PERIODS_NEW then
    PERIODS_NEW = false
    local old = {}
    for _, f in ipairs(redis.call('HKEYS', key)) do
      local stop = tonumber(string.match(f, '^[su]?%d+%-(%d+)$'))
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
end
