-- job_started.lua: a worker's job is about to call the provider: marks the
-- record `started`, if the worker still holds the lease. The worker sends it
-- together with its claim of the job's charge (claim.lua), not after it.
-- KEYS[1] job
-- ARGV[1] fencing token
-- ARGV[2] '0' to take the mark back instead (a claim sent with it failed, so
--         this run never called: a later run of the job did not run before);
--         absent or '1': mark
-- Returns 1 done, 0 when the lease is not this token's any more.
-- A started job whose lease is later lost (its worker died, maybe with the
-- call sent) may have made the upstream work: it keeps its charge whatever
-- its later runs come to (job_lease.lua; the worker's outcome policy).

local JOB, token = KEYS[1], ARGV[1]
if not holds_lease(JOB, token) then
  return 0
end
if ARGV[2] == '0' then
  redis.call('HDEL', JOB, 'started')
else
  redis.call('HSET', JOB, 'started', '1')
end
return 1
