-- job_lease.lua: a worker moved a job id into its processing list (BLMOVE): lease it.
-- KEYS[1] job, KEYS[2] processing (this worker's), KEYS[3] leases, KEYS[4] releases
-- KEYS[5] dead  list of malformed entries moved aside (the newest 10,000 are kept)
-- ARGV[1] id, ARGV[2] worker, ARGV[3] lease (ms), ARGV[4] max attempts
-- ARGV[5] the queue's operation, ARGV[6] channel for finished job ids
-- ARGV[7] how long a finished record that owes no release stays readable (ms)
-- ARGV[8] the stored-bytes key prefix, ARGV[9] its bucket width (ms)
-- Validates the record first: a missing record or unreadable fields (another
-- operation, a missing one) move the entry to `dead`; a record with a user is
-- also failed with its release pending. The input is not parsed here: decoding
-- a large one held Redis (~18 ms for 1 MB); the worker parses it and fails an
-- unreadable one, released. Then counts the attempt: past the
-- deadline, or past max attempts, the job fails (release pending); when a run
-- had started (`started`: its worker was lost, maybe with the call sent), it
-- fails 'unanswered' instead and its charge stands.
-- A lease's fields end with 'started' ('1' or ''): an earlier run started.
-- Returns one of
--   { 1, token, left, field, value, ... }
--                            leased; `left`: ms until the deadline, on Redis's
--                            clock; then the job's fields as the record names them
--   { 0 }                    stale entry (the job is not queued): dropped
--   { 2, cause, user, nonce }          failed here (expired | abandoned: release
--                                      pending; unanswered: the charge stands)
--   { 3, reason, user|'', nonce|'' }   malformed: moved aside (release pending if a nonce)

local JOB, PROCESSING, LEASES, RELEASES, DEAD = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local id, worker, lease, max_runs = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local op, channel, ttl = ARGV[5], ARGV[6], tonumber(ARGV[7])
if not lease or lease < 1 or not max_runs or max_runs < 1 then
  return redis.error_reply('job_lease: bad lease or max runs')
end
local stored = { ARGV[8] or '', tonumber(ARGV[9]) or 60000, ttl }
if not ttl or ttl < 1 or stored[2] < 1 then
  return redis.error_reply('job_lease: bad ttl or width')
end
local now = now_ms()
local f = redis.call('HMGET', JOB, 'state', 'user', 'op', 'provider', 'input', 'cost',
  'enq', 'deadline', 'attempt', 'nonce', 'tp', 'started', 'seq', 'pr')
local state, user, jop, provider, input = f[1], f[2], f[3], f[4], f[5]
local cost, enq, deadline, attempt = tonumber(f[6]), tonumber(f[7]), tonumber(f[8]), tonumber(f[9])
local nonce = f[10]

local reason = nil
if not state then
  reason = 'no job record'
elseif state ~= 'queued' and state ~= 'running'
    and state ~= 'succeeded' and state ~= 'failed' then
  reason = 'unknown state ' .. state
elseif state ~= 'queued' then
  redis.call('LREM', PROCESSING, 1, id)
  return { 0 }
elseif not user or not provider or not input or not cost or cost < 1 or not enq
    or not deadline or not attempt or not nonce then
  reason = 'missing or unreadable fields'
elseif jop ~= op then
  reason = 'operation ' .. tostring(jop) .. ' does not belong to queue ' .. op
end
if reason then
  redis.call('LREM', PROCESSING, 1, id)
  redis.call('RPUSH', DEAD, id .. ' ' .. reason)
  redis.call('LTRIM', DEAD, -10000, -1)
  if state and state ~= 'succeeded' and state ~= 'failed' then
    fail_job(JOB, RELEASES, id, 'abandoned', 'malformed job: ' .. reason, now, channel, nonce and true or false, 1, stored)
  end
  return { 3, reason, user or '', nonce or '' }
end

attempt = attempt + 1
local started = f[12] == '1'
local cause, message, release, fail_ttl = nil, nil, true, 1
if started and (now >= deadline or attempt > max_runs) then
  -- A run started and its worker was lost, maybe with the call sent: the
  -- upstream may have done the work, so the charge stands (job::given_up).
  cause, message, release, fail_ttl = 'unanswered', LOST_MID_RUN, false, ttl
elseif now >= deadline then
  cause, message = 'expired', 'the job passed its deadline before it ran'
elseif attempt > max_runs then
  cause, message = 'abandoned', 'the job used up its ' .. int(max_runs) .. ' runs'
end
if cause then
  redis.call('HSET', JOB, 'attempt', attempt)
  fail_job(JOB, RELEASES, id, cause, message, now, channel, release, fail_ttl, stored)
  redis.call('LREM', PROCESSING, 1, id)
  return { 2, cause, user, nonce }
end
-- The attempt and the fencing token counted in the same write.
local token = (tonumber(f[13]) or 0) + 1
redis.call('HSET', JOB, 'attempt', attempt, 'seq', token, 'state', 'running', 'worker', worker,
  'lease_until', int(now + lease))
redis.call('ZADD', LEASES, int(now + lease), id)
local reply = { 1, token, deadline - now, 'user', user, 'op', jop, 'provider', provider,
  'input', input, 'cost', int(cost), 'enq', int(enq), 'deadline', int(deadline),
  'attempt', attempt, 'nonce', nonce, 'tp', f[11] or '', 'started', f[12] or '' }
if f[14] then
  reply[#reply + 1] = 'pr'
  reply[#reply + 1] = f[14]
end
return reply
