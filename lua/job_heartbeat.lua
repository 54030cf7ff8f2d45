-- job_heartbeat.lua: a worker renews its liveness on one operation's queue.
-- KEYS[1] workers  hash: worker id -> end of its liveness (ms, Redis TIME)
-- KEYS[2] lists    set: every worker id that may have a processing list; it does
--                  not expire (a liveness hash does when every worker is down),
--                  and a worker leaves it only when its list was reclaimed
-- ARGV[1] worker id, ARGV[2] liveness (ms)
-- Returns the ids of listed workers whose liveness ended or is gone: workers that
-- died (kill -9) and may have left ids in their processing list.

local WORKERS, LISTS, me, lease = KEYS[1], KEYS[2], ARGV[1], tonumber(ARGV[2])
if not lease or lease < 1 then
  return redis.error_reply('job_heartbeat: bad liveness')
end
local now = now_ms()
redis.call('HSET', WORKERS, me, int(now + lease))
redis.call('PEXPIRE', WORKERS, int(lease * 10))
redis.call('SADD', LISTS, me)
local dead = {}
for _, w in ipairs(redis.call('SMEMBERS', LISTS)) do
  local live = tonumber(redis.call('HGET', WORKERS, w))
  if not live or live < now then
    dead[#dead + 1] = w
  end
end
return dead
