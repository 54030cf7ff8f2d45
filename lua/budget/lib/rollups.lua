-- budget/lib/rollups.lua: the spend rollups, what a user's charges came to per
-- hour and per day, by dimensions, kept in the same step as each change.
-- Part of the budget library's prelude (see budget/lib/state.lua).
--
-- Two hashes in the user's slot (a member's: its location's, like its log):
--   '<base>:sh'  hourly buckets: '<hour>:<code>' -> amount (hour: ms / 3600000)
--   '<base>:sd'  daily buckets: '<day>:<code>' -> amount (day: ms / 86400000,
--                UTC days), and the dimensions' dictionary: 'c<code>' ->
--                '<org>\t<operation>\t<provider>\t<model>' (as the caller
--                passes them), '=<dims>' -> code, 'n' the last code given.
--   Each: '^' the latest bucket number written.
-- A charge adds its cost to the buckets of the hour and the day it was spent
-- in; its event keeps the code (`pack_value`: '#<code>', 2-4 bytes), so a
-- settle, a refund or a release (an operator's correction, a hold's end)
-- changes the same two buckets, whenever it comes: a bucket is exact against
-- the charges made in it, as they stand. An event leaving the log's
-- retention stays counted (it was spent). A bucket that comes to 0 is
-- dropped; buckets older than their keep (ARGV, see `resolve_plan`) are
-- dropped when a bucket of a new hour (day) is made, and each key expires a
-- keep after its latest bucket (the daily one no sooner than the retention
-- after it: its dictionary names the live events' codes). Only the user's
-- own steps count (not its organisation's copies, not a move's steps).

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

-- The code of this call's dimensions in the dictionary (given when new).
local function dims_code()
  if not rolling() then
    return nil
  end
  if LAST_DIMS then
    local c, d = string.match(LAST_DIMS, '^(%d+)|(.*)$')
    if d == DIMS then
      return tonumber(c)
    end
  end
  local key = BASE .. ':sd'
  local code = tonumber(redis.call('HGET', key, '=' .. DIMS))
  if not code then
    code = redis.call('HINCRBY', key, 'n', 1)
    redis.call('HSET', key, '=' .. DIMS, code, 'c' .. int(code), DIMS)
  end
  NEW_DIMS = int(code) .. '|' .. DIMS
  return code
end

-- Adds `delta` to the bucket of `at` in one rollup (`size`: its step, `keep`
-- how long it keeps buckets, `hold`: the least its key lives past its
-- latest bucket).
local function bump(key, size, keep, hold, at, code, delta, now)
  local n, cur = math.floor(at / size), math.floor(now / size)
  local kept = math.max(math.floor(keep / size), 1)
  if n + kept <= cur then
    return -- dropped already: nothing current to change
  end
  local field = int(n) .. ':' .. int(code)
  local v = redis.call('HINCRBY', key, field, delta)
  if v <= 0 then
    redis.call('HDEL', key, field)
    return
  end
  if v ~= delta then
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

-- Counts `delta` (a cost's change) of the event spent at `at` with `code`
-- in the hour's and the day's buckets.
local function rollup(at, code, delta, now)
  if not code or delta == 0 or not rolling() then
    return
  end
  bump(BASE .. ':sh', HOUR_MS, KEEP_H, 0, at, code, delta, now)
  -- The dictionary outlives meta's 'k' (meta lives at most 1.125 retentions
  -- past a write; a day's key 3 past the day, renewed each new day).
  bump(BASE .. ':sd', DAY_MS, KEEP_D, 3 * RETAIN, at, code, delta, now)
end
