-- throttle_enqueue_fair.lua: a waiter asks for a slot of a fair provider, in
-- its user's queue (lib/fair.lua).
-- KEYS[1] queue    list: only bells here (a throttler's wake-up, see lib/fair.lua)
-- KEYS[2] waiting  hash: ticket -> "<deadline_us> <inbox channel>"
-- KEYS[3] bucket   the token bucket (lib/bucket.lua)
-- KEYS[4] active, KEYS[5] capped, KEYS[6] idle, KEYS[7] fair, KEYS[8] shares
--   (lib/fair.lua)
-- ARGV[1] ticket (unique per acquire: "<request id>~<random>")
-- ARGV[2] inbox channel the waiter's process is subscribed to (before this call)
-- ARGV[3] max_wait in µs: after that the ticket is worth nothing
-- ARGV[4] idle ttl in ms of the provider's keys
-- ARGV[5] rate (tokens/s), ARGV[6] burst
-- ARGV[7] user ("" for the anonymous queue), ARGV[8] weight (>= 1)
-- ARGV[9] max_in_flight (0: none), ARGV[10] hold of a slot in µs (> 0)
-- ARGV[11] the provider's key base (for the per-user keys)
-- Returns { 2, now_us } granted at once: nobody waits, the bucket has a token
-- and the user is below its cap; { 1, now_us } queued for a throttler;
-- { 0 } when the ticket is already waiting.

local QUEUE, WAITING, BUCKET = KEYS[1], KEYS[2], KEYS[3]
local F = { active = KEYS[4], capped = KEYS[5], idle = KEYS[6], fair = KEYS[7],
  shares = KEYS[8], base = ARGV[11] }
local ticket, inbox, user = ARGV[1], ARGV[2], ARGV[7]
local max_wait, idle = tonumber(ARGV[3]), tonumber(ARGV[4])
local rate, burst = tonumber(ARGV[5]), tonumber(ARGV[6])
local weight, cap, hold = tonumber(ARGV[8]), tonumber(ARGV[9]), tonumber(ARGV[10])
if not max_wait or max_wait < 0 or not idle or idle < 1 or not rate or rate <= 0
    or not burst or burst < 1 or not weight or weight < 1 or not cap or cap < 0
    or not hold or hold < 1 or not F.base or F.base == '' then
  return redis.error_reply('throttle_enqueue_fair: bad arguments')
end
if redis.call('HEXISTS', WAITING, ticket) == 1 then
  return { 0 }
end
local now = now_us()
if redis.call('HLEN', WAITING) == 0 and (cap == 0 or fair_held(F, user, now) < cap) then
  local tokens, at = bucket_read(BUCKET, now, rate, burst)
  if tokens >= 1 then
    bucket_write(BUCKET, tokens - 1, at, rate, burst)
    if cap > 0 then
      local held = held_key(F.base, user)
      redis.call('ZADD', held, int(now + hold), ticket)
      redis.call('PEXPIRE', held, int(hold / 1000 + 1000))
    end
    return { 2, now }
  end
end
local fq = fq_key(F.base, user)
redis.call('HSET', WAITING, ticket, int(now + max_wait) .. ' ' .. inbox)
redis.call('RPUSH', fq, ticket)
-- A user has a `shares` entry exactly while it has tickets (it leaves the
-- rotation and its entry together): a new entry is a user joining.
local joins = redis.call('HSET', F.shares, user, int(weight) .. ' ' .. int(cap) .. ' ' .. int(hold)) == 1
-- The keys written here live `idle` from now; the grant script does the same
-- for the ones it writes (active, capped, idle, fair).
local touched = { WAITING, fq, F.shares }
if joins or (not redis.call('ZSCORE', F.active, user) and not redis.call('ZSCORE', F.capped, user)) then
  fair_activate(F, user)
  touched[#touched + 1] = F.active
end
if ring(QUEUE) then
  touched[#touched + 1] = QUEUE
end
for _, key in ipairs(touched) do
  redis.call('PEXPIRE', key, int(idle))
end
return { 1, now }
