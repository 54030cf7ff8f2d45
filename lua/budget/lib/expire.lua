-- budget/lib/expire.lua: bringing every window to now: events that left, holds that ended.
-- Part of the budget library's prelude (see budget/lib/state.lua).

-- Saves the totals and answers TOLLGATE_AGAIN: this call read its SLICE of
-- the log before every window reached `now`. What it did is kept, and
-- consistent (each window's total matches its cursor), so the next call goes
-- on from there; the caller calls again.
local function again(now, what)
  write_total(now)
  error({ err = 'TOLLGATE_AGAIN ' .. what .. ': call again' })
end

-- Brings every window to `now`: subtracts what left each window shorter than
-- the retention since its cursor, drops events at or past the retention (time +
-- retention <= now), and releases charges still held past their hold (their
-- submission died before a job claimed them). Each event leaves each window
-- once, so the cost is amortised O(1) per call whatever the number of live
-- events; and no call reads more than SLICE entries of the log: one that would
-- (a whole log leaving at once after a quiet spell, a plan's new window being
-- rebuilt) keeps its progress and answers TOLLGATE_AGAIN (see `again`). The
-- windows are caught up in that order, so an event is dropped or released only
-- once every window's total has seen it leave. Sets TOTAL; returns the plan's
-- longest window's total.
local function expire(now, limits)
  local used, shorts, changed = read_total()
  TOTAL = used
  repoint(now)
  load_shorts(shorts, limits)
  load_periods(now, limits)
  changed = changed or SHORTS_STALE
  local behind = false
  for _, s in ipairs(SHORTS) do
    local edge = now - s.window
    if edge > s.cursor then
      local left, stop, out = sum_slice(int(s.cursor + 1), int(edge))
      local cursor = edge
      if stop then
        -- The rest of the last millisecond read (a cursor is a millisecond).
        cursor = tonumber(string.match(stop, '^(%d+)'))
        local rest = redis.call('XRANGE', LOG, '(' .. stop, int(cursor))
        spend(#rest)
        for _, e in ipairs(rest) do
          local ev = at_entry(e[1], e[2][2])
          if ev and not ev.real then
            left = left + ev.cost
          end
        end
      elseif out then
        cursor = s.cursor
      end
      behind = behind or out
      if left > 0 or cursor ~= s.cursor and out then
        s.total, s.cursor, changed = s.total - left, cursor, true
      end
    end
  end
  if MV then
    -- Windows rebuilt from the log start their moved walk over.
    if SHORTS_STALE or #MV ~= #SHORTS then
      for k = 1, #SHORTS do
        MV[k] = 0
      end
      changed = true
    end
    for k, s in ipairs(SHORTS) do
      local edge = now - s.window
      if edge > MV[k] then
        local left, cursor, out = moved_slice(MV[k], edge)
        behind = behind or out
        if left > 0 or cursor ~= MV[k] then
          s.total, MV[k], changed = s.total - left, cursor, true
        end
      end
    end
  end
  if behind then
    again(now, 'events are leaving a window')
  end
  while MV do
    local n = math.min(BATCH, WORK)
    local ids = redis.call('ZRANGE', moved_key(), '-inf', int(now - RETAIN), 'BYSCORE', 'LIMIT', 0, math.max(n, 1))
    if #ids == 0 then
      if redis.call('EXISTS', moved_key()) == 0 then
        MV = nil
        redis.call('HDEL', META, 'v')
      end
      break
    end
    if n <= 0 then
      again(now, 'moved events are leaving the retention')
    end
    spend(#ids)
    for _, id in ipairs(ids) do
      local ev = find(id)
      if ev and ev.real then
        TOTAL = TOTAL - ev.cost
        drop(ev)
      end
    end
    redis.call('ZREM', moved_key(), unpack(ids))
    changed = true
  end
  while true do
    local n = math.min(BATCH, WORK)
    local batch = redis.call('XRANGE', LOG, '-', int(now - RETAIN), 'COUNT', math.max(n, 1))
    if #batch == 0 then
      break
    end
    if n <= 0 then
      again(now, 'events are leaving the retention')
    end
    spend(#batch)
    local sids = {}
    for _, e in ipairs(batch) do
      local ev = at_entry(e[1], e[2][2])
      if ev then
        TOTAL = TOTAL - ev.cost
        redis.call('HDEL', ev.key, ev.field)
      end
      sids[#sids + 1] = e[1]
    end
    redis.call('XDEL', LOG, unpack(sids))
    changed = true
  end
  while true do
    local n = math.min(BATCH, WORK)
    local ids = redis.call('ZRANGE', HOLDS, '-inf', now, 'BYSCORE', 'LIMIT', 0, math.max(n, 1))
    if #ids == 0 then
      break
    end
    if n <= 0 then
      again(now, 'charges past their hold are being released')
    end
    spend(#ids)
    for _, id in ipairs(ids) do
      local ev = find(id)
      if ev then
        -- A released hold is a refund; an event leaving the window is not a change.
        local before = snapshot()
        TOTAL = TOTAL - ev.cost
        unshort(spent(ev), ev.cost, now)
        period_move(spent(ev), -ev.cost)
        model_move(ev.m, spent(ev), -ev.cost)
        rollup(spent(ev), ev.code, -ev.cost, now)
        export('refund', id, ev.cost, spent(ev))
        CREDITS.give(id, spent(ev), 0, now)
        drop(ev)
        lowered(before, spent(ev), now)
        RELEASED = RELEASED or {}
        RELEASED[#RELEASED + 1] = id
      end
    end
    redis.call('ZREM', HOLDS, unpack(ids))
    changed = true
  end
  if changed then
    write_total(now)
  end
  return longest_used()
end
