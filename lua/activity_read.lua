-- activity_read.lua: the operations dashboard's read of the activity log (see
-- activity_record.lua for the keys). Reads only.
-- KEYS[1] events, KEYS[2] refunded, KEYS[3] grants, KEYS[4..] waits (one per provider)
-- ARGV[1] most events to return (the newest)
-- Returns { now_ms, events, every refund mark, grants (a flat hash), the waits of KEYS[4], ... }.

local limit = tonumber(ARGV[1])
if not limit or limit < 1 then
  return redis.error_reply('activity_read: bad limit')
end
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local events = redis.call('LRANGE', KEYS[1], 0, limit - 1)
local out = { now_ms, events, redis.call('ZRANGE', KEYS[2], 0, -1), redis.call('HGETALL', KEYS[3]) }
for i = 4, #KEYS do
  out[#out + 1] = redis.call('LRANGE', KEYS[i], 0, -1)
end
return out
