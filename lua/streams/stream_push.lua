-- stream_push.lua: appends one event of a streamed job's answer, from the
-- worker running it to the api pod holding its client (its stream hub reads
-- with `XREAD BLOCK`).
-- KEYS[1] the job's stream, KEYS[2] its cancel mark (set by the reader when
--   its client went away), KEYS[3] its unread bytes (what was appended and
--   not yet trimmed by the reader: `stream_trim.lua`); all under the queue's
--   hash tag
-- ARGV[1] the run (attempt), ARGV[2] the event's place in the run (from 1),
-- ARGV[3] kind: d (data), x (end), e (error), ARGV[4] the event's text,
-- ARGV[5] the most unread bytes: an append finding that many is refused,
-- ARGV[6] TTL in ms (from this append; the stream goes when nobody appends),
-- ARGV[7] the answer's head (JSON: status, safe headers) riding with this
--   entry, its run's first (field h), or '' (absent),
-- ARGV[8] the bytes this entry counts for (its text, its head, an overhead)
-- Returns 1 appended, 0 the reader went away, 2 the stream is full (its
-- reader is that far behind, or nobody reads it); nothing appended on 0 or 2:
-- stop.

local STREAM, CANCEL, BYTES = KEYS[1], KEYS[2], KEYS[3]
local attempt, seq, kind, text = ARGV[1], ARGV[2], ARGV[3], ARGV[4] or ''
local bound, ttl, head = tonumber(ARGV[5]), tonumber(ARGV[6]), ARGV[7] or ''
local size = tonumber(ARGV[8])
if not attempt or not seq or (kind ~= 'd' and kind ~= 'x' and kind ~= 'e')
  or not bound or bound < 1 or not ttl or ttl < 1 or not size or size < 0 then
  return redis.error_reply('stream_push: bad arguments')
end
if redis.call('EXISTS', CANCEL) == 1 then
  return 0
end
local unread = tonumber(redis.call('GET', BYTES)) or 0
if unread >= bound then
  return 2
end
if head ~= '' then
  redis.call('XADD', STREAM, '*', 'a', attempt, 's', seq, 'k', kind, 't', text, 'h', head)
else
  redis.call('XADD', STREAM, '*', 'a', attempt, 's', seq, 'k', kind, 't', text)
end
redis.call('INCRBY', BYTES, size)
redis.call('PEXPIRE', STREAM, ttl)
redis.call('PEXPIRE', BYTES, ttl)
return 1
