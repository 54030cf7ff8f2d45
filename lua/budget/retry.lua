-- retry.lua: goes on with the walk toward an exact retry_after that a denial
-- (reserve.lua, charge.lua) left unfinished when it ran out of its slice of
-- the log; reads at most a slice too (see `retry_walk` in budget/lib/events.lua).
-- Writes nothing.
-- KEYS[1] plan, KEYS[2] holds, KEYS[3] audit, KEYS[4] log, KEYS[5] meta,
-- KEYS[6] cancelled
--   (see budget/lib/state.lua)
-- ARGV[1] the denial's 'more <bound> <freed> <need>'
-- ARGV[2] the window (ms) of the limit it was for
-- ARGV[3] the denial's now_ms (the retry_after is counted from it)
-- Returns the retry_after (ms after ARGV[3]), or another 'more ...' to pass
-- to the next call.
-- ARGV[4] 'org' when the walk is over an organisation's log (KEYS its budget
--   keys): its records are '<request>/<user>'.
-- Errors: TOLLGATE_BAD_RETRY (arguments out of shape).

local bound, freed, need = string.match(ARGV[1], '^more (%(?%d+%-?%d*) (%d+) (%d+)$')
local window, now = tonumber(ARGV[2]), tonumber(ARGV[3])
if not bound or not window or not now or window < 1 then
  return redis.error_reply('TOLLGATE_BAD_RETRY expected more <bound> <freed> <need>, window, now')
end
if ARGV[4] == 'org' then
  SUBJECT = 'org'
end
local m = redis.call('HMGET', META, 'l', 's')
SIZE, SPLIT = tonumber(m[1]) or 1, tonumber(m[2]) or 0
return retry_walk(window, tonumber(need), tonumber(freed), bound, now)
