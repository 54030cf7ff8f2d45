-- release.lua: a job that failed gives its charge back, at most once.
-- KEYS[1] plan, KEYS[2] holds, KEYS[3] audit, KEYS[4] log, KEYS[5] meta
--   (see budget/lib/state.lua)
-- ARGV[1] request id (the job's id), ARGV[2] the job's nonce
-- ARGV[3..] export maxlen, then the plan table (budget/lib/state.lua)
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
