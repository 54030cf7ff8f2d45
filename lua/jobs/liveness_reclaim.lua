-- liveness_reclaim.lua: give the ids a lapsed (or stopping) member popped back
-- to the head of the queue, in their order.
-- KEYS[1] members (see liveness_heartbeat.lua), KEYS[2] processing (of that
-- member), KEYS[3] queue, KEYS[4] lists (see liveness_heartbeat.lua)
-- ARGV[1] member id
-- ARGV[2] 1 to release even a live member (one stopping cleanly), else 0
-- ARGV[3] the queue's head: RIGHT for job queues (LPUSH, BLMOVE RIGHT LEFT),
--         LEFT for ticket queues (RPUSH, BLMOVE LEFT RIGHT)
-- ARGV[4] forget (ms): how long a lapsed member stays listed after its
--         liveness ended
-- A lapsed member is not forgotten at once: a pop of its may still be on its
-- way (a slow link, a paused process, one that dies right after), and land
-- after this call. It stays listed, its liveness entry left in the past, so
-- every heartbeat of another member finds it lapsed and its list reclaimed
-- again, until it has been lapsed for `forget`; then it leaves `members` and
-- `lists`. (Its own heartbeat, if it was only slow, makes it live again.) A
-- member without a liveness entry (the hash expired: every member was down
-- for 10 livenesses) is forgotten at once. A stopping member is lapsed from
-- now on, and forgotten the same way.
-- Returns the number of ids moved, or -1 when the member is live again (it was
-- only slow): nothing moved.

local MEMBERS, PROCESSING, QUEUE, LISTS = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local id, force, head, forget = ARGV[1], ARGV[2] == '1', ARGV[3], tonumber(ARGV[4])
if head ~= 'LEFT' and head ~= 'RIGHT' then
  return redis.error_reply('liveness_reclaim: bad head')
end
if not forget or forget < 0 then
  return redis.error_reply('liveness_reclaim: bad forget')
end
local newest = head == 'LEFT' and 'RIGHT' or 'LEFT'
local now = time_ms()
local live = tonumber(redis.call('HGET', MEMBERS, id))
if not force and live and live >= now then
  return -1
end
local n = 0
while redis.call('LMOVE', PROCESSING, QUEUE, newest, head) do
  n = n + 1
end
if force then
  redis.call('HSET', MEMBERS, id, string.format('%d', now - 1))
  redis.call('SADD', LISTS, id)
elseif not live or now - live > forget then
  redis.call('HDEL', MEMBERS, id)
  redis.call('SREM', LISTS, id)
end
return n
