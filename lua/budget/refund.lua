-- refund.lua: an operator's refund (or a plain route's): remove one spend
-- event, at most once; a job's charge only while no job can be running on it.
-- KEYS[1] plan, KEYS[2] holds, KEYS[3] audit, KEYS[4] log, KEYS[5] meta,
-- KEYS[6] cancelled
--   (see budget/lib/state.lua)
-- ARGV[1] request id
-- ARGV[2] the nonce of the charge's job when the caller read that job as final
--         (succeeded or failed): its charge is then a plain credit; '' otherwise
-- ARGV[3..] export maxlen, retention, then the plan table (budget/lib/state.lua)
-- Returns one of
--   { 1, cost, used }  refunded: a plain reserve, or the charge of the final job
--   { 2, cost, used }  a charge held for a job no worker has claimed: released,
--                      and its job cancelled (its claim is refused until the
--                      hold's end, so it never reaches the upstream)
--   { 3, used }        the charge is owned by its job, which may be calling the
--                      provider: nothing changed (a conflict)
--   { 0, used }        no live event has the id (never reserved, already
--                      refunded, or expired)
-- `used` is the plan's longest window's. Keys are per user, so one user's
-- request id can never refund another user's event. The claim and this script
-- decide the race between a worker and an operator: whichever runs first wins.

local request, final = ARGV[1], ARGV[2]
local now, used, org = open_budget(3)
local ev = find(request)
if not ev then
  return { 0, used }
end
if ev.state == 'r' or (final ~= '' and ev.rec.nonce == final) then
  used = remove(ev, used, now)
  org_recost(org, request, 0, now)
  return { 1, ev.cost, used }
end
if ev.state == 'j' then
  return { 3, used }
end
-- Held: cancel its job with the release, in this one step.
local hold_end = tonumber(redis.call('ZSCORE', HOLDS, request)) or (now + RETAIN)
redis.call('ZREMRANGEBYSCORE', CANCELLED, '-inf', now)
redis.call('ZADD', CANCELLED, int(hold_end), ev.rec.nonce)
if redis.call('PTTL', CANCELLED) < hold_end - now then
  redis.call('PEXPIRE', CANCELLED, int(hold_end - now + 1))
end
used = remove(ev, used, now)
org_recost(org, request, 0, now)
return { 2, ev.cost, used }
