-- throttle_grant.lua: a throttler serves one provider's waiters from its bucket.
-- KEYS[1] queue       list of tickets, oldest first
-- KEYS[2] processing  this throttler's list of tickets it popped (BLMOVE) but not served
-- KEYS[3] waiting     hash: ticket -> "<deadline_us> <inbox channel>"
-- KEYS[4] granted     sorted set: ticket -> grant time (µs); the readiness record
-- KEYS[5] bucket      the token bucket (lib/bucket.lua)
-- ARGV[1] rate (tokens/s), ARGV[2] burst
-- ARGV[3] most grants in this call
-- ARGV[4] how long a readiness record lives, µs
-- ARGV[5] idle ttl in ms of the provider's keys
-- Serves the processing list first, then the queue head, in order: a ticket nobody
-- waits for any more (cancelled, or past its deadline) is dropped without a token;
-- a waited-for ticket gets a token, a readiness record and a PUBLISH of
-- "<ticket> <granted_at_us>" on its inbox, all in this one atomic step.
-- Returns { granted, skipped, wait_us, more }: wait_us > 0 when the bucket ran dry
-- with tickets left (the exact time until the next token), more = 1 when the
-- grant limit stopped the call with tickets left.

local QUEUE, PROCESSING, WAITING, GRANTED, BUCKET = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local rate, burst = tonumber(ARGV[1]), tonumber(ARGV[2])
local limit, ready_ttl, idle = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
if not rate or rate <= 0 or not burst or burst < 1 or not limit or not ready_ttl or not idle then
  return redis.error_reply('throttle_grant: bad rate, burst or limits')
end

local now = now_us()
redis.call('ZREMRANGEBYSCORE', GRANTED, '-inf', '(' .. int(now - ready_ttl))
local tokens, at = bucket_read(BUCKET, now, rate, burst)
local granted, skipped, wait, more = 0, 0, 0, 0
while true do
  local src = PROCESSING
  local ticket = redis.call('LINDEX', PROCESSING, 0)
  if not ticket then
    src = QUEUE
    ticket = redis.call('LINDEX', QUEUE, 0)
  end
  if not ticket then
    break
  end
  if granted >= limit then
    more = 1
    break
  end
  local w = redis.call('HGET', WAITING, ticket)
  local deadline, inbox = 0, ''
  if w then
    deadline, inbox = parse_waiting(w)
  end
  if not w or deadline < now then
    redis.call('LPOP', src)
    redis.call('HDEL', WAITING, ticket)
    skipped = skipped + 1
  elseif tokens >= 1 then
    tokens = tokens - 1
    redis.call('LPOP', src)
    redis.call('HDEL', WAITING, ticket)
    redis.call('ZADD', GRANTED, int(now), ticket)
    redis.call('PUBLISH', inbox, ticket .. ' ' .. int(now))
    granted = granted + 1
  else
    wait = until_token(tokens, rate)
    break
  end
end
if granted > 0 then
  bucket_write(BUCKET, tokens, at, rate, burst)
  redis.call('PEXPIRE', GRANTED, int(idle))
end
return { granted, skipped, wait, more }
