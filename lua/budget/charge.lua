-- charge.lua: the one step that charges a job: check the request against what
-- its id was first used for, then reserve and record who owns the charge.
-- KEYS[1] plan, KEYS[2] holds, KEYS[3] audit, KEYS[4] log, KEYS[5] meta,
-- KEYS[6] cancelled
--   (see budget/lib/state.lua)
-- ARGV[1] request id (the job's id)
-- ARGV[2] cost (integer >= 1)
-- ARGV[3] nonce: names this charge; the job created for it carries it, and only
--         that job can claim or release it
-- ARGV[4] operation, '/<key id>' appended when a service key acts for the user
--         (recorded for the audit trail; not part of what the id is bound to)
-- ARGV[5] fingerprint of the request body
-- ARGV[6] the job's deadline after now (ms), ARGV[7] hold grace (ms): a charge no
--         job has claimed by deadline + grace is released
-- ARGV[8] '1' when no new charge may be accepted now (fsync mode, and Redis is
--         not known to fsync every write): the same request charged already is
--         still answered (a retry finds its job), a new one is refused
-- ARGV[9] the charge's dimensions in the spend rollups: '<org>\t<operation>\t
--         <provider>\t<model>' (see budget/lib/rollups.lua)
-- ARGV[10] the prices a priced call was reserved at (the job's `price`), for
--         the export's spend entry; '' for none
-- ARGV[11] the tags of the model limits (of any plan) the call counts under,
--         space separated ('' none; see budget/lib/model_limits.lua)
-- ARGV[12..] export maxlen, retention, then the plan table (budget/lib/state.lua)
-- Returns one of
--   { 1, now_ms, deadline_ms, windows..., plan }    charged, held for its job
--   { 2, now_ms, deadline_ms, at_ms, nonce, state, windows..., plan }
--        the same request (operation and fingerprint) is charged already, under
--        `nonce`; state 'h' (no job has claimed it) or 'j' (its job has)
--   { 0, now_ms, windows... }                 denied: does not fit (retry_after per window)
--   { 3, operation }   the id is charged for another operation or body: nothing charged
--   { 4 }              the id is charged by a plain reserve: nothing charged
--   { -1, max_cost }   cost can never fit this plan
--   { 5 }              a new charge, refused as ARGV[8] asks: nothing charged
--   { 6, now_ms, balance, windows... }  a credits plan: the balance cannot
--                      cover it (budget/lib/credits.lua): nothing charged
-- windows: see push_windows in budget/lib/events.lua.
-- A member of an organisation (see budget/lib/state.lua): KEYS[7..12] the
-- organisation's budget keys; the organisation's plan name and windows follow
-- the user's in the reply (`org_windows`), and the step applies to both.
-- plan: the user's plan name as `resolve_plan` names it ('custom:<plan>' for
-- a user with limits of its own), always the reply's last element, after an
-- organisation's windows: the caller takes the plan's other settings
-- (max_stored_bytes) from it without reading the plan key.
-- A refunded charge is forgotten with its event: the same request then charges anew.

local request, cost, nonce, op, fp = ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4], ARGV[5]
local deadline_after, grace, refuse_new = tonumber(ARGV[6]), tonumber(ARGV[7]), ARGV[8] == '1'
if not deadline_after or deadline_after < 1 or not grace or grace < 0
    or not string.match(nonce, '^%w+$') or not string.match(op, '^%S+$')
    or not string.match(fp, '^%w+$') or #nonce > 127 or #fp > 127 or #ARGV[10] > 4096 then
  return redis.error_reply('charge: bad nonce, operation, fingerprint, deadline, grace or price')
end
DIMS = ARGV[9]
local never, limits, now, used, org, ev, slot, plan = open_spend(request, cost, 12)
if never then
  return never
end
model_select(ARGV[11], now)

if ev then
  local o = ev.rec
  if ev.state == 'r' then
    return { 4 }
  end
  if string.match(o.op, '^[^/]*') ~= string.match(op, '^[^/]*') or o.fp ~= fp then
    return { 3, o.op }
  end
  local out = org_windows(push_windows({ 2, now, o.deadline, spent(ev), o.nonce, ev.state }, limits,
    used, now), org, now)
  out[#out + 1] = plan
  return out
end

if refuse_new then
  return { 5 }
end

if not fits(limits, used, cost) or not org_fits(org, cost) or not model_fits(cost) then
  return org_windows(push_windows({ 0, now }, limits, used, now, cost), org, now, cost)
end
local balance = CREDITS.short(cost, now)
if balance then
  return push_windows({ 6, now, balance }, limits, used, now)
end

local deadline = now + deadline_after
PRICE = ARGV[10]
used = record(request, cost, now, limits, used, { nonce = nonce, deadline = deadline, op = op, fp = fp }, slot)
PRICE = ''
redis.call('ZADD', HOLDS, int(deadline + grace), request)
org_record(org, request, cost, now)
local out = org_windows(push_windows({ 1, now, deadline }, limits, used, now), org, now)
out[#out + 1] = plan
return out
