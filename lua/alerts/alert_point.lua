-- alert_point.lua: a deliverer moves a subject's outbox pointer to when its
-- outbox is next due, or removes it once the outbox is empty.
-- KEYS[1] due: the due set (see alert_take.lua)
-- ARGV[1] the pointer
-- ARGV[2] when the outbox is next due (ms), -1: it was empty
-- A pointer below 0 was added by a budget step since (a new alert; minus the
-- time it was added): it stays, to be taken at once. So a pointer is never removed after an alert was queued
-- behind the deliverer's look at the outbox.
-- Returns 1 when the pointer is kept or moved, 0 when removed.
local pointer, next_due = ARGV[1], tonumber(ARGV[2])
if not next_due then
  return redis.error_reply('alert_point: bad due time')
end
local score = tonumber(redis.call('ZSCORE', KEYS[1], pointer))
if score and score <= 0 then
  return 1
end
if next_due < 0 then
  redis.call('ZREM', KEYS[1], pointer)
  return 0
end
redis.call('ZADD', KEYS[1], next_due, pointer)
return 1
