-- move_in.lua: the destination side of moving a user (see move_out.lua):
-- adds a batch of the user's live events with the times they were spent, to
-- the user's budget here and, at a member's location, to the organisation's
-- (`insert` in budget/lib/events.lua: each still leaves each window at its time).
-- Idempotent by request id: an event already here is skipped, so a batch
-- sent again after a crash adds nothing twice. The location is not the
-- user's yet (nobody else writes it) until the mover sets its marker.
-- KEYS[1..6] the user's budget keys at this location, KEYS[7..12] its
--   organisation's when the location is a member's.
-- ARGV[1] n: events in this batch; ARGV[2] the user's plan and limits of
--   its own, '<plan>\n<limits>' (each '' when none), then optionally
--   '\n<period totals>' ('<field>=<value> ...' as periods.lua keeps them, the user's at the
--   location it leaves: they replace the ones here, see periods.lua; and
--   the model limits' counters as 'm<tag>:<start>_<end>~<total>', see
--   model_limits.lua),
--   then optionally '\n<rollups>': the user's spend rollups there, with the
--   first batch, 'R<pttl of :su> <pttl of :sd> ' then entries
--   '<h|d><length>:<field><length>:<value>' (lengths in bytes): they replace
--   the ones here (budget/lib/rollups.lua);
-- ARGV[3] cancelled '<nonce> <hold end> ...' (see move_out.lua)
-- ARGV[4 .. 3 + 10n] per event: id, at, state, cost, estimate (-1: none;
--   '#<code>' appended: its rollups code, see budget/lib/rollups.lua;
--   then '!<tags>': the model limits it counts under, model_limits.lua),
--   nonce, fingerprint, deadline, op, hold_end (-1: none), as move_out.lua
--   reads them
-- ARGV[4 + 10n ..] export maxlen (0), retention, then the plan table
-- Returns { events added }.

NOCHECK = true
local n = tonumber(ARGV[1])
if not n or n < 0 or n > SLICE then
  return redis.error_reply('TOLLGATE_BAD_MOVE batch size must be 0..100')
end
local tail = 4 + 10 * n
-- The user's plan and limits of its own ('<plan>\n<limits>', each '' when
-- none; a bare plan name from an older mover): what an earlier stay left
-- here goes.
local plan, own, rest = string.match(ARGV[2], '^([^\n]*)\n?([^\n]*)\n?(.*)$')
local periods, rollups = string.match(rest, '^([^\n]*)\n?(.*)$')
if plan ~= '' then
  redis.call('SET', PLAN, plan)
else
  redis.call('DEL', PLAN)
end
if own ~= '' then
  redis.call('SET', BASE .. ':limits', own)
else
  redis.call('DEL', BASE .. ':limits')
end
-- The user's period totals, carried whole (a move's inserts do not count
-- in the user's periods: `period_move`).
local carried, last = {}, 0
for f, stop, t in string.gmatch(periods or '', '([sx]?%d+%-(%d+))=([%d:]+)') do
  carried[#carried + 1] = f
  carried[#carried + 1] = t
  last = math.max(last, tonumber(stop))
end
redis.call('DEL', BASE .. ':p')
if #carried > 0 then
  redis.call('HSET', BASE .. ':p', unpack(carried))
  redis.call('PEXPIREAT', BASE .. ':p', int(last + PERIOD_GRACE))
end
-- The model limits' counters, in the same section as
-- 'm<tag>:<start>_<end>~<total>' (budget/lib/model_limits.lua).
carried, last = {}, 0
for tag, start, stop, t in string.gmatch(periods or '', 'm(%x+):(%d+)_(%d+)~(%d+)') do
  carried[#carried + 1] = tag .. ':' .. start .. '-' .. stop
  carried[#carried + 1] = t
  last = math.max(last, tonumber(stop))
end
redis.call('DEL', BASE .. ':m')
if #carried > 0 then
  redis.call('HSET', BASE .. ':m', unpack(carried))
  redis.call('PEXPIREAT', BASE .. ':m', int(last + PERIOD_GRACE))
end
-- The user's spend rollups, carried whole with the first batch (see the
-- header): an event's code names the dictionary that travels with them.
if string.sub(rollups, 1, 1) == 'R' then
  local ttl_h, ttl_d, i = string.match(rollups, '^R(%-?%d+) (%-?%d+) ()')
  if not i then
    return redis.error_reply('TOLLGATE_BAD_MOVE rollups out of shape')
  end
  local keys = { h = BASE .. ':su', d = BASE .. ':sd' }
  redis.call('DEL', keys.h, keys.d)
  local pairs_of = { h = {}, d = {} }
  -- Entries: '<h|d><field length>:<field><value length>:<value>'.
  local function take(at)
    local len, from = string.match(rollups, '^(%d+):()', at)
    if not len then
      return nil
    end
    local to = from + tonumber(len) - 1
    if to > #rollups then
      return nil
    end
    return string.sub(rollups, from, to), to + 1
  end
  while i <= #rollups do
    local which = string.sub(rollups, i, i)
    local field, after = take(i + 1)
    local value
    if field then
      value, after = take(after)
    end
    if not value or not pairs_of[which] then
      return redis.error_reply('TOLLGATE_BAD_MOVE rollups out of shape')
    end
    local t = pairs_of[which]
    t[#t + 1] = field
    t[#t + 1] = value
    if #t >= 512 then
      redis.call('HSET', keys[which], unpack(t))
      pairs_of[which] = {}
    end
    i = after
  end
  for which, ttl in pairs({ h = tonumber(ttl_h), d = tonumber(ttl_d) }) do
    local t = pairs_of[which]
    if #t > 0 then
      redis.call('HSET', keys[which], unpack(t))
    end
    if ttl > 0 then
      redis.call('PEXPIRE', keys[which], int(ttl))
    end
  end
end
local now, _, org = open_budget(tail)

local c = {}
for w in string.gmatch(ARGV[3], '%S+') do
  c[#c + 1] = w
end
for i = 1, #c - 1, 2 do
  local hold_end = tonumber(c[i + 1])
  if hold_end and hold_end > now then
    redis.call('ZADD', CANCELLED, int(hold_end), c[i])
    if redis.call('PTTL', CANCELLED) < hold_end - now then
      redis.call('PEXPIRE', CANCELLED, int(hold_end - now + 1))
    end
  end
end

local added = 0
for k = 0, n - 1 do
  local b = 3 + 10 * k
  local id, at, state, cost = ARGV[b + 1], tonumber(ARGV[b + 2]), ARGV[b + 3], tonumber(ARGV[b + 4])
  local est, code, m = string.match(ARGV[b + 5], '^(%-?%d+)#?(%d*)!?(%x*)$')
  est, code = tonumber(est), code ~= '' and code or nil
  if m == '' then
    m = nil
  end
  local nonce, fp, deadline = ARGV[b + 6], ARGV[b + 7], tonumber(ARGV[b + 8])
  local op, hold = ARGV[b + 9], tonumber(ARGV[b + 10])
  if not at or not est or not cost or cost < 1 or not deadline or not hold or (state ~= 'r' and state ~= 'h' and state ~= 'j') then
    return redis.error_reply('TOLLGATE_BAD_MOVE event fields out of shape')
  end
  if at > now - RETAIN then
    local ev, slot = find(id)
    if not ev then
      local o = nil
      if state ~= 'r' then
        o = { nonce = nonce, fp = fp, deadline = deadline, op = op }
      end
      insert(id, at, { state = state, cost = cost, estimate = est >= 0 and est or nil, code = code, m = m },
        o, now, slot)
      if state == 'h' and hold >= 0 then
        redis.call('ZADD', HOLDS, int(hold), id)
        redis.call('PEXPIRE', HOLDS, int(RETAIN))
      end
      if org then
        use('org')
        local oev, oslot = find(org_id(id))
        if not oev then
          insert(org_id(id), at, { state = 'r', cost = cost }, nil, now, oslot)
        end
        use('user')
      end
      added = added + 1
    end
  end
end
return { added }
