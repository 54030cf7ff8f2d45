-- liveness_heartbeat.lua: a role that pops ids into a processing list of its own
-- (a worker on an operation's job queue, a throttler on a provider's ticket
-- queue) renews its liveness there, and learns which others lapsed.
-- KEYS[1] members  hash: member id -> end of its liveness (ms, Redis TIME)
-- KEYS[2] lists    set: every member id that may have a processing list; it does
--                  not expire (the members hash does when every member is down),
--                  and an id leaves it only when its list was reclaimed after
--                  the member had been lapsed for a while (liveness_reclaim.lua)
-- ARGV[1] member id, ARGV[2] liveness (ms)
-- Returns the listed ids whose liveness ended or is gone: members that died
-- (kill -9, a lost network) and may have left ids in their processing list.

local MEMBERS, LISTS, me, liveness = KEYS[1], KEYS[2], ARGV[1], tonumber(ARGV[2])
if not liveness or liveness < 1 then
  return redis.error_reply('liveness_heartbeat: bad liveness')
end
local now = time_ms()
redis.call('HSET', MEMBERS, me, string.format('%d', now + liveness))
redis.call('PEXPIRE', MEMBERS, string.format('%d', liveness * 10))
redis.call('SADD', LISTS, me)
local lapsed = {}
for _, m in ipairs(redis.call('SMEMBERS', LISTS)) do
  local live = tonumber(redis.call('HGET', MEMBERS, m))
  if not live or live < now then
    lapsed[#lapsed + 1] = m
  end
end
return lapsed
