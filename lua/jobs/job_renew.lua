-- job_renew.lua: a worker extends its lease on a running job.
-- KEYS[1] job, KEYS[2] leases
-- ARGV[1] id, ARGV[2] fencing token, ARGV[3] lease (ms)
-- Returns 1 renewed, 0 when the lease is not this token's any more.

local JOB, LEASES, id, token, lease = KEYS[1], KEYS[2], ARGV[1], ARGV[2], tonumber(ARGV[3])
if not lease or lease < 1 then
  return redis.error_reply('job_renew: bad lease')
end
if not holds_lease(JOB, token) then
  return 0
end
local until_ms = now_ms() + lease
redis.call('HSET', JOB, 'lease_until', int(until_ms))
redis.call('ZADD', LEASES, int(until_ms), id)
return 1
