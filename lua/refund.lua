-- refund.lua: remove one spend event, at most once.
-- KEYS[1] events, KEYS[2] costs, KEYS[3] plan, KEYS[4] owners, KEYS[5] holds,
-- KEYS[6] audit, KEYS[7] log, KEYS[8] meta
--   (see lib/budget.lua)
-- ARGV[1] request id
-- ARGV[2..] export maxlen, then the plan table (lib/budget.lua)
-- Returns { 1, cost, used } refunded, or { 0, used } when no live event has the id
-- (never reserved, already refunded, or expired); `used` is the longest window's.
-- Keys are per user, so one user's request id can never refund another user's event.

local request = ARGV[1]
local _, limits = resolve_plan(2)
local now = now_ms()
local used = expire(now, limits)
local ev = find(request)
if not ev then
  return { 0, used }
end
used = remove(ev, used, now)
return { 1, ev.cost, used }
