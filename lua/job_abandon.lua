-- job_abandon.lua: a held job's submission never completed: fail it, refund pending.
-- KEYS[1] job, KEYS[2] held, KEYS[3] refunds
-- ARGV[1] id, ARGV[2] channel
-- The refund is by request id, a no-op if the reservation never happened.
-- Returns { 1, user } given up, { 0 } when it is not held (or its hold is live).

local JOB, HELD, REFUNDS, id, channel = KEYS[1], KEYS[2], KEYS[3], ARGV[1], ARGV[2]
local f = redis.call('HMGET', JOB, 'state', 'hold_until', 'user')
if f[1] ~= 'held' then
  redis.call('ZREM', HELD, id)
  return { 0 }
end
local now = now_ms()
if (tonumber(f[2]) or 0) >= now then
  return { 0 }
end
redis.call('ZREM', HELD, id)
fail_job(JOB, REFUNDS, id, 'abandoned', 'the submission did not complete', now, channel)
return { 1, f[3] or '' }
