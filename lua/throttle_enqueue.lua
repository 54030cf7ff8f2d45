-- throttle_enqueue.lua: a waiter asks for a slot of one provider.
-- KEYS[1] queue    list of tickets, oldest first       (see keys.rs, ThrottleKeys)
-- KEYS[2] waiting  hash: ticket -> "<deadline_us> <inbox channel>"
-- ARGV[1] ticket (unique per acquire: "<request id>~<random>")
-- ARGV[2] inbox channel the waiter's process is subscribed to (before this call)
-- ARGV[3] max_wait in µs: after that the ticket is worth nothing
-- ARGV[4] idle ttl in ms of the provider's keys
-- Returns { 1, now_us } queued, or { 0 } when the ticket is already waiting.

local ticket, inbox = ARGV[1], ARGV[2]
local max_wait, idle = tonumber(ARGV[3]), tonumber(ARGV[4])
if not max_wait or max_wait < 0 or not idle or idle < 1 then
  return redis.error_reply('throttle_enqueue: bad max_wait or idle ttl')
end
if redis.call('HEXISTS', KEYS[2], ticket) == 1 then
  return { 0 }
end
local now = now_us()
redis.call('HSET', KEYS[2], ticket, int(now + max_wait) .. ' ' .. inbox)
redis.call('RPUSH', KEYS[1], ticket)
redis.call('PEXPIRE', KEYS[1], int(idle))
redis.call('PEXPIRE', KEYS[2], int(idle))
return { 1, now }
