-- job_started.lua: a worker's job claimed its charge and is about to call the
-- provider: marks the record `started`, if the worker still holds the lease.
-- KEYS[1] job
-- ARGV[1] fencing token
-- Returns 1 marked, 0 when the lease is not this token's any more.
-- A started job whose lease is later lost (its worker died, maybe with the
-- call sent) may have made the upstream work: it keeps its charge whatever
-- its later runs come to (job_lease.lua; the worker's outcome policy).

local JOB, token = KEYS[1], ARGV[1]
local f = redis.call('HMGET', JOB, 'state', 'seq')
if f[1] ~= 'running' or f[2] ~= token then
  return 0
end
redis.call('HSET', JOB, 'started', '1')
return 1
