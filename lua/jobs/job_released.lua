-- job_released.lua: a failed job's release is confirmed.
-- KEYS[1] job, KEYS[2] releases
-- ARGV[1] id, ARGV[2] how long the finished record stays readable (ms),
-- ARGV[3] the stored-bytes key prefix ('' or absent: none)
-- A record marked `forget` (job_forget.lua: its keyless sync call was answered
-- while the release was pending) is deleted now instead.
-- Returns 1 when a pending release was cleared, 0 when none was pending.

local JOB, RELEASES, id, ttl = KEYS[1], KEYS[2], ARGV[1], tonumber(ARGV[2])
local prefix = ARGV[3] or ''
if not ttl or ttl < 1 then
  return redis.error_reply('job_released: bad ttl')
end
redis.call('ZREM', RELEASES, id)
local f = redis.call('HMGET', JOB, 'refund', 'forget', 'user', 'sz', 'sb')
if f[1] ~= '1' then
  return 0
end
if f[2] == '1' then
  if prefix ~= '' and f[3] then
    stored_take(prefix .. f[3], f[4], f[5])
  end
  redis.call('DEL', JOB)
  return 1
end
redis.call('HDEL', JOB, 'refund')
redis.call('PEXPIRE', JOB, int(ttl))
return 1
