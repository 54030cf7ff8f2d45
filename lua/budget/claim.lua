-- claim.lua: a worker about to call the provider takes the charge of its job over
-- from the submission that made it.
-- KEYS[1] plan, KEYS[2] holds, KEYS[3] audit, KEYS[4] log, KEYS[5] meta,
-- KEYS[6] cancelled
--   (see budget/lib/state.lua)
-- ARGV[1] request id (the job's id), ARGV[2] the job's nonce
-- ARGV[3] end of the charge's hold (ms): the job's deadline plus the grace it was
--         charged with
-- ARGV[4..] export maxlen, retention, then the plan table (budget/lib/state.lua)
-- Returns 1 claimed: the job owns its charge (or the charge was taken and has
-- since left the window: paid), and may call the provider; 0 refused: the charge
-- is not this job's (the id was charged anew under another nonce, or the hold
-- ended and the charge was released), and the job must not run; 2 cancelled:
-- an operator refunded the charge while it was held (refund.lua), and the job
-- must not run.
-- Idempotent: a job claims again after a worker died. A member's claim reads
-- its organisation only on the full step (a released hold leaves both).

local request, nonce = ARGV[1], ARGV[2]
local hold_until = tonumber(ARGV[3])
if not hold_until then
  return redis.error_reply('claim: bad hold end')
end
local now = now_ms()

-- The common case, before the hold's end: nothing `expire` does can change
-- the answer (it releases only holds that ended, and an event that left the
-- window or the retention is paid either way), so the claim reads only the
-- event's bucket and record; the windows catch up at the user's next step
-- that reads them (charge, reserve, usage, settle). A hold at or past its end
-- takes the full step.
local fast = now < hold_until
if fast then
  if is_member() then
    check_at(redis.call('GET', at_key()))
  end
  local m = redis.call('HMGET', META, 'l', 's', 'w')
  check_home(m[3])
  SIZE, SPLIT = tonumber(m[1]) or 1, tonumber(m[2]) or 0
else
  local _, limits = resolve_plan(4)
  expire(now, limits)
  org_open(now, 4)
end

local ev = find(request)
if ev then
  if ev.state == 'r' or ev.rec.nonce ~= nonce then
    -- A plain reserve, or another charge, owns this id.
    return 0
  end
  if ev.state == 'h' then
    ev.state = 'j'
    update(ev)
    redis.call('ZREM', HOLDS, request)
  end
  return 1
end
-- No live charge. One an operator refunded while it was held: cancelled, until
-- the hold's end (then refused, like any hold that ended).
local cancelled = tonumber(redis.call('ZSCORE', CANCELLED, nonce))
if cancelled and cancelled > now then
  return 2
end
-- A hold is released only at its end: before that the charge existed and left
-- the window (paid); after it, it may have been released.
if now >= hold_until then
  return 0
end
return 1
