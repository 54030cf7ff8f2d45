-- job_hand_back.lua: a worker puts back a job it took and will not run now:
-- at the head of the queue when it is stopping (the job is next), at the tail
-- when the job's user holds its share of the worker (a deferral: the jobs
-- queued behind it are taken first).
-- KEYS[1] job, KEYS[2] processing (the worker's), KEYS[3] leases, KEYS[4] queue
-- ARGV[1] id, ARGV[2] fencing token, ARGV[3] 'head' or 'tail'
-- The attempt is not counted, the lease ends, and the job's charge is not
-- touched. The queue's tail is its left (LPUSH in, BLMOVE RIGHT out), as a new
-- job's; its head its right.
-- Returns 1 put back, 0 when not this token's lease (the entry is dropped from
-- the worker's processing list all the same).

local JOB, PROCESSING, LEASES, QUEUE = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local id, token, side = ARGV[1], ARGV[2], ARGV[3]
if not id or id == '' or not token or not string.match(token, '^[1-9]%d*$')
  or (side ~= 'head' and side ~= 'tail') then
  return redis.error_reply('job_hand_back: bad id, fencing token or side')
end
if not holds_lease(JOB, token) then
  redis.call('LREM', PROCESSING, 1, id)
  return 0
end
redis.call('HSET', JOB, 'state', 'queued')
redis.call('HINCRBY', JOB, 'attempt', -1)
redis.call('HDEL', JOB, 'worker', 'lease_until')
redis.call('LREM', PROCESSING, 1, id)
redis.call('ZREM', LEASES, id)
if side == 'head' then
  redis.call('RPUSH', QUEUE, id)
else
  redis.call('LPUSH', QUEUE, id)
end
return 1
