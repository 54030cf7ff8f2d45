-- job_fail.lua: a worker records a job's final failure, if it still holds the lease.
-- KEYS[1] job, KEYS[2] processing (the worker's), KEYS[3] leases, KEYS[4] releases
-- ARGV[1] id, ARGV[2] fencing token, ARGV[3] cause, ARGV[4] message, ARGV[5] channel
-- ARGV[6] '1': the job's charge is released; marks the release pending, and the
--         worker then releases it and confirms with job_released.lua
--         (maintenance finishes releases left pending). '0': nothing to release:
--         the job's claim was refused (it owns no charge), or the outcome policy
--         keeps the charge (the upstream may have done the work).
-- ARGV[7] how long the finished record stays readable (ms), without a release
-- ARGV[8] the stored-bytes key prefix, ARGV[9] its bucket width (ms)
--   (jobs/lib/job.lua: the record drops its input, counts its message)
-- Returns 1 recorded, 0 refused (not this token's lease): nothing is written,
-- and the caller must not release.

local JOB, PROCESSING, LEASES, RELEASES = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local id, token, cause, message, channel = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local release, ttl = ARGV[6] == '1', tonumber(ARGV[7])
local stored = { ARGV[8] or '', tonumber(ARGV[9]) or 60000, ttl }
if not ttl or ttl < 1 or stored[2] < 1 then
  return redis.error_reply('job_fail: bad ttl or width')
end
if cause ~= 'provider' and cause ~= 'unanswered' and cause ~= 'bad_response'
    and cause ~= 'throttle_timeout' and cause ~= 'expired' and cause ~= 'abandoned'
    and cause ~= 'cancelled' and cause ~= 'rejected' then
  return redis.error_reply('job_fail: bad cause')
end
if not holds_lease(JOB, token) then
  -- Not this lease's any more: the worker is done with its entry all the same.
  redis.call('LREM', PROCESSING, 1, id)
  return 0
end
fail_job(JOB, RELEASES, id, cause, message, now_ms(), channel, release, ttl, stored)
redis.call('LREM', PROCESSING, 1, id)
redis.call('ZREM', LEASES, id)
return 1
