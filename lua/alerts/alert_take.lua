-- alert_take.lua: lease the due set's outbox pointers that are due, so that one
-- deliverer looks at each subject's outbox at a time.
-- KEYS[1] due    sorted set: outbox pointer ('{u:<user>}': the subject's keys
--                after the prefix) -> when a deliverer should look at it (ms):
--                below 0 when a budget step queued an alert (minus the time it
--                did), else a time a deliverer set (its lease's end, or the
--                outbox's next due alert)
-- ARGV[1] how many pointers at most
-- ARGV[2] lease (ms): a pointer taken is not due again before its end
-- Returns { now_ms, lease_end_ms, pointer... }
local max, lease = tonumber(ARGV[1]), tonumber(ARGV[2])
if not max or max < 1 or not lease or lease < 1 then
  return redis.error_reply('alert_take: bad count or lease')
end
local now = time_ms()
local until_ms = now + lease
local out = { now, until_ms }
local due = redis.call('ZRANGE', KEYS[1], '-inf', now, 'BYSCORE', 'LIMIT', 0, max)
for _, p in ipairs(due) do
  redis.call('ZADD', KEYS[1], until_ms, p)
  out[#out + 1] = p
end
return out
