-- throttle_reclaim.lua: give the tickets of a dead (or stopping) throttler back.
-- KEYS[1] throttlers  hash: throttler id -> end of its lease (µs)
-- KEYS[2] processing  the processing list of that throttler
-- KEYS[3] queue
-- ARGV[1] throttler id
-- ARGV[2] 1 to release even a live lease (a throttler stopping cleanly), else 0
-- Returns the number of tickets moved to the head of the queue (in their order),
-- or -1 when the lease is live again (the throttler was only slow): nothing moved.

local THROTTLERS, PROCESSING, QUEUE = KEYS[1], KEYS[2], KEYS[3]
local id, force = ARGV[1], ARGV[2] == '1'
local lease = tonumber(redis.call('HGET', THROTTLERS, id))
if not force and lease and lease >= now_us() then
  return -1
end
local n = 0
while redis.call('LMOVE', PROCESSING, QUEUE, 'RIGHT', 'LEFT') do
  n = n + 1
end
redis.call('HDEL', THROTTLERS, id)
return n
