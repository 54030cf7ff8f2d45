-- move_out.lua: the source side of moving a user between organisations (or
-- into or out of one): freeze the location, read its live events a batch at
-- a time (oldest first), drop those the destination holds. The destination
-- side is move_in.lua; the `RedisLedger` drives the steps, and each is
-- idempotent, so a move interrupted at any step is finished by running it
-- again.
-- KEYS[1..6] the user's budget keys at this location (see budget/lib/state.lua),
--   KEYS[7..12] its organisation's when the location is a member's.
-- Freezing sets the location's marker (budget/lib/state.lua, AT): '<base>:at' at a
-- member's location; at the user's own tag meta's 'w' (meta then persists)
-- and the pointer '<base>:at'.
-- ARGV[1] step: 'freeze' | 'batch' | 'drop'
-- ARGV[2] freeze: where the user moves ('-': its own tag, 'o:<org>');
--         batch: how many log entries to read (1..100);
--         drop: the request ids to drop, separated by spaces
-- ARGV[3..] export maxlen (0: a move exports nothing), retention, then the
--   plan table (budget/lib/state.lua)
-- Returns
--   freeze: { 1 } frozen now; { 0, <to> } frozen already, for a move to <to>;
--           { -1, <marker> } the user does not live here
--   batch:  { '<plan>\n<limits>' (each '' when none), cancelled, entries_read, (id, at, state, cost,
--           estimate | -1 (then '#<code>', its rollups code, when it has one),
--           nonce, fingerprint, deadline, op, hold_end | -1)... }
--           cancelled: '<nonce> <hold end> ...' of the held charges an
--           operator refunded (their jobs' claims stay refused there)
--   drop:   { entries left in the log }
-- Errors: TOLLGATE_NOT_MOVING (batch, drop: the location is not frozen).
-- A frozen location answers every other budget script TOLLGATE_MOVING.

NOCHECK = true
local step, arg = ARGV[1], ARGV[2]
-- The marker: a member's '<base>:at', or meta's 'w' at the user's own tag.
local at
if is_member() then
  at = redis.call('GET', at_key())
else
  at = redis.call('HGET', META, 'w')
end
local frozen = at and string.sub(at, 1, 7) == 'moving '
if step == 'freeze' then
  if frozen then
    return { 0, string.sub(at, 8) }
  end
  if (is_member() and at ~= 'here') or (not is_member() and at) then
    return { -1, at or '' }
  end
  if not is_member() then
    -- Meta keeps the marker: it no longer expires (the mover's last step
    -- sets its expiry again when the user comes back).
    redis.call('HSET', META, 'w', 'moving ' .. arg)
    redis.call('PERSIST', META)
  end
  redis.call('SET', at_key(), 'moving ' .. arg)
  return { 1 }
end
if not frozen then
  return redis.error_reply('TOLLGATE_NOT_MOVING the location is not frozen by a move')
end

if step == 'batch' then
  local n = tonumber(arg)
  if not n or n < 1 or n > SLICE then
    return redis.error_reply('TOLLGATE_BAD_MOVE batch size must be 1..100')
  end
  local m = redis.call('HMGET', META, 'l', 's')
  SIZE, SPLIT = tonumber(m[1]) or 1, tonumber(m[2]) or 0
  local cancelled = redis.call('ZRANGE', CANCELLED, '(' .. int(now_ms()), '+inf', 'BYSCORE', 'LIMIT', 0,
    200, 'WITHSCORES')
  local batch = redis.call('XRANGE', LOG, '-', '+', 'COUNT', n)
  -- The plan and any limits of the user's own travel together ('<plan>\n<limits>').
  local plan = redis.call('MGET', PLAN, BASE .. ':limits')
  local out = { (plan[1] or '') .. '\n' .. (plan[2] or ''), table.concat(cancelled, ' '), #batch }
  local orphans = {}
  for _, e in ipairs(batch) do
    local ev = at_entry(e[1], e[2][2])
    if ev then
      local rec = ev.rec
      local hold = tonumber(redis.call('ZSCORE', HOLDS, rec.id)) or -1
      local est = ev.estimate or -1
      if ev.code then
        est = int(est) .. '#' .. ev.code
      end
      if ev.m then
        est = (ev.code and est or int(est) .. '#') .. '!' .. ev.m
      end
      for _, v in ipairs({ rec.id, spent(ev), ev.state, ev.cost, est, rec.nonce or '',
        rec.fp or '', rec.deadline or 0, rec.op or '', hold }) do
        out[#out + 1] = v
      end
    else
      -- An entry no index bucket names (its event left): nothing to move.
      orphans[#orphans + 1] = e[1]
    end
  end
  if #orphans > 0 then
    redis.call('XDEL', LOG, unpack(orphans))
  end
  return out
end

if step == 'drop' then
  local now, _, org = open_budget(3)
  for id in string.gmatch(arg, '%S+') do
    local ev = find(id)
    if ev then
      remove(ev, 0, now)
      org_recost(org, id, 0, now)
    end
  end
  return { redis.call('XLEN', LOG) }
end
return redis.error_reply('TOLLGATE_BAD_MOVE step must be freeze, batch or drop')
