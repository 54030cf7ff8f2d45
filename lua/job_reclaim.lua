-- job_reclaim.lua: give the ids a dead (or stopping) worker moved back to the queue.
-- KEYS[1] workers, KEYS[2] processing (of that worker), KEYS[3] queue
-- KEYS[4] lists (see job_heartbeat.lua): a dead worker leaves it; a stopping one
--         stays listed (its liveness is gone, so it counts as dead): a BLMOVE of
--         its that lands after this call is reclaimed by the next maintenance
-- ARGV[1] worker id, ARGV[2] 1 to release even a live worker (one stopping), else 0
-- Ids of jobs it was running stay leased until their lease expires: the lease
-- script drops a queue entry whose job is not queued, so moving them is harmless.
-- Returns the number of ids moved to the head of the queue, or -1 when the
-- worker is live again (only slow): nothing moved.

local WORKERS, PROCESSING, QUEUE, LISTS = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local id, force = ARGV[1], ARGV[2] == '1'
local live = tonumber(redis.call('HGET', WORKERS, id))
if not force and live and live >= now_ms() then
  return -1
end
local n = 0
while redis.call('LMOVE', PROCESSING, QUEUE, 'LEFT', 'RIGHT') do
  n = n + 1
end
redis.call('HDEL', WORKERS, id)
if not force then
  redis.call('SREM', LISTS, id)
end
return n
