-- job_forget.lua: a sync call answered its caller in full without an
-- Idempotency-Key: nobody can ask for the job again, so its record goes now
-- rather than at the end of the result TTL.
-- KEYS[1] job
-- ARGV[1] user, ARGV[2] the stored-bytes key prefix, ARGV[3] the nonce of the
--   answered attempt (only that attempt's record, of that user, goes)
-- A final record that owes no release goes now. One whose release is still
-- pending (a failure answered before its worker confirmed the release) needs
-- the record until then: it is marked `forget`, and job_released.lua deletes
-- it once the release is confirmed.
-- Returns 1 deleted, 2 marked (deleted at its release), 0 left alone.

local JOB, user, prefix, nonce = KEYS[1], ARGV[1], ARGV[2] or '', ARGV[3]
local f = redis.call('HMGET', JOB, 'state', 'user', 'refund', 'nonce', 'sz', 'sb')
if f[2] ~= user or f[4] ~= nonce or (f[1] ~= 'succeeded' and f[1] ~= 'failed') then
  return 0
end
if f[3] == '1' then
  redis.call('HSET', JOB, 'forget', '1')
  return 2
end
if prefix ~= '' then
  stored_take(prefix .. user, f[5], f[6])
end
redis.call('DEL', JOB)
return 1
