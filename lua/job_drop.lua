-- job_drop.lua: a submission was denied (or failed): delete its held job.
-- KEYS[1] job, KEYS[2] held
-- ARGV[1] id
-- Returns 1 dropped, 0 when the job is not held (maintenance gave it up already).

local JOB, HELD, id = KEYS[1], KEYS[2], ARGV[1]
if redis.call('HGET', JOB, 'state') ~= 'held' then
  return 0
end
redis.call('DEL', JOB)
redis.call('ZREM', HELD, id)
return 1
