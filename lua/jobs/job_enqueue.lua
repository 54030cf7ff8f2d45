-- job_enqueue.lua: the second step of a submission: the job's charge is taken
-- (charge.lua, on the user's keys); create its job, queued, unless it exists.
-- KEYS[1] job     the record (jobs/lib/job.lua)
-- KEYS[2] queue   list of queued ids
-- KEYS[3] leases, KEYS[4] releases   (cleared of the id when an old attempt is replaced)
-- ARGV[1] id, ARGV[2] user, ARGV[3] operation, ARGV[4] provider
-- ARGV[5] input (JSON text), ARGV[6] cost, ARGV[7] enqueued at (ms), ARGV[8] deadline (ms)
-- ARGV[9] nonce of the charge that pays for the job
-- ARGV[10] '1' to create a missing job (its charge is not claimed yet), '0' to
--          only find it (its charge was claimed: the job ran, and is not run again)
-- ARGV[11] the W3C traceparent of the call that submitted it, or ''  (field `tp`)
-- ARGV[12] the stored-bytes key prefix (the user's name completes it; same
--          hash tag), ARGV[13] its bucket width (ms), ARGV[14] the most bytes
--          the user may have stored in this queue (0: no bound)
-- ARGV[15] the submitting pod (field `w`: its final record is sent to that
--          pod's channel, jobs/lib/job.lua publish_done), or '' (absent: none)
-- ARGV[16] the prices a priced call was reserved at (field `pr`), or ''
-- Returns one of
--   { 1 }           created and queued
--   { -2, stored, limit }  not created: the user's stored bytes (`stored`,
--                   counted now) and this job's would pass the bound
--   { 2, record }   the job of this charge exists already: its fields (HGETALL)
--   { 0 }           not found, and not created
--   { -1 }          the id is another user's job
-- A record of the same user under another nonce is an earlier attempt whose
-- charge is gone (released after it failed, or left the window): the new charge
-- replaces it with a fresh job. Its fencing token (`seq`) carries on, so a
-- worker still holding the old attempt's lease can record nothing.

local JOB, QUEUE, LEASES, RELEASES = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local id, user, op, provider, input = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local cost, enq, deadline = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
local nonce, create, tp = ARGV[9], ARGV[10], ARGV[11] or ''
local prefix, width, limit = ARGV[12] or '', tonumber(ARGV[13]) or 60000, tonumber(ARGV[14]) or 0
local waiter, price = ARGV[15] or '', ARGV[16] or ''
if not cost or cost < 1 or not enq or not deadline or nonce == '' or width < 1 or limit < 0 then
  return redis.error_reply('job_enqueue: bad cost, times, nonce, width or limit')
end
local f = redis.call('HMGET', JOB, 'user', 'nonce', 'seq', 'state')
if f[1] then
  if f[1] ~= user then
    return { -1 }
  end
  if f[2] == nonce then
    return { 2, redis.call('HGETALL', JOB) }
  end
end
if create ~= '1' then
  return { 0 }
end
-- An earlier attempt (or whatever is left of a record) is replaced; a fresh
-- id (the common case) has nothing to clear.
local earlier = f[1] or f[2] or f[3] or f[4]
local stored = prefix .. user
local bytes = #input + RECORD_BYTES
if prefix ~= '' then
  if earlier then
    -- An earlier attempt's record is replaced: it no longer counts.
    stored_drop(JOB, stored)
  end
  if limit > 0 then
    local total = stored_total(stored, now_ms())
    if total + bytes > limit then
      return { -2, total, limit }
    end
  end
end
-- A fresh record; only the fencing token carries on from an earlier attempt.
if earlier then
  redis.call('DEL', JOB)
  redis.call('ZREM', LEASES, id)
  redis.call('ZREM', RELEASES, id)
end
local fields = { 'state', 'queued', 'user', user, 'op', op, 'provider', provider,
  'input', input, 'cost', int(cost), 'enq', int(enq), 'deadline', int(deadline),
  'attempt', '0', 'nonce', nonce, 'seq', f[3] or '0' }
if tp ~= '' then
  fields[#fields + 1] = 'tp'
  fields[#fields + 1] = tp
end
if waiter ~= '' then
  fields[#fields + 1] = 'w'
  fields[#fields + 1] = waiter
end
if price ~= '' then
  fields[#fields + 1] = 'pr'
  fields[#fields + 1] = price
end
if prefix ~= '' then
  -- Until the deadline's next bucket: a job not final by then stops counting.
  fields[#fields + 1] = 'sz'
  fields[#fields + 1] = int(bytes)
  fields[#fields + 1] = 'sb'
  fields[#fields + 1] = stored_count(stored, bytes, deadline + width, width)
end
redis.call('HSET', JOB, unpack(fields))
redis.call('LPUSH', QUEUE, id)
return { 1 }
