-- alert_lease.lua: lease the due alerts of one subject's outbox.
-- KEYS[1] alerts  hash: alert id -> '<window_ms> <bp> <used> <limit> <at_ms>
--                 <kind> <name>'; 'n:<id>' its attempts so far; '#' the id
--                 counter; '!' alerts dropped when the outbox was full
--                 (budget/lib/alerts.lua's queue_alert writes them)
-- KEYS[2] alertq  sorted set: alert id -> when it is due (queued, retried, or
--                 the end of its lease)
-- KEYS[3] meta    the subject's budget meta: its 'a' (an alert no deliverer
--                 looked at yet, see budget/lib/alerts.lua's repoint) is cleared
-- ARGV[1] how many alerts at most
-- ARGV[2] lease (ms)
-- Returns { now_ms, next_due_ms (-1: the outbox is empty), dropped,
--           id, record, attempt, ... } for each alert leased.
local max, lease = tonumber(ARGV[1]), tonumber(ARGV[2])
if not max or max < 1 or not lease or lease < 1 then
  return redis.error_reply('alert_lease: bad count or lease')
end
local now = time_ms()
redis.call('HDEL', KEYS[3], 'a')
local dropped = tonumber(redis.call('HGET', KEYS[1], '!')) or 0
if dropped > 0 then
  redis.call('HDEL', KEYS[1], '!')
end
local leased = {}
local due = redis.call('ZRANGE', KEYS[2], '-inf', now, 'BYSCORE', 'LIMIT', 0, max)
for _, id in ipairs(due) do
  local rec = redis.call('HGET', KEYS[1], id)
  if rec then
    local attempt = redis.call('HINCRBY', KEYS[1], 'n:' .. id, 1)
    redis.call('ZADD', KEYS[2], now + lease, id)
    leased[#leased + 1] = id
    leased[#leased + 1] = rec
    leased[#leased + 1] = attempt
  else
    redis.call('ZREM', KEYS[2], id)
  end
end
local first = redis.call('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')
local out = { now, first[2] and tonumber(first[2]) or -1, dropped }
for _, v in ipairs(leased) do
  out[#out + 1] = v
end
return out
