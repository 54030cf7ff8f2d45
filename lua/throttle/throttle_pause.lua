-- throttle_pause.lua: the upstream refused a call (429, or 503 with
-- Retry-After): the provider's bucket grants nothing, to any pod, until the
-- moment the upstream named, or for an exponential back-off when it named none.
-- KEYS[1] bucket   the token bucket (throttle/lib/bucket.lua)
-- ARGV[1] rate (tokens/s), ARGV[2] burst
-- ARGV[3] the pause the upstream named, in µs from its answer, or -1 for none
-- ARGV[4] the first back-off, µs (doubled for each refusal in a row)
-- ARGV[5] the longest pause, µs (a named one is cut to it too)
-- ARGV[6] 1 for an adaptive provider (throttle/lib/bucket.lua: AIMD): the effective
--         rate is halved (at least 1% of rate), growing back from the pause's end
-- The bucket is emptied and refills from the pause's end (`tokens` 0, `at` its
-- end; throttle/lib/bucket.lua): no grant script grants before it, and after it the
-- rate comes back from an empty bucket, not as a burst into an upstream that
-- just refused. A pause never shortens one in force. `strikes` counts the
-- back-offs in a row: a refusal naming no pause while one is in force counts
-- nothing (the calls in flight when it began come back refused too); one
-- within a back-off's length after the last pause ended doubles it; later
-- ones start again at the first.
-- Returns { until_us, pause_us, strikes, rate_milli }: Redis TIME of the
-- pause's end, its length from now (0: none, a named pause of 0), the
-- back-offs in a row, the effective rate after it (tokens per 1000 s).

local BUCKET = KEYS[1]
local rate, burst = tonumber(ARGV[1]), tonumber(ARGV[2])
local named, first, longest = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
if not rate or rate <= 0 or not burst or burst < 1 or not named or not first or first < 1
    or not longest or longest < first then
  return redis.error_reply('throttle_pause: bad rate, burst or pause')
end
local now = now_us()
local adaptive = ARGV[6] == '1'
local v = redis.call('HMGET', BUCKET, 'strikes', 'until')
local strikes, last = tonumber(v[1]) or 0, tonumber(v[2]) or 0
local function backoff(n)
  return math.min(first * 2 ^ (math.min(n, 40) - 1), longest)
end
local target
if named >= 0 then
  target = now + math.min(named, longest)
elseif now < last then
  target = last
else
  if strikes > 0 and now < last + backoff(strikes) then
    strikes = strikes + 1
  else
    strikes = 1
  end
  target = now + backoff(strikes)
end
local _, at, eff = bucket_read(BUCKET, now, rate, burst)
local ends = math.max(at, target)
-- A refusal while a pause is in force (its calls in flight) halves nothing more.
if adaptive and now >= last then
  eff = math.max(rate / 100, eff / 2)
  redis.call('HSET', BUCKET, 'aimd', string.format('%.17g', eff), 'aimd_at', int(math.max(ends, now)))
end
local milli = int(math.floor(eff * 1000))
if ends <= now then
  if adaptive then
    bucket_keep(BUCKET, math.ceil(burst / eff * 1000) + 11000)
  end
  return { now, 0, strikes, milli }
end
redis.call('HSET', BUCKET, 'tokens', '0', 'at', int(ends), 'until', int(ends),
  'strikes', int(strikes))
-- Kept until it would be full again (a missing bucket is full), and an
-- adaptive one's rate back (at most 10 s).
-- The provider's other limits in this hash may need longer: never shortened.
bucket_keep(BUCKET, math.ceil((ends - now) / 1000 + burst / eff * 1000) + 11000)
return { ends, ends - now, strikes, milli }
