-- release.lua: a job that failed gives its charge back, at most once.
-- KEYS[1] events, KEYS[2] costs, KEYS[3] plan, KEYS[4] owners, KEYS[5] holds,
-- KEYS[6] audit, KEYS[7] log, KEYS[8] meta
--   (see lib/budget.lua)
-- ARGV[1] request id (the job's id), ARGV[2] the job's nonce
-- ARGV[3..] export maxlen, then the plan table (lib/budget.lua)
-- Returns { 1, cost, used } released, or { 0, used } when the id has no live
-- charge with this nonce (released already, expired, or charged anew by a later
-- attempt, which this job does not own).

local request, nonce = ARGV[1], ARGV[2]
local now, used, org = open_budget(3)
local ev = find(request)
if not ev or ev.state == 'r' or ev.rec.nonce ~= nonce then
  return { 0, used }
end
used = remove(ev, used, now)
org_recost(org, request, 0, now)
return { 1, ev.cost, used }
