-- throttle_done.lua: the provider call made with a slot of a capped user
-- ended: the slot stops counting against the user's max_in_flight.
-- KEYS[1] queue (a bell wakes a throttler when tickets of the user go back)
-- KEYS[2] waiting, KEYS[3] tickets, KEYS[4] capped, KEYS[5] tags (throttle/lib/fair.lua)
-- ARGV[1] user, ARGV[2] ticket of the grant, ARGV[3] the provider's key base
-- Returns 1 when the slot was held, 0 when it was not (already ended, handed
-- back, or freed by its lease): calling it twice is harmless.

local F = { waiting = KEYS[2], tickets = KEYS[3], capped = KEYS[4], tags = KEYS[5],
  base = ARGV[3] }
if not F.base or F.base == '' then
  return redis.error_reply('throttle_done: no key base')
end
return fair_release(F, KEYS[1], ARGV[1], ARGV[2], now_us())
