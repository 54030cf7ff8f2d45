-- alert_done.lua: one delivery attempt's outcome.
-- KEYS[1] alerts, KEYS[2] alertq: the subject's outbox (see alert_lease.lua)
-- ARGV[1] alert id
-- ARGV[2] the attempt (from alert_lease.lua)
-- ARGV[3] 'ack': delivered or given up, the alert is removed (whichever
--         attempt: it was sent); or 'retry': due again ARGV[4] ms from now,
--         unless a later attempt leased it meanwhile
-- Returns the outbox's next due time (ms), or -1 when it is empty.
local id, attempt, what, delay = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
if what == 'ack' then
  redis.call('HDEL', KEYS[1], id, 'n:' .. id)
  redis.call('ZREM', KEYS[2], id)
elseif what == 'retry' and delay and delay >= 0 then
  if redis.call('HGET', KEYS[1], 'n:' .. id) == attempt then
    local now = time_ms()
    redis.call('ZADD', KEYS[2], 'XX', now + delay, id)
  end
else
  return redis.error_reply('alert_done: ack, or retry with a delay')
end
local first = redis.call('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')
return first[2] and tonumber(first[2]) or -1
