-- stream_push.lua: appends one event of a streamed job's answer, from the
-- worker running it to the api pod holding its client (`XREAD BLOCK`).
-- KEYS[1] the job's stream, KEYS[2] its cancel mark (set by the reader when
--   its client went away); both under the queue's hash tag
-- ARGV[1] the run (attempt), ARGV[2] the event's place in the run (from 1),
-- ARGV[3] kind: d (data), x (end), e (error), ARGV[4] the event's text,
-- ARGV[5] MAXLEN (the most entries kept unread), ARGV[6] TTL in ms (from
--   this append; the stream goes when nobody appends or reads),
-- ARGV[7] the answer's head (JSON: status, safe headers) riding with this
--   entry, its run's first (field h), or '' (absent)
-- Returns 1 appended, 0 the reader went away (nothing appended: stop).

local STREAM, CANCEL = KEYS[1], KEYS[2]
local attempt, seq, kind, text = ARGV[1], ARGV[2], ARGV[3], ARGV[4] or ''
local maxlen, ttl, head = tonumber(ARGV[5]), tonumber(ARGV[6]), ARGV[7] or ''
if not attempt or not seq or (kind ~= 'd' and kind ~= 'x' and kind ~= 'e')
  or not maxlen or maxlen < 1 or not ttl or ttl < 1 then
  return redis.error_reply('stream_push: bad arguments')
end
if redis.call('EXISTS', CANCEL) == 1 then
  return 0
end
if head ~= '' then
  redis.call('XADD', STREAM, 'MAXLEN', maxlen, '*', 'a', attempt, 's', seq, 'k', kind, 't', text,
    'h', head)
else
  redis.call('XADD', STREAM, 'MAXLEN', maxlen, '*', 'a', attempt, 's', seq, 'k', kind, 't', text)
end
redis.call('PEXPIRE', STREAM, ttl)
return 1
