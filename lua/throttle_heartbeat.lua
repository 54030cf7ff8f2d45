-- throttle_heartbeat.lua: a throttler renews its lease on one provider.
-- KEYS[1] throttlers  hash: throttler id -> end of its lease (µs, Redis TIME)
-- ARGV[1] throttler id, ARGV[2] lease in µs
-- Returns the ids whose lease has ended: throttlers that died (kill -9, lost
-- network) and may have left a ticket in their processing list.

local THROTTLERS, me, lease = KEYS[1], ARGV[1], tonumber(ARGV[2])
if not lease or lease < 1 then
  return redis.error_reply('throttle_heartbeat: bad lease')
end
local now = now_us()
redis.call('HSET', THROTTLERS, me, int(now + lease))
redis.call('PEXPIRE', THROTTLERS, int(math.ceil(lease / 1000) * 10))
local dead = {}
local all = redis.call('HGETALL', THROTTLERS)
for i = 1, #all, 2 do
  if tonumber(all[i + 1]) < now then
    dead[#dead + 1] = all[i]
  end
end
return dead
