-- activity_sample.lua: one sample of the operations dashboard's history
-- (tollgate_core::activity::Sample) for the current slot, written by the first
-- pod that samples the slot: at most one sample per interval across pods,
-- however many sample. Observational only. The slot is Redis TIME rounded
-- down to the interval, so pods agree on it whatever their own clocks say.
-- KEYS[1] history   sorted set: sample (JSON) by its slot's start (ms)
-- KEYS[2] calls, KEYS[3] grants, KEYS[4] answers, KEYS[5] denials
--                   the activity log's counter hashes (activity_record.lua)
-- ARGV[1] interval (ms), ARGV[2] how long samples are kept (ms),
-- ARGV[3] the most samples kept, ARGV[4] idle ttl of the history (ms),
-- ARGV[5] the gauges the pod read (a JSON object)
-- Returns { 1 written | 0 the slot had its sample, slot start (ms),
--   ms until the next slot }.

local interval, span, most, idle = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]),
  tonumber(ARGV[4])
if not interval or interval < 1 or not span or span < 1 or not most or most < 1
  or not idle or idle < 1 then
  return redis.error_reply('activity_sample: bad interval, span, cap or idle ttl')
end
local ok, gauges = pcall(cjson.decode, ARGV[5] or '')
if not ok or type(gauges) ~= 'table' then
  return redis.error_reply('activity_sample: the gauges are not a JSON object')
end

local now_ms = time_ms()
local slot = now_ms - now_ms % interval
local next_in = slot + interval - now_ms
if redis.call('ZCOUNT', KEYS[1], slot, slot) > 0 then
  return { 0, slot, next_in }
end

-- A counter hash as a JSON object (an empty one encodes as {}).
local function counters(key)
  local all = redis.call('HGETALL', key)
  local out = {}
  for i = 1, #all, 2 do
    out[all[i]] = tonumber(all[i + 1]) or 0
  end
  return cjson.encode(out)
end

local sample = '{"at_ms":' .. string.format('%d', slot) .. ',"gauges":' .. ARGV[5]
  .. ',"counters":{"calls":' .. counters(KEYS[2]) .. ',"grants":' .. counters(KEYS[3])
  .. ',"answers":' .. counters(KEYS[4]) .. ',"denials":' .. counters(KEYS[5]) .. '}}'
redis.call('ZADD', KEYS[1], slot, sample)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. string.format('%d', now_ms - span))
redis.call('ZREMRANGEBYRANK', KEYS[1], 0, -(most + 1))
redis.call('PEXPIRE', KEYS[1], idle)
return { 1, slot, next_in }
