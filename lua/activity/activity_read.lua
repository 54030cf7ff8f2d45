-- activity_read.lua: the operations dashboard's read of the activity log (see
-- activity_record.lua for the keys). Reads only.
-- KEYS[1] events, KEYS[2] refunded, KEYS[3] grants, KEYS[4] answers,
-- KEYS[5] denials, KEYS[6] denied, KEYS[7..] waits (one per provider)
-- ARGV[1] most events to return (the newest), ARGV[2] most denials to return
-- Returns { now_ms, events, every refund mark, grants (a flat hash),
--   answers (a flat hash), denials (a flat hash), the newest denials,
--   the waits of KEYS[7], ... }.

local limit, denied = tonumber(ARGV[1]), tonumber(ARGV[2])
if not limit or limit < 1 or not denied or denied < 1 then
  return redis.error_reply('activity_read: bad limit')
end
local now_ms = time_ms()
local events = redis.call('LRANGE', KEYS[1], 0, limit - 1)
local out = { now_ms, events, redis.call('ZRANGE', KEYS[2], 0, -1), redis.call('HGETALL', KEYS[3]),
  redis.call('HGETALL', KEYS[4]), redis.call('HGETALL', KEYS[5]), redis.call('LRANGE', KEYS[6], 0, denied - 1) }
for i = 7, #KEYS do
  out[#out + 1] = redis.call('LRANGE', KEYS[i], 0, -1)
end
return out
