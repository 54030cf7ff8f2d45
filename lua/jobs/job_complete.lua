-- job_complete.lua: a worker records a job's result, if it still holds the lease.
-- KEYS[1] job, KEYS[2] processing (the worker's), KEYS[3] leases
-- ARGV[1] id, ARGV[2] fencing token, ARGV[3] result (JSON text)
-- ARGV[4] how long the finished record stays readable (ms), ARGV[5] channel
--   (jobs/lib/job.lua: publish_done), ARGV[6] the stored-bytes key prefix (the
--   user's name completes it), ARGV[7] the stored-bytes bucket width (ms),
-- ARGV[8] the upstream answer's head (JSON: status, safe headers; '' or
--   absent when a plain 200: no field)
-- ARGV[9] what the job's charge settled to (field `charged`), or '' (absent:
--   its reservation, `cost`, stands)
-- The record drops its input (jobs/lib/job.lua: finalize) and counts its
-- result against its user's stored bytes until it expires.
-- Returns 1 recorded (and published: jobs/lib/job.lua publish_done), 0 refused: the token is not the
-- current lease's (the lease expired and the job went to another worker, or it
-- ended): nothing is written.

local JOB, PROCESSING, LEASES = KEYS[1], KEYS[2], KEYS[3]
local id, token, result, ttl, channel = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4]), ARGV[5]
local prefix, width = ARGV[6] or '', tonumber(ARGV[7]) or 60000
local head, charged = ARGV[8] or '', ARGV[9] or ''
if not ttl or ttl < 1 or width < 1 then
  return redis.error_reply('job_complete: bad ttl or width')
end
-- One read of the whole record: the fencing check, then finalize's rewrite.
local all = redis.call('HGETALL', JOB)
local state, seq = nil, nil
for i = 1, #all, 2 do
  if all[i] == 'state' then
    state = all[i + 1]
  elseif all[i] == 'seq' then
    seq = all[i + 1]
  end
end
if not leased(state, seq, token) then
  -- Not this lease's any more: the worker is done with its entry all the same.
  redis.call('LREM', PROCESSING, 1, id)
  return 0
end
local now = now_ms()
local set = { 'state', 'succeeded', 'result', result, 'finished', int(now) }
if head ~= '' then
  set[#set + 1] = 'head'
  set[#set + 1] = head
end
if charged ~= '' then
  set[#set + 1] = 'charged'
  set[#set + 1] = charged
end
local _, fields, waiter = finalize(JOB, all, set, prefix, #result + #head, now + ttl, width)
redis.call('PEXPIRE', JOB, int(ttl))
redis.call('LREM', PROCESSING, 1, id)
redis.call('ZREM', LEASES, id)
publish_done(channel, JOB, id, fields, waiter, #result + #head)
return 1
