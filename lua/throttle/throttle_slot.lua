-- throttle_slot.lua: the holder of a slot of a provider's max_concurrent
-- (taken with its grant: throttle/lib/bucket.lua) renews it while its call runs, or
-- ends it when the call ended (or was never sent).
-- KEYS[1] inflight  sorted set: ticket -> end of its slot's lease (µs)
-- KEYS[2] queue     list: a bell wakes a throttler when a slot ends
-- ARGV[1] ticket
-- ARGV[2] the lease from now, µs, to renew; 0 to end the slot
-- Returns 1 when the slot was held (renewed, or ended), 0 when it was not:
-- its lease had ended (the holder was paused past it; its slot may have been
-- granted again) or it had ended already. Ending twice is harmless.

local ticket, lease = ARGV[1], tonumber(ARGV[2])
if not lease or lease < 0 then
  return redis.error_reply('throttle_slot: bad lease')
end
local now = now_us()
local ends = tonumber(redis.call('ZSCORE', KEYS[1], ticket))
if not ends then
  return 0
end
if lease == 0 or ends < now then
  redis.call('ZREM', KEYS[1], ticket)
  ring(KEYS[2])
  return ends < now and 0 or 1
end
redis.call('ZADD', KEYS[1], int(now + lease), ticket)
redis.call('PEXPIRE', KEYS[1], int(lease / 1000 + 1000))
return 1
