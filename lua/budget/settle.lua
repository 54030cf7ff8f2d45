-- settle.lua: correct a spend event to what the call really cost.
-- KEYS[1] plan, KEYS[2] holds, KEYS[3] audit, KEYS[4] log, KEYS[5] meta,
-- KEYS[6] cancelled
--   (see budget/lib/state.lua)
-- ARGV[1] request id
-- ARGV[2] actual cost (integer >= 0; 0 removes the event)
-- ARGV[3] nonce: '' settles any live event (an operator's correction); else only
--         the charge held under this nonce (a job settling its own charge, to
--         >= 1), whose owner record then keeps the cost it was charged at
-- ARGV[4] '1': the cost may rise; '0': it only comes down (a job that reserved
--         the most settles down, so no window passes its limit: a cost above
--         the charge's current one leaves it as it is); 'o': an operator's
--         correction (the cost may rise), of a job's charge only when ARGV[3]
--         is the nonce of its job, read as final by the caller ('' : none):
--         else { 3, used }, nothing changed (its job may yet call the
--         provider); 'f': the same, a removal exported as forced (a settle to
--         0 of a charge whose job may have run)
-- ARGV[5..] export maxlen, retention, then the plan table (budget/lib/state.lua)
-- Returns { 1, previous_cost, cost, used } settled, { 0, used } when no live
-- event has the id (or the charge is not this nonce's), or { 3, used } (ARGV[4]
-- 'o' or 'f') a charge whose job is not final; `used` is the plan's
-- longest window's. The event keeps its time: settling never extends a window.
-- The cost is set, not added, so a retried settle changes nothing more. A raised
-- cost may take a window past its limit: reserves then wait until it fits again.

local request, actual, nonce, raise = ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4]
local _, limits = resolve_plan(5)
local operator = raise == 'o' or raise == 'f'
if not actual or actual < 0 or (nonce ~= '' and actual < 1 and not operator)
    or (raise ~= '0' and raise ~= '1' and not operator) then
  return redis.error_reply('settle: actual cost must be an integer >= 0 (>= 1 for a charge), raise 0, 1, o or f')
end
local now = now_ms()
local used = expire(now, limits)
local org = org_open(now, 5)
local ev = find(request)
if not ev then
  return { 0, used }
end
local previous = ev.cost
if operator then
  if ev.state ~= 'r' and (nonce == '' or ev.rec.nonce ~= nonce) then
    return { 3, used }
  end
elseif nonce ~= '' then
  if ev.state == 'r' or ev.rec.nonce ~= nonce then
    return { 0, used }
  end
  ev.estimate = ev.estimate or previous
end
if raise == '0' and actual > previous then
  actual = previous
end
if actual == 0 then
  used = remove(ev, used, now, raise == 'f')
  org_recost(org, request, 0, now)
  return { 1, previous, 0, used }
end
used = recost(ev, actual, now)
org_recost(org, request, actual, now)
return { 1, previous, actual, used }
