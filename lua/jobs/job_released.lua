-- job_released.lua: a failed job's release is confirmed.
-- KEYS[1] job, KEYS[2] releases
-- ARGV[1] id, ARGV[2] how long the finished record stays readable (ms)
-- Returns 1 when a pending release was cleared, 0 when none was pending.

local JOB, RELEASES, id, ttl = KEYS[1], KEYS[2], ARGV[1], tonumber(ARGV[2])
if not ttl or ttl < 1 then
  return redis.error_reply('job_released: bad ttl')
end
redis.call('ZREM', RELEASES, id)
if redis.call('HGET', JOB, 'refund') ~= '1' then
  return 0
end
redis.call('HDEL', JOB, 'refund')
redis.call('PEXPIRE', JOB, int(ttl))
return 1
