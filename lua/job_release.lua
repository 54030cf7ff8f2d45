-- job_release.lua: step 3 of a submission: the budget is reserved, queue the job.
-- KEYS[1] job, KEYS[2] held, KEYS[3] queue
-- ARGV[1] id
-- Returns 1 queued, 0 when the job is not held any more (maintenance gave it up:
-- the caller refunds the reservation it just made).

local JOB, HELD, QUEUE, id = KEYS[1], KEYS[2], KEYS[3], ARGV[1]
if redis.call('HGET', JOB, 'state') ~= 'held' then
  return 0
end
redis.call('HSET', JOB, 'state', 'queued')
redis.call('HDEL', JOB, 'hold_until')
redis.call('ZREM', HELD, id)
redis.call('LPUSH', QUEUE, id)
return 1
