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
-- is one field. A charge adds to the current period; a refund, release,
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

-- Picks the period `now` falls in for each period limit of `limits` (its
-- `start`, `stop` and `field`) and reads their totals (one HMGET). Refuses a
-- time outside the boundaries passed.
local function load_periods(now, limits)
  PERIODS, PERIODS_DIRTY, PERIODS_NEW = nil, false, false
  if limits.nw == #limits then
    return
  end
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
    l.field = int(l.start) .. '-' .. int(l.stop)
    fields[#fields + 1] = l.field
  end
  local got = redis.call('HMGET', periods_key(), unpack(fields))
  PERIODS = {}
  for j, f in ipairs(fields) do
    PERIODS[f] = tonumber(got[j]) or 0
    if not got[j] then
      PERIODS_NEW = true
    end
  end
end

-- What limit `l` (a period's) counts now.
local function period_used(l)
  return PERIODS and PERIODS[l.field] or 0
end

-- Counts `delta` in every current period that an event spent at `at`
-- (nil: now) was spent in.
local function period_move(at, delta)
  -- A move's steps (NOCHECK) leave the user's totals alone: move_in.lua
  -- carries them whole; an organisation's follow its member's events.
  if not PERIODS or delta == 0 or (NOCHECK and SUBJECT == 'user') then
    return
  end
  for k = LIMITS.nw + 1, #LIMITS do
    local l = LIMITS[k]
    if not at or (at >= l.start and at < l.stop) then
      local t = PERIODS[l.field] + delta
      PERIODS[l.field] = t > 0 and t or 0
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
  for k = LIMITS.nw + 1, #LIMITS do
    local l = LIMITS[k]
    args[#args + 1] = l.field
    args[#args + 1] = int(PERIODS[l.field])
    if l.stop > last then
      last = l.stop
    end
  end
  redis.call('HSET', key, unpack(args))
  if PERIODS_NEW then
    PERIODS_NEW = false
    local old = {}
    for _, f in ipairs(redis.call('HKEYS', key)) do
      local stop = tonumber(string.match(f, '^%d+%-(%d+)$'))
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
