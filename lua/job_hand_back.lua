-- job_hand_back.lua: a worker stopping puts its job back at the head of the queue.
-- KEYS[1] job, KEYS[2] processing (the worker's), KEYS[3] leases, KEYS[4] queue
-- ARGV[1] id, ARGV[2] fencing token
-- The attempt is not counted. Returns 1 handed back, 0 when not this token's lease.

local JOB, PROCESSING, LEASES, QUEUE, id, token = KEYS[1], KEYS[2], KEYS[3], KEYS[4], ARGV[1], ARGV[2]
local f = redis.call('HMGET', JOB, 'state', 'seq')
if f[1] ~= 'running' or f[2] ~= token then
  -- Not this lease's any more: the worker is done with its entry all the same.
  redis.call('LREM', PROCESSING, 1, id)
  return 0
end
redis.call('HSET', JOB, 'state', 'queued')
redis.call('HINCRBY', JOB, 'attempt', -1)
redis.call('HDEL', JOB, 'worker', 'lease_until')
redis.call('LREM', PROCESSING, 1, id)
redis.call('ZREM', LEASES, id)
redis.call('RPUSH', QUEUE, id)
return 1
