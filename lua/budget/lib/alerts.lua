-- budget/lib/alerts.lua: alert thresholds crossed: the subject's outbox and its pointer.
-- Part of the budget library's prelude (see budget/lib/state.lua).

-- The subject of this call's budget, from its keys' hash tag (BASE ends
-- '{u:<user>}'): its kind, its name, and its outbox pointer (BASE after the
-- prefix and schema: the deliverer builds the outbox keys from it).
-- A member's budget is '{o:<org>}:u:<user>', its organisation's '{o:<org>}:org'.
local function subject()
  local pointer = string.match(BASE, '({.*)$') or BASE
  local user = string.match(pointer, '^{u:([^{}]+)}$') or string.match(pointer, '^{o:[^{}]+}:u:([^:{}]+)$')
  if user then
    return 'user', user, pointer
  end
  local org = string.match(pointer, '^{o:([^{}]+)}:org$')
  if org then
    return 'org', org, pointer
  end
  return '?', '', pointer
end

-- Notes that the caller must add this subject's outbox pointer to the due
-- set (`finish`): a member's call may have to add its own and its
-- organisation's.
local function point()
  local _, _, pointer = subject()
  POINTS = POINTS or {}
  for _, p in ipairs(POINTS) do
    if p == pointer then
      return
    end
  end
  POINTS[#POINTS + 1] = pointer
end

-- An alert was queued and no deliverer has looked at the outbox for
-- REPOINT_MS: its caller may have died before adding the outbox's pointer to
-- the due set, so this call's caller adds it (again; adding is idempotent).
local function repoint(now)
  if PENDING and now - PENDING >= REPOINT_MS then
    redis.call('HSET', META, 'a', int(now))
    point()
  end
end

-- Appends an alert to the subject's outbox (keys '<base>:alerts', a hash id ->
-- '<window_ms> <bp> <used> <limit> <at_ms> <kind> <name>' plus 'n:<id>' its
-- attempts, '#' the id counter, '!' alerts dropped when full; and
-- '<base>:alertq', a sorted set id -> when it is due: queued, retried, or its
-- lease's end). Its id is '<kind>:<name>:<at_ms>-<n>'. The caller adds the
-- outbox's pointer to the due set (the reply says so, see `finish`).
local function queue_alert(l, bp, used, now)
  local kind, name = subject()
  local box, due = BASE .. ':alerts', BASE .. ':alertq'
  if redis.call('ZCARD', due) >= OUTBOX_MAX then
    local old = redis.call('ZPOPMIN', due)
    redis.call('HDEL', box, old[1], 'n:' .. old[1])
    redis.call('HINCRBY', box, '!', 1)
  end
  local id = kind .. ':' .. name .. ':' .. int(now) .. '-' .. int(redis.call('HINCRBY', box, '#', 1))
  redis.call('HSET', box, id, int(l.cal and l.stop - l.start or l.window) .. ' ' .. int(bp) .. ' ' .. int(used) .. ' '
    .. int(l.limit) .. ' ' .. int(now) .. ' ' .. kind .. ' ' .. name)
  redis.call('ZADD', due, now, id)
  redis.call('PEXPIRE', box, OUTBOX_TTL)
  redis.call('PEXPIRE', due, OUTBOX_TTL)
  if not PENDING then
    PENDING = now
    redis.call('HSET', META, 'a', int(now))
  end
  point()
end

-- A script's reply, wrapped as { 'TOLLGATE_ALERT', <outbox pointer>...,
-- reply } when the caller must add outbox pointers to the due set (this call
-- queued an alert, or found one no deliverer looked at; see `repoint`): the
-- user's, its organisation's, or both. The ledger unwraps it. Errors pass as
-- they are.
local function finish(r)
  if not POINTS or (type(r) == 'table' and r.err) then
    return r
  end
  local out = { 'TOLLGATE_ALERT' }
  for _, p in ipairs(POINTS) do
    out[#out + 1] = p
  end
  out[#out + 1] = r
  return out
end

-- Tokens spent in limit k's window (after expire). `used`, kept for the
-- scripts' calls, is ignored: the totals are read from TOTAL and SHORTS.
local function window_used(k, _used)
  local l = LIMITS[k]
  if l.cal then
    return period_used(l)
  end
  if k < FIRST then
    return TOTAL
  end
  return SHORTS[k - FIRST + 1].total
end

-- Every window's total, in the plan's order, when its plan has alert
-- thresholds (else nil): taken before a change, for `crossed`.
local function snapshot()
  if not (LIMITS and LIMITS.alerting) then
    return nil
  end
  local t = {}
  for k = 1, #LIMITS do
    t[k] = window_used(k)
  end
  return t
end

-- The thresholds the subject's windows keep crossed (meta's 'q'), one per
-- limit of its plan: { released, till, flags }. A threshold crossed (alerted)
-- is latched (flags[i]) and stays crossed while the window's total plus
-- `released` is at or above it: what releases, refunds and settles down gave
-- back since, until every event it counts would have left the window
-- (`till`, ms). So a total brought back below by a release and up again
-- crosses nothing new; only the window sliding re-arms a threshold (events
-- leaving lower the total, not `released`). One HGET, only on a change that
-- crosses or lowers a total of a plan with thresholds. A plan whose limits
-- changed starts unlatched. (tollgate_core::alerts::Latch: the same.)
local function latches()
  LATCHES = LATCHES or {}
  local q = LATCHES[META]
  if q then
    return q
  end
  q = {}
  local raw = redis.call('HGET', META, 'q')
  local ok = raw ~= false and raw ~= nil
  if ok then
    for r, t, f in string.gmatch(raw, '(%d+):(%d+):([01]*)') do
      local flags = {}
      for i = 1, #f do
        flags[i] = string.sub(f, i, i) == '1'
      end
      q[#q + 1] = { released = tonumber(r), till = tonumber(t), flags = flags }
    end
    ok = #q == #LIMITS
    for k, l in ipairs(LIMITS) do
      ok = ok and #q[k].flags == #(l.marks or {})
    end
  end
  if not ok then
    q = {}
    for k, l in ipairs(LIMITS) do
      local flags = {}
      for i = 1, #(l.marks or {}) do
        flags[i] = false
      end
      q[k] = { released = 0, till = 0, flags = flags }
    end
  end
  LATCHES[META] = q
  return q
end

local function save_latches(q)
  local parts = {}
  for k, c in ipairs(q) do
    local f = {}
    for i, on in ipairs(c.flags) do
      f[i] = on and '1' or '0'
    end
    parts[k] = int(c.released) .. ':' .. int(c.till) .. ':' .. table.concat(f)
  end
  redis.call('HSET', META, 'q', table.concat(parts, ','))
end

-- Forgets what a window's latch counts as given back once every event it
-- counts left the window.
local function lapse(c, now)
  if c.released > 0 and now >= c.till then
    c.released, c.till = 0, 0
  end
end

-- Queues an alert for each threshold a change crossed: a window's total went
-- from below the threshold's tokens (`before`, from `snapshot`) to at or
-- above them, unless the threshold is latched and was left only by what
-- releases gave back (`latches`). Called by `record` and `recost`, where a
-- total goes up, so exactly one call sees each crossing; a total that fell
-- back below by events leaving the window crosses anew when it rises again.
local function crossed(before, now)
  if not before then
    return
  end
  local q = nil
  for k, l in ipairs(LIMITS) do
    if l.marks then
      local after = window_used(k)
      for i, m in ipairs(l.marks) do
        if before[k] < m.at and after >= m.at then
          q = q or latches()
          local c = q[k]
          lapse(c, now)
          if not (c.flags[i] and before[k] + c.released >= m.at) then
            c.flags[i] = true
            q.dirty = true
            queue_alert(l, m.bp, after, now)
          end
        end
      end
    end
  end
  if q and q.dirty then
    q.dirty = nil
    save_latches(q)
  end
end

-- A release, a refund or a settle down of an event spent at `at` lowered
-- the totals from `before` (from `snapshot`): a latched threshold the
-- window's total plus `released` had already fallen below (events left the
-- window) is re-armed; while one stays latched, what this gave back counts
-- in `released` until the event would have left the window.
local function lowered(before, at, now)
  if not before or NOCHECK then
    return
  end
  local q = nil
  for k, l in ipairs(LIMITS) do
    local after = window_used(k)
    if l.marks and after < before[k] then
      q = q or latches()
      local c = q[k]
      lapse(c, now)
      local gross, any = before[k] + c.released, false
      for i, m in ipairs(l.marks) do
        if c.flags[i] and gross < m.at then
          c.flags[i] = false
          q.dirty = true
        end
        any = any or c.flags[i]
      end
      if any then
        c.released = c.released + before[k] - after
        -- A period's: what it gave back counts until the period ends.
        c.till = math.max(c.till, l.cal and l.stop or at + l.window)
        q.dirty = true
      elseif c.released > 0 then
        c.released, c.till = 0, 0
        q.dirty = true
      end
    end
  end
  if q and q.dirty then
    q.dirty = nil
    save_latches(q)
  end
end
