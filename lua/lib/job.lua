-- lib/job.lua: shared by every job script; the `scripts` module prepends it to
-- job_*.lua before loading them.
--
-- A job record is a hash on its queue's hash tag ({q:<operation>}):
--   state        queued | running | succeeded | failed
--   user, op, provider, input (JSON text), cost, enq (ms), deadline (ms), attempt
--   nonce        the charge that pays for the job (charge.lua): the worker claims
--                it before the provider call and releases it if the job fails
--   seq          the fencing token of the latest lease (incremented per lease)
--   worker, lease_until (ms)        while running
--   started      '1' once a run claimed the charge, about to call the provider
--                (job_started.lua): a later run's failure keeps the charge
--   result (JSON text) | cause, message; finished (ms)   once final
--   refund       '1' while a failed job's release is not confirmed
-- A record gets a TTL only once it is final and owes no refund.
-- Time is Redis TIME.

-- Why a job whose run started, and whose worker was lost, failed at its take
-- (the same words as tollgate_core::job::LOST_MID_RUN).
local LOST_MID_RUN = 'a run of the job started and its worker was lost (the upstream may have '
  .. 'done the work): the charge stands, and the job is not run again'

local function int(n)
  return string.format('%d', n)
end

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- Publishes a finished job's id on `channel`: SPUBLISH when the channel
-- shares `key`'s hash tag (a queue's own channel `{q:<operation>}:done`, what
-- a Redis Cluster uses: sharded pub/sub, sent on the shard that owns the
-- queue), PUBLISH otherwise (a single Redis's one channel).
local function hash_tag(name)
  local tag = string.match(name, '{([^}]*)}')
  if tag == '' then
    return nil
  end
  return tag
end

local function publish_done(channel, key, id)
  local tag = hash_tag(channel)
  if tag and tag == hash_tag(key) then
    redis.call('SPUBLISH', channel, id)
  else
    redis.call('PUBLISH', channel, id)
  end
end

-- Ends the job as failed and publishes its id on `channel`. With `refund`, its
-- release is pending (listed in `refunds`): the caller then releases the charge
-- and confirms. Without (the job never owned a charge), the record gets `ttl`.
local function fail_job(job, refunds, id, cause, message, now, channel, refund, ttl)
  redis.call('HSET', job, 'state', 'failed', 'cause', cause, 'message', message,
    'finished', int(now))
  redis.call('HDEL', job, 'worker', 'lease_until')
  if refund then
    redis.call('HSET', job, 'refund', '1')
    redis.call('ZADD', refunds, int(now), id)
  else
    redis.call('PEXPIRE', job, int(ttl))
  end
  publish_done(channel, job, id)
end
