-- throttle_redate.lua: a waiter found its grant older than the provider's late
-- bound (a slow wake-up): it is re-dated to now, to be used as a grant made
-- now, when the bucket shows that moving its take from then to now keeps the
-- bucket's bound (throttle/lib/bucket.lua, `hi` and `rf`); else it stays late.
-- KEYS[1] granted  sorted set: ticket -> grant time (µs), the readiness record
-- KEYS[2] bucket   the token bucket (throttle/lib/bucket.lua)
-- ARGV[1] ticket
-- ARGV[2] the grant's time as its waiter heard it (µs)
-- ARGV[3] rate (tokens/s), ARGV[4] burst (the capacity the bucket grants from)
-- ARGV[5] the provider's other limits (throttle/lib/bucket.lua; "" for none):
--         a provider with any never re-dates (their buckets keep no `hi`)
-- ARGV[6] idle ttl in ms of the provider's keys (the record's key lives that long)
-- Returns { 1, now_us } re-dated: the readiness record says now (the grant is
-- one made now: re-dated again from now, or handed back by a cancel within
-- the late bound of now, as such a grant would be); { 0, now_us } not: the
-- record is not this grant's (re-dated already), the
-- provider has other limits, a pause began since the grant, the level may
-- have stood above its floor since it, or too many grants were re-dated since.

local GRANTED, BUCKET = KEYS[1], KEYS[2]
local ticket, g = ARGV[1], tonumber(ARGV[2])
local rate, burst = tonumber(ARGV[3]), tonumber(ARGV[4])
if not g or not rate or rate <= 0 or not burst or burst < 1 or not tonumber(ARGV[6]) then
  return redis.error_reply('throttle_redate: bad grant time, rate or burst')
end
local now = now_us()
-- A grant taken on the way in has no record until it is re-dated: none is
-- its first re-dating; a record must say g (a grant re-dated since says
-- later). A cancelled grant has no holder left to re-date it.
local recorded = tonumber(redis.call('ZSCORE', GRANTED, ticket))
if (recorded and recorded ~= g) or (ARGV[5] and ARGV[5] ~= '') then
  return { 0, now }
end
local tokens, at, _, hi = bucket_read(BUCKET, now, rate, burst)
local v = redis.call('HMGET', BUCKET, 'until', 'rf')
local paused_until = tonumber(v[1]) or 0
if at > now or paused_until > g or not hi or g < hi or tokens > redate_floor(burst) then
  return { 0, now }
end
-- The re-datings since g: at most `margin` (the list holds margin + 1).
local margin = redate_margin(burst)
local recent = {}
for t in string.gmatch(v[2] or '', '%d+') do
  recent[#recent + 1] = t
end
local since = 0
for _, t in ipairs(recent) do
  if tonumber(t) > g then
    since = since + 1
  end
end
if since > margin then
  return { 0, now }
end
table.insert(recent, 1, int(now))
while #recent > margin + 1 do
  table.remove(recent)
end
redis.call('ZADD', GRANTED, int(now), ticket)
redis.call('PEXPIRE', GRANTED, int(tonumber(ARGV[6])))
redis.call('HSET', BUCKET, 'rf', table.concat(recent, ' '))
return { 1, now }
