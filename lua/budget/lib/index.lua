-- budget/lib/index.lua: the index buckets (linear hashing) and finding an event by request id
-- or log entry.
-- Part of the budget library's prelude (see budget/lib/state.lua).

-- The digest field of a request id and the 32-bit hash that picks its bucket.
local function digest(id)
  local h = redis.sha1hex(id)
  local top = hex(h, 1, 8)
  return struct.pack('>I4I2', top, hex(h, 9, 12)), top
end

local function bucket_key(h)
  local b = h % SIZE
  if b < SPLIT then
    b = h % (2 * SIZE)
  end
  return BASE .. ':e:' .. int(b)
end

-- The hash of a bucket's field (a digest, or LONG .. id).
local function field_hash(f)
  if #f == 6 then
    return (struct.unpack('>I4', f))
  end
  local _, h = digest(string.sub(f, #LONG + 1))
  return h
end

local function entry_id(ev)
  return int(ev.at) .. '-' .. int(ev.seq)
end

-- The record of a log entry ID.
local function read_record(sid)
  local e = redis.call('XRANGE', LOG, sid, sid)
  if #e == 0 then
    return nil
  end
  return unpack_record(e[1][2][2])
end

-- The live event of a request id: its index value plus key, field and record;
-- or nil, and where `record` puts it: { key = its bucket, field = the digest
-- (or LONG .. id when another entry holds the digest), kept = the bucket's
-- '~' }.
local function find(request)
  local dig, h = digest(request)
  local key = bucket_key(h)
  local long = LONG .. request
  local vals = redis.call('HMGET', key, dig, long, '~')
  for k, field in ipairs({ dig, long }) do
    if vals[k] then
      local ev = unpack_value(vals[k])
      ev.key, ev.field = key, field
      ev.rec = read_record(entry_id(ev))
      if ev.rec and ev.rec.id == request then
        return ev
      end
    end
  end
  return nil, { key = key, field = vals[1] and long or dig, kept = tonumber(vals[3]) or 0 }
end

-- The live event of a log entry (ID, packed record).
local function at_entry(sid, packed)
  local rec = unpack_record(packed)
  local dig, h = digest(rec.id)
  local key = bucket_key(h)
  local vals = redis.call('HMGET', key, dig, LONG .. rec.id)
  for k, field in ipairs({ dig, LONG .. rec.id }) do
    if vals[k] then
      local ev = unpack_value(vals[k])
      if entry_id(ev) == sid then
        ev.key, ev.field, ev.rec = key, field, rec
        return ev
      end
    end
  end
  return nil
end

-- Writes back an event's index value (state, cost or estimate changed).
local function update(ev)
  redis.call('HSET', ev.key, ev.field, pack_value(ev))
end

-- The slack added to a key's expiry when a write sets it: a key's expiry is
-- set again only when a write finds it less than the time to live the key
-- needs away, so once per slack at most.
local function slack()
  return math.floor(RETAIN / 8)
end

-- A bucket lives two windows from its last write, the log and meta one. An
-- entry of the log leaves at the first budget step past its window; if none came
-- within a window after that, no step wrote the log either, so the log and meta
-- are gone by then too. A bucket written once early in a window therefore still
-- holds its events' costs when they leave, though only other buckets were
-- written since; a bucket outliving its log holds entries no log entry
-- points to, which `find` and `at_entry` ignore.
-- A bucket's '~' field is the time (ms) its expiry was set to (written first
-- in a new bucket, where reading it costs least).
local function keep_bucket(key, now)
  local at = int(now + 2 * RETAIN + slack())
  redis.call('HSET', key, '~', at)
  redis.call('PEXPIREAT', key, at)
end

-- Splits the next bucket when the log holds more than LOAD events per bucket.
-- Returns the number of entries of the log.
local function grow(now)
  local n = redis.call('XLEN', LOG)
  if n <= LOAD * (SIZE + SPLIT) then
    return n
  end
  local from = BASE .. ':e:' .. int(SPLIT)
  local to = BASE .. ':e:' .. int(SPLIT + SIZE)
  local all = redis.call('HGETALL', from)
  local moved, gone = {}, {}
  for i = 1, #all, 2 do
    if all[i] ~= '~' and field_hash(all[i]) % (2 * SIZE) ~= SPLIT then
      moved[#moved + 1] = all[i]
      moved[#moved + 1] = all[i + 1]
      gone[#gone + 1] = all[i]
    end
  end
  if #gone > 0 then
    keep_bucket(to, now)
    redis.call('HSET', to, unpack(moved))
    redis.call('HDEL', from, unpack(gone))
  end
  SPLIT = SPLIT + 1
  if SPLIT == SIZE then
    SIZE, SPLIT = 2 * SIZE, 0
  end
  redis.call('HSET', META, 'l', int(SIZE), 's', int(SPLIT))
  return n
end
