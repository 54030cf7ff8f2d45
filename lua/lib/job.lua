-- lib/job.lua: shared by every job script; the `scripts` module prepends it to
-- job_*.lua before loading them.
--
-- A job record is a hash on its queue's hash tag ({q:<operation>}):
--   state        held | queued | running | succeeded | failed
--   user, op, provider, input (JSON text), cost, enq (ms), deadline (ms), attempt
--   seq          the fencing token of the latest lease (incremented per lease)
--   worker, lease_until (ms)        while running
--   hold_until (ms)                 while held (a submission in flight)
--   result (JSON text) | cause, message; finished (ms)   once final
--   refund       '1' while a failed job's refund is not confirmed
-- A record gets a TTL only once it is final and owes no refund.
-- Time is Redis TIME.

local function int(n)
  return string.format('%d', n)
end

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- Ends the job as failed with its refund pending (listed in `refunds`) and
-- publishes its id on `channel`: the caller then refunds and confirms.
local function fail_job(job, refunds, id, cause, message, now, channel)
  redis.call('HSET', job, 'state', 'failed', 'cause', cause, 'message', message,
    'finished', int(now), 'refund', '1')
  redis.call('HDEL', job, 'worker', 'lease_until', 'hold_until')
  redis.call('ZADD', refunds, int(now), id)
  redis.call('PUBLISH', channel, id)
end
