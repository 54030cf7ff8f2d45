-- jobs/lib/job.lua: shared by every job script: the prelude of the job function
-- library (tollgate-redis `scripts::JOBS`), each job_*.lua the body of one of
-- its functions, which starts with `begin(keys, args)`. This top level runs
-- once, when Redis loads the library, not on every call.
--
-- A job record is a hash on its queue's hash tag ({q:<operation>}):
--   state        queued | running | succeeded | failed
--   user, op, provider, input (JSON text), cost, enq (ms), deadline (ms),
--   attempt      the job's runs so far (the stored names `attempt`, `refund` and
--                the queue's `refunds` key predate the glossary: kept, so that
--                an upgrade finds the jobs in flight)
--   nonce        the charge that pays for the job (charge.lua): the worker claims
--                it before the provider call and releases it if the job fails
--   seq          the fencing token of the latest lease (incremented per lease)
--   worker, lease_until (ms)        while running
--   started      '1' once a run claimed the charge, about to call the provider
--                (job_started.lua): a later run's failure keeps the charge
--   result (JSON text) | cause, message; finished (ms)   once final
--   refund       '1' while a failed job's release is not confirmed
--   forget       '1': its keyless sync call was answered while the release was
--                pending; the record goes once the release is confirmed
--   sz, sb       the bytes the record counts against its user's stored bytes,
--                and the bucket of the user's stored-bytes hash they are in
-- A record gets a TTL only once it is final and owes no release. Once final it
-- keeps only what its status needs: the input, provider, trace, worker and
-- lease fields are dropped (the job can no longer run).
-- Time is Redis TIME.
--
-- Stored bytes: each user has, per queue, a hash `<stored prefix><user>`
-- (same hash tag as the queue): field = the end of a time bucket (ms), value =
-- the bytes of the user's records counted until then. A queued or running
-- job counts its input (plus RECORD_BYTES) until its deadline's bucket; once
-- final, its result or message (plus RECORD_BYTES) until its record's expiry's
-- bucket. A bucket past its end no longer counts and is deleted at the next
-- submit, so an expired record (whose expiry runs no script), or a record lost
-- any other way, stops counting by itself: nothing stays counted forever.

-- The calling function's KEYS and ARGV, set by `begin` at the start of each
-- call (a function gets them as arguments; the bodies read them as a script
-- reads its own).
local KEYS, ARGV

local function begin(keys, args)
  KEYS, ARGV = keys, args
end

-- Why a job whose run started, and whose worker was lost, failed at its take
-- (the same words as tollgate_core::job::LOST_MID_RUN).
local LOST_MID_RUN = 'a run of the job started and its worker was lost (the upstream may have '
  .. 'done the work): the charge stands, and the job is not run again'

local function int(n)
  return string.format('%d', n)
end

-- What a record counts besides its input or result: its key, fields and the
-- Redis overhead of a small hash (tollgate_core::job::RECORD_BYTES).
local RECORD_BYTES = 256

-- Takes `sz` bytes counted in bucket `sb` (as a record's fields hold them:
-- strings, or nil when it counts nothing) out of the user's hash `stored`.
local function stored_take(stored, sz, sb)
  sz = tonumber(sz)
  if sz and sb then
    if redis.call('HINCRBY', stored, sb, -sz) <= 0 then
      redis.call('HDEL', stored, sb)
    end
  end
end

-- Removes what `job` counts from its user's stored bytes (`stored`: that
-- user's hash), if its bucket still counts.
local function stored_drop(job, stored)
  local f = redis.call('HMGET', job, 'sz', 'sb')
  if f[1] and f[2] then
    stored_take(stored, f[1], f[2])
    redis.call('HDEL', job, 'sz', 'sb')
  end
end

-- Counts `bytes` in the user's hash `stored` until `until_ms`, rounded up to
-- a bucket of `width` ms; the hash lives as long as its last bucket. Returns
-- the bucket (the record's `sb`, as a string).
local function stored_count(stored, bytes, until_ms, width)
  local b = math.ceil(until_ms / width) * width
  -- A bucket that already counted something was counted until its end (the
  -- hash's expiry was checked when the bucket began): only a new one (its
  -- total is these bytes: a bucket at zero or below is deleted) may need a
  -- later expiry.
  if redis.call('HINCRBY', stored, int(b), bytes) == bytes
      and redis.call('PEXPIRETIME', stored) < b then
    redis.call('PEXPIREAT', stored, int(b))
  end
  return int(b)
end

-- The bytes `stored` counts at `now`; deletes the buckets that ended. Bounded:
-- the buckets span at most the longest deadline plus the result TTL.
local function stored_total(stored, now)
  local all = redis.call('HGETALL', stored)
  local total = 0
  for i = 1, #all, 2 do
    if (tonumber(all[i]) or 0) <= now then
      redis.call('HDEL', stored, all[i])
    else
      total = total + (tonumber(all[i + 1]) or 0)
    end
  end
  return total
end

-- A value longer than a listpack entry (hash-max-listpack-value, 64 B) makes
-- Redis store the whole hash as a hashtable, for good. A final record's long
-- values are stored as `<field>#1`, `<field>#2`, ... of at most CHUNK bytes,
-- cut between UTF-8 characters (tollgate-redis joins them when it reads).
-- A value over 60 pieces stays whole: its size outweighs the hash's layout.
local CHUNK = 64

local function chunks(v)
  local out, i, n = {}, 1, #v
  while i <= n do
    local j = math.min(i + CHUNK - 1, n)
    while j < n and j > i do
      local b = string.byte(v, j + 1)
      if b < 128 or b >= 192 then
        break
      end
      j = j - 1
    end
    out[#out + 1] = string.sub(v, i, j)
    i = j + 1
  end
  return out
end

-- The fields a final record no longer uses: the job can no longer run.
local RUN_ONLY = { input = true, provider = true, tp = true, worker = true,
  lease_until = true, started = true, sz = true, sb = true, w = true }

-- Makes `job` final in one read and one write: `set` = { name, value, ... }
-- (its state and outcome), `kept` bytes of result or message counted against
-- its user's stored bytes until `until_ms` (when `prefix` is set), the fields
-- it can no longer use dropped, and the record written again as a fresh hash
-- of short values (a small listpack: ~40% of the hashtable a long input or
-- result left). `all`: the record's HGETALL when the caller has just read it,
-- or nil. Its TTL is set by the caller after. Returns the record's user, its
-- fields as written, and the pod waiting for it (`w`: see publish_done).
local function finalize(job, all, set, prefix, kept, until_ms, width)
  all = all or redis.call('HGETALL', job)
  local old, setting = {}, {}
  for i = 1, #set, 2 do
    setting[set[i]] = true
  end
  local fields = {}
  local function put(name, v)
    if #v > CHUNK and #v <= CHUNK * 60 then
      for n, c in ipairs(chunks(v)) do
        fields[#fields + 1] = name .. '#' .. n
        fields[#fields + 1] = c
      end
    else
      fields[#fields + 1] = name
      fields[#fields + 1] = v
    end
  end
  for i = 1, #all, 2 do
    local name = all[i]
    old[name] = all[i + 1]
    if not RUN_ONLY[name] and not setting[name] then
      put(name, all[i + 1])
    end
  end
  for i = 1, #set, 2 do
    put(set[i], set[i + 1])
  end
  local user = old['user']
  if user and prefix ~= '' then
    local stored = prefix .. user
    stored_take(stored, old['sz'], old['sb'])
    local bytes = kept + RECORD_BYTES
    local b = stored_count(stored, bytes, until_ms, width)
    fields[#fields + 1] = 'sz'
    fields[#fields + 1] = int(bytes)
    fields[#fields + 1] = 'sb'
    fields[#fields + 1] = b
  elseif old['sz'] and old['sb'] then
    -- Nothing to move (no user or no accounting): what it counted stays noted.
    fields[#fields + 1] = 'sz'
    fields[#fields + 1] = old['sz']
    fields[#fields + 1] = 'sb'
    fields[#fields + 1] = old['sb']
  end
  redis.call('DEL', job)
  if #fields > 0 then
    redis.call('HSET', job, unpack(fields))
  end
  return user, fields, old['w']
end

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- Publishes `payload` on `channel`: SPUBLISH when the channel shares `key`'s
-- hash tag (a queue's own channels `{q:<operation>}:done...`, what a Redis
-- Cluster uses: sharded pub/sub, sent on the shard that owns the queue),
-- PUBLISH otherwise (a single Redis's channels).
local function hash_tag(name)
  local tag = string.match(name, '{([^}]*)}')
  if tag == '' then
    return nil
  end
  return tag
end

local function publish(channel, key, payload)
  local tag = hash_tag(channel)
  if tag and tag == hash_tag(key) then
    redis.call('SPUBLISH', channel, payload)
  else
    redis.call('PUBLISH', channel, payload)
  end
end

-- The most bytes of result and head a finished record may carry to its
-- waiting pod in the message itself; a larger one is read by the pod.
local PUSH_MAX = 16384

-- Tells who waits that job `id` (record `key`) is final. The pod that
-- submitted it (the record's `w`, set by job_enqueue.lua) gets the final
-- record itself, `fields` as finalize wrote them, on its own channel
-- `<channel>:<w>` as "<id>\n<JSON array of names and values>", when its
-- `kept` bytes of result and head are at most PUSH_MAX: its waiting call
-- answers without reading the record back. Every pod gets the id on
-- `channel`: a watcher elsewhere (the same Idempotency-Key on another pod)
-- reads the record. Pub/sub may drop either: a watcher also polls.
local function publish_done(channel, key, id, fields, waiter, kept)
  if waiter and waiter ~= '' and fields and kept <= PUSH_MAX then
    publish(channel .. ':' .. waiter, key, id .. '\n' .. cjson.encode(fields))
  end
  publish(channel, key, id)
end

-- Ends the job as failed and publishes its id on `channel`. With `release`, its
-- release is pending (listed in `releases`): the caller then releases the charge
-- and confirms. Without (the job never owned a charge), the record gets `ttl`.
-- `stored` = { prefix, width, result ttl } of the stored-bytes accounting.
local function fail_job(job, releases, id, cause, message, now, channel, release, ttl, stored)
  local set = { 'state', 'failed', 'cause', cause, 'message', message, 'finished', int(now) }
  if release then
    set[#set + 1] = 'refund'
    set[#set + 1] = '1'
  end
  local _, fields, waiter = finalize(job, nil, set, stored[1], #message,
    now + stored[3] + (release and stored[2] or 0), stored[2])
  if release then
    redis.call('ZADD', releases, int(now), id)
  else
    redis.call('PEXPIRE', job, int(ttl))
  end
  publish_done(channel, job, id, fields, waiter, #message)
end

-- Fencing: whether the lease of fencing token `token` still holds the job
-- (it runs under that token: no expiry, requeue or cancel took it since).
-- A worker whose lease does not hold writes nothing to the job.
local function leased(state, seq, token)
  return state == 'running' and seq == token
end

-- `leased`, reading the job's state and token from its record `job`.
local function holds_lease(job, token)
  local f = redis.call('HMGET', job, 'state', 'seq')
  return leased(f[1], f[2], token)
end
