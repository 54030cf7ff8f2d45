-- job_hold.lua: step 1 of a submission: create the job record, held.
-- KEYS[1] job   the record (lib/job.lua)
-- KEYS[2] held  sorted set: job id -> end of its hold (ms)
-- ARGV[1] id, ARGV[2] user, ARGV[3] operation, ARGV[4] provider
-- ARGV[5] input (JSON text), ARGV[6] cost, ARGV[7] deadline after now (ms)
-- ARGV[8] hold (ms): past it, maintenance gives the submission up and refunds it
-- Returns { 1, enqueued_at_ms, deadline_ms } created, or { 0 } when a record with
-- this id exists already (the caller reads it: idempotent by id).

local JOB, HELD = KEYS[1], KEYS[2]
local id, user, op, provider, input = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local cost, deadline, hold = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
if not cost or cost < 1 or not deadline or deadline < 1 or not hold or hold < 1 then
  return redis.error_reply('job_hold: bad cost, deadline or hold')
end
if redis.call('EXISTS', JOB) == 1 then
  return { 0 }
end
local now = now_ms()
redis.call('HSET', JOB, 'state', 'held', 'user', user, 'op', op, 'provider', provider,
  'input', input, 'cost', int(cost), 'enq', int(now), 'deadline', int(now + deadline),
  'attempt', '0', 'seq', '0', 'hold_until', int(now + hold))
redis.call('ZADD', HELD, int(now + hold), id)
return { 1, now, now + deadline }
