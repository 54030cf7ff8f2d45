-- budget/lib/rollups.lua: the spend rollups, what a user's charges came to per
-- hour and per day, by dimensions, kept in the same step as each change.
-- Part of the budget library's prelude (see budget/lib/state.lua).
--
-- Two hashes in the user's slot (a member's: its location's, like its log):
--   '<base>:su'  hourly buckets: '<hour>:<code>' -> amount (hour: ms / 3600000),
--                and 'f': the hour of its last fold (below).
--   '<base>:sd'  daily buckets: '<day>:<code>' -> amount (day: ms / 86400000,
--                UTC days), '^' the latest day written, and the dimensions'
--                dictionary: 'c<code>' -> '<org>\t<operation>\t<provider>\t
--                <model>' (as the caller passes them), '=<dims>' -> code, 'n'
--                the last code given.
-- A charge adds its cost to the bucket of the hour it was spent in (one
-- write); the first charge of a new hour folds the hours of the days before
-- today not folded yet into their days' buckets (`fold`): the hours of the
-- days before 'f''s are counted in both hashes, the later ones only in the
-- hours, and a report by day reads the days and those hours in one atomic
-- read. Its event keeps the code (`pack_value`: '#<code>', 2-4 bytes), so a
-- settle, a refund or a release (an operator's correction, a hold's end)
-- changes the buckets of the same hour (and, folded, day), whenever it
-- comes: a bucket is exact against the charges made in it, as they stand.
-- An event leaving the log's retention stays counted (it was spent). A
-- bucket that comes to 0 is dropped; folded hours older than the hourly keep
-- and days older than the daily keep (ARGV, see `resolve_plan`) are dropped
-- when a bucket of a new hour (day) is made. Both keys expire the daily keep
-- after their latest day (no sooner than three retentions: the dictionary
-- names the live events' codes), so that an idle user's unfolded hours wait
-- for its next charge (at most a day of them, plus the hourly keep's folded
-- ones, per dimensions). Only the user's own steps count (not its
-- organisation's copies, not a move's steps). Builds before the fold kept
-- the hours in '<base>:sh', each also counted in its day at once: left to
-- expire, hourly reports add them.

-- How long the buckets are kept (ms; 0: no rollups), from ARGV.
local KEEP_H, KEEP_D = 0, 0
-- The dimensions of this call's new charge (charge.lua, reserve.lua).
local DIMS = ''
-- Meta's 'k': '<code>|<dims>', the user's last charge's dimensions and code
-- (read with the totals, so that a user charging under the same dimensions
-- as before needs no dictionary read); NEW_DIMS: this call's, to write with
-- the totals (`write_total`).
local LAST_DIMS, NEW_DIMS = nil, nil
local HOUR_MS, DAY_MS = 3600000, 86400000

-- Reads the keeps from ARGV[i] ('<hourly_ms> <daily_ms>').
local function read_keeps(i)
  local h, d = string.match(ARGV[i] or '', '^(%d+) (%d+)$')
  KEEP_H, KEEP_D = tonumber(h) or 0, tonumber(d) or 0
end

-- Whether this step counts in the rollups.
local function rolling()
  return KEEP_D > 0 and SUBJECT == 'user' and not NOCHECK
end

-- Meta's 'k' values read lately, parsed ({ code, dims }): the same user's
-- next charge, and users charging under the same dimensions, skip the
-- pattern match. At most 256, then started afresh.
local KNOWN, KNOWN_N = {}, 0

-- The code of this call's dimensions in the dictionary (given when new), as
-- its digits: a string the event and the bucket's field take as it is
-- (formatting a number, `int`, costs a charge more than its bucket's write).
local function dims_code()
  if not rolling() then
    return nil
  end
  if LAST_DIMS then
    local k = KNOWN[LAST_DIMS]
    if not k then
      k = { string.match(LAST_DIMS, '^(%d+)|(.*)$') }
      if KNOWN_N >= 256 then
        KNOWN, KNOWN_N = {}, 0
      end
      KNOWN[LAST_DIMS], KNOWN_N = k, KNOWN_N + 1
    end
    if k[2] == DIMS then
      return k[1]
    end
  end
  local key = BASE .. ':sd'
  local code = redis.call('HGET', key, '=' .. DIMS)
  if not code then
    code = int(redis.call('HINCRBY', key, 'n', 1))
    redis.call('HSET', key, '=' .. DIMS, code, 'c' .. code, DIMS)
  end
  NEW_DIMS = code .. '|' .. DIMS
  return code
end

-- The last hour a bucket's field named, and its digits (see `dims_code`).
local HOUR_N, HOUR_S = nil, nil
local function hour_digits(n)
  if n ~= HOUR_N then
    HOUR_N, HOUR_S = n, int(n)
  end
  return HOUR_S
end

-- Adds `delta` to `field` of `key`; a bucket brought to 0 or below goes.
-- Returns the new amount.
local function add_to(key, field, delta)
  local v = redis.call('HINCRBY', key, field, delta)
  if v <= 0 then
    redis.call('HDEL', key, field)
  end
  return v
end

-- Adds `delta` to the bucket of `at` in one rollup (`size`: its step, `keep`
-- how long it keeps buckets, `hold`: the least its key lives past its
-- latest bucket): the daily one, as hours fold into it, and a correction of
-- a folded hour's charge.
local function bump(key, size, keep, hold, at, code, delta, now)
  local n, cur = math.floor(at / size), math.floor(now / size)
  local kept = math.max(math.floor(keep / size), 1)
  if n + kept <= cur then
    return -- dropped already: nothing current to change
  end
  local v = add_to(key, int(n) .. ':' .. code, delta)
  if v <= 0 or v ~= delta then
    return
  end
  -- A new bucket: the first of a new hour (day)?
  local last = tonumber(redis.call('HGET', key, '^'))
  if last and last >= cur then
    return
  end
  local old = {}
  for _, f in ipairs(redis.call('HKEYS', key)) do
    local b = tonumber(string.match(f, '^(%d+):'))
    if b and b + kept <= cur then
      old[#old + 1] = f
    end
  end
  if #old > 0 then
    redis.call('HDEL', key, unpack(old))
  end
  redis.call('HSET', key, '^', int(cur))
  redis.call('PEXPIREAT', key, int((cur + 1) * size + math.max(keep, hold)))
end

-- When the rollup keys of a user last written on `day` expire: a daily keep
-- after it (the dictionary no sooner than three retentions: meta lives at
-- most 1.125 retentions past a write), and the hours the same, so that an
-- idle user's unfolded hours are still there when its next charge folds
-- them (or until their day is past the daily keep).
local function rollups_end(day)
  return int((day + 1) * DAY_MS + math.max(KEEP_D, 3 * RETAIN))
end

-- The first bucket of a new hour `cur`, `last` the hour of the previous
-- one (nil: a new key): folds the hours of the days before today not folded
-- yet ('f': the first hour of the first day not folded) into the daily
-- buckets, drops folded hours past the hourly keep, and keeps both keys
-- until the daily keep after today.
local function fold(key, last, cur, now)
  local today = math.floor(cur / 24)
  local from = last and math.floor(last / 24) or 0
  local kept = math.max(math.floor(KEEP_H / HOUR_MS), 1)
  local sums, order, old = {}, {}, {}
  local all = redis.call('HGETALL', key)
  for i = 1, #all, 2 do
    local h, c = string.match(all[i], '^(%d+):(%d+)$')
    h = tonumber(h)
    if h and h < today * 24 then
      local d = math.floor(h / 24)
      if d >= from then
        local f = int(d) .. ':' .. c
        if not sums[f] then
          sums[f], order[#order + 1] = 0, { d, c, f }
        end
        sums[f] = sums[f] + tonumber(all[i + 1])
      end
      if h + kept <= cur then
        old[#old + 1] = all[i]
      end
    end
  end
  local daily = BASE .. ':sd'
  for _, o in ipairs(order) do
    bump(daily, DAY_MS, KEEP_D, 3 * RETAIN, o[1] * DAY_MS, o[2], sums[o[3]], now)
  end
  if #old > 0 then
    redis.call('HDEL', key, unpack(old))
  end
  local until_ms = rollups_end(today)
  redis.call('HSET', key, 'f', int(cur))
  redis.call('PEXPIREAT', key, until_ms)
  if not last or from < today then
    -- The dictionary lives as long (a day without a fold keeps it too).
    redis.call('PEXPIREAT', daily, until_ms)
  end
end

-- Counts `delta` (a cost's change) of the event spent at `at` with `code`:
-- in the hour's bucket; the hours of a day fold into the day's bucket with
-- the first charge of a later day (`fold`), so a charge writes one bucket.
-- A change to a charge of a day folded already goes to the day's bucket
-- (and to its hour's, while kept).
local function rollup(at, code, delta, now)
  if not code or delta == 0 or not rolling() then
    return
  end
  local key = BASE .. ':su'
  local hour, cur = math.floor(at / HOUR_MS), math.floor(now / HOUR_MS)
  if math.floor(at / DAY_MS) < math.floor(now / DAY_MS) then
    -- A charge of a day before today: folded already?
    local last = tonumber(redis.call('HGET', key, 'f'))
    if last and math.floor(at / DAY_MS) < math.floor(last / 24) then
      bump(BASE .. ':sd', DAY_MS, KEEP_D, 3 * RETAIN, at, code, delta, now)
      if hour + math.max(math.floor(KEEP_H / HOUR_MS), 1) > cur then
        add_to(key, hour_digits(hour) .. ':' .. code, delta)
      end
      return
    end
  end
  local v = add_to(key, hour_digits(hour) .. ':' .. code, delta)
  if v <= 0 or v ~= delta then
    return
  end
  -- A new bucket: the first of a new hour?
  local last = tonumber(redis.call('HGET', key, 'f'))
  if not last or last < cur then
    fold(key, last, cur, now)
  end
end
