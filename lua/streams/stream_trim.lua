-- stream_trim.lua: the api's stream hub releases what it read of streamed
-- jobs' answers, in one call for many streams of one operation (one hash
-- tag): each stream loses its entries read, and its unread bytes (what
-- `stream_push.lua` refuses appends by) lose what they counted for.
-- KEYS[2i-1] a job's stream, KEYS[2i] its unread bytes; all under one hash tag
-- ARGV[2i-1] the MINID: entries below it were read, ARGV[2i] the bytes they
--   counted for
-- A stream or count gone (the reader left, the TTL ended) stays gone.
-- Returns how many streams it trimmed.

if #KEYS % 2 ~= 0 or #ARGV ~= #KEYS then
  return redis.error_reply('stream_trim: bad arguments')
end
for i = 1, #KEYS, 2 do
  local stream, bytes = KEYS[i], KEYS[i + 1]
  local minid, read = ARGV[i], tonumber(ARGV[i + 1])
  if not read or read < 0 then
    return redis.error_reply('stream_trim: bad arguments')
  end
  redis.call('XTRIM', stream, 'MINID', minid)
  if redis.call('EXISTS', bytes) == 1 then
    if redis.call('DECRBY', bytes, read) < 0 then
      redis.call('SET', bytes, 0, 'KEEPTTL')
    end
  end
end
return #KEYS / 2
