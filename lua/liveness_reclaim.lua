-- liveness_reclaim.lua: give the ids a lapsed (or stopping) member popped back
-- to the head of the queue, in their order.
-- KEYS[1] members (see liveness_heartbeat.lua), KEYS[2] processing (of that
-- member), KEYS[3] queue, KEYS[4] lists (see liveness_heartbeat.lua)
-- ARGV[1] member id
-- ARGV[2] 1 to release even a live member (one stopping cleanly), else 0
-- ARGV[3] the queue's head: RIGHT for job queues (LPUSH, BLMOVE RIGHT LEFT),
--         LEFT for ticket queues (RPUSH, BLMOVE LEFT RIGHT)
-- A lapsed member leaves `lists`; a stopping one stays listed (its liveness is
-- gone, so it counts as lapsed): a BLMOVE of its that lands after this call is
-- reclaimed by the next heartbeat of another member.
-- Returns the number of ids moved, or -1 when the member is live again (it was
-- only slow): nothing moved.

local MEMBERS, PROCESSING, QUEUE, LISTS = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local id, force, head = ARGV[1], ARGV[2] == '1', ARGV[3]
if head ~= 'LEFT' and head ~= 'RIGHT' then
  return redis.error_reply('liveness_reclaim: bad head')
end
local newest = head == 'LEFT' and 'RIGHT' or 'LEFT'
local live = tonumber(redis.call('HGET', MEMBERS, id))
if not force and live then
  local t = redis.call('TIME')
  if live >= tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) then
    return -1
  end
end
local n = 0
while redis.call('LMOVE', PROCESSING, QUEUE, newest, head) do
  n = n + 1
end
redis.call('HDEL', MEMBERS, id)
if not force then
  redis.call('SREM', LISTS, id)
end
return n
