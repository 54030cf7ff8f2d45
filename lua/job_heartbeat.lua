-- job_heartbeat.lua: a worker renews its liveness on one operation's queue.
-- KEYS[1] workers  hash: worker id -> end of its liveness (ms, Redis TIME)
-- ARGV[1] worker id, ARGV[2] liveness (ms)
-- Returns the ids whose liveness ended: workers that died (kill -9) and may have
-- left ids in their processing list.

local WORKERS, me, lease = KEYS[1], ARGV[1], tonumber(ARGV[2])
if not lease or lease < 1 then
  return redis.error_reply('job_heartbeat: bad liveness')
end
local now = now_ms()
redis.call('HSET', WORKERS, me, int(now + lease))
redis.call('PEXPIRE', WORKERS, int(lease * 10))
local dead = {}
local all = redis.call('HGETALL', WORKERS)
for i = 1, #all, 2 do
  if tonumber(all[i + 1]) < now then
    dead[#dead + 1] = all[i]
  end
end
return dead
