-- job_requeue.lua: a running job's lease expired: put it back at the head of the queue.
-- KEYS[1] job, KEYS[2] leases, KEYS[3] queue, KEYS[4] processing (of the job's worker)
-- ARGV[1] id
-- The next lease counts the attempt and gives the job up past max attempts.
-- Returns 1 requeued, 0 when its lease is live again or it is not running.

local JOB, LEASES, QUEUE, PROCESSING, id = KEYS[1], KEYS[2], KEYS[3], KEYS[4], ARGV[1]
local f = redis.call('HMGET', JOB, 'state', 'lease_until')
if f[1] ~= 'running' then
  redis.call('ZREM', LEASES, id)
  return 0
end
if (tonumber(f[2]) or 0) >= now_ms() then
  return 0
end
redis.call('HSET', JOB, 'state', 'queued')
redis.call('HDEL', JOB, 'worker', 'lease_until')
redis.call('ZREM', LEASES, id)
redis.call('LREM', PROCESSING, 1, id)
redis.call('RPUSH', QUEUE, id)
return 1
