-- job_defer.lua: a worker took a job it will not run now (its user holds its
-- share of the worker): put it back at the tail of the queue, so that the jobs
-- queued behind it are taken first.
-- KEYS[1] job, KEYS[2] processing (the worker's), KEYS[3] leases, KEYS[4] queue
-- ARGV[1] id, ARGV[2] fencing token
-- Taken, never started: the attempt is not counted, the lease ends, and the
-- job's charge is not touched (it stays held for the job, as before the take).
-- The queue's tail is its left (LPUSH in, BLMOVE RIGHT out), as a new job's.
-- Returns 1 deferred, 0 when not this token's lease (the entry is dropped
-- from the worker's processing list all the same).

local JOB, PROCESSING, LEASES, QUEUE, id, token = KEYS[1], KEYS[2], KEYS[3], KEYS[4], ARGV[1], ARGV[2]
if not id or id == '' or not token or not string.match(token, '^[1-9]%d*$') then
  return redis.error_reply('job_defer: bad id or fencing token')
end
local f = redis.call('HMGET', JOB, 'state', 'seq')
if f[1] ~= 'running' or f[2] ~= token then
  redis.call('LREM', PROCESSING, 1, id)
  return 0
end
redis.call('HSET', JOB, 'state', 'queued')
redis.call('HINCRBY', JOB, 'attempt', -1)
redis.call('HDEL', JOB, 'worker', 'lease_until')
redis.call('LREM', PROCESSING, 1, id)
redis.call('ZREM', LEASES, id)
redis.call('LPUSH', QUEUE, id)
return 1
