-- reserve.lua: atomically expire, check every limit and record one spend event.
-- KEYS[1] plan, KEYS[2] holds, KEYS[3] audit, KEYS[4] log, KEYS[5] meta,
-- KEYS[6] cancelled
--   (see budget/lib/state.lua)
-- ARGV[1] request id
-- ARGV[2] cost (integer >= 1; checked by the caller too)
-- ARGV[3] the event's dimensions in the spend rollups: '<org>\t\t\t' (a plain
--         reserve names no operation; see budget/lib/rollups.lua)
-- ARGV[4..] export maxlen, retention, then the plan table (budget/lib/state.lua)
-- Returns one of
--   { 1, at_ms, now_ms, windows... }   recorded
--   { 2, at_ms, now_ms, windows... }   already recorded (idempotent retry)
--   { 0, 0, now_ms, windows... }       denied: does not fit (retry_after per window)
--   { -1, max_cost }                   cost can never fit this plan
--   { 6, now_ms, balance, windows... } a credits plan: the balance cannot
--                                      cover it (budget/lib/credits.lua)
-- windows: see push_windows in budget/lib/events.lua.
-- A member of an organisation (see budget/lib/state.lua): KEYS[7..12] the
-- organisation's budget keys; the organisation's plan name and windows follow
-- the user's in the reply (`org_windows`), and the step applies to both.
-- A member's cost must fit both; { -1, max_cost } is the smaller plan's.
-- Idempotent per request id; two requests in one millisecond are two events.

local request, cost = ARGV[1], tonumber(ARGV[2])
DIMS = ARGV[3]
local never, limits, now, used, org, ev, slot = open_spend(request, cost, 4)
if never then
  return never
end

if ev then
  return org_windows(push_windows({ 2, spent(ev), now }, limits, used, now), org, now)
end

if not fits(limits, used, cost) or not org_fits(org, cost) then
  return org_windows(push_windows({ 0, 0, now }, limits, used, now, cost), org, now, cost)
end
local balance = CREDITS.short(cost, now)
if balance then
  return push_windows({ 6, now, balance }, limits, used, now)
end

local at
used, at = record(request, cost, now, limits, used, nil, slot)
org_record(org, request, cost, now)
return org_windows(push_windows({ 1, at, now }, limits, used, now), org, now)
