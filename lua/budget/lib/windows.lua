-- budget/lib/windows.lua: the running totals of the windows, the export, and dropping an event.
-- Part of the budget library's prelude (see budget/lib/state.lua).

-- The sum of the costs of live events in start..hi (XRANGE bounds), reading
-- at most WORK entries. Returns the sum, and the ID of the last entry read when
-- WORK ran out first (nil: the sum reached hi).
local function sum_slice(start, hi)
  local sum = 0
  while true do
    local n = math.min(BATCH, WORK)
    if n <= 0 then
      return sum, nil, true
    end
    local batch = redis.call('XRANGE', LOG, start, hi, 'COUNT', n)
    spend(#batch)
    for _, e in ipairs(batch) do
      local ev = at_entry(e[1], e[2][2])
      if ev and not ev.real then
        sum = sum + ev.cost
      end
    end
    if #batch < n then
      return sum, nil, false
    end
    start = '(' .. batch[#batch][1]
    if WORK <= 0 then
      return sum, batch[#batch][1], true
    end
  end
end

-- The sum of the costs of the moved events (MOVED) spent in (lo, hi], reading
-- at most WORK of them. Returns the sum, the cursor reached (hi, or short of it
-- when WORK ran out: whole milliseconds only) and whether WORK ran out.
local function moved_slice(lo, hi)
  local n = math.max(math.min(BATCH, WORK), 1)
  local rows = redis.call('ZRANGE', moved_key(), '(' .. int(lo), int(hi), 'BYSCORE', 'LIMIT', 0, n + 1,
    'WITHSCORES')
  local count = #rows / 2
  spend(count)
  local stop, out = nil, false
  if count > n then
    -- Stop before the last millisecond read, unless it is the only one: then
    -- read all of that millisecond.
    local last = tonumber(rows[2 * count])
    if tonumber(rows[2]) == last then
      rows = redis.call('ZRANGE', moved_key(), int(last), int(last), 'BYSCORE', 'WITHSCORES')
      stop = last
    else
      stop = last - 1
    end
    out = true
  end
  local sum = 0
  for i = 1, #rows, 2 do
    local at = tonumber(rows[i + 1])
    if not stop or at <= stop then
      local ev = find(rows[i])
      if ev and ev.real then
        sum = sum + ev.cost
      end
    end
  end
  return sum, stop or hi, out
end

-- Reads the totals of the windows shorter than the retention. A plan whose
-- windows changed (a plan change, or a log written before there were any) has
-- them rebuilt: each starts as the log's total with nothing subtracted yet
-- (cursor 0), and `expire` subtracts what is older than its window, a slice
-- per call. A one-limit plan spanning the retention has none: its next write
-- drops any left.
local function load_shorts(raw, limits)
  SHORTS, SHORTS_STALE = {}, false
  local ok = true
  if raw then
    for w, t, c in string.gmatch(raw, '(%d+) (%-?%d+) (%-?%d+)') do
      SHORTS[#SHORTS + 1] = { window = tonumber(w), total = tonumber(t), cursor = tonumber(c) }
    end
  end
  if #SHORTS ~= limits.nw - FIRST + 1 then
    ok = false
  else
    for k = FIRST, limits.nw do
      if SHORTS[k - FIRST + 1].window ~= limits[k].window then
        ok = false
      end
    end
  end
  if ok then
    return
  end
  SHORTS, SHORTS_STALE = {}, true
  for k = FIRST, limits.nw do
    SHORTS[k - FIRST + 1] = { window = limits[k].window, total = TOTAL, cursor = 0 }
  end
end

-- The running totals: the log's, and the text of the windows'. Reads the
-- bucket table too. Totals that went missing (eviction) are rebuilt from the log a slice per call, the sum so far kept
-- in meta's 'r' ('<sum> <ID of the last entry summed>'); a call that leaves
-- some answers TOLLGATE_AGAIN.
local function read_total()
  local m = redis.call('HMGET', META, 't', 'l', 's', 'x', 'r', 'v', 'w', 'a', 'k')
  check_home(m[7])
  if SUBJECT == 'user' then
    LAST_DIMS, NEW_DIMS = m[9], nil
  end
  SIZE, SPLIT = tonumber(m[2]) or 1, tonumber(m[3]) or 0
  KEPT = tonumber(m[4]) or 0
  PENDING = tonumber(m[8])
  MV = nil
  if m[6] then
    MV = {}
    for c in string.gmatch(m[6], '%-?%d+') do
      MV[#MV + 1] = tonumber(c)
    end
  end
  local raw = m[1]
  if raw then
    local used = tonumber(raw)
    if used then
      return used, nil, false
    end
    local first, rest = string.match(raw, '^(%-?%d+) (.*)$')
    if first then
      return tonumber(first), rest, false
    end
  end
  local sum, start = 0, '-'
  local partial, after = string.match(m[5] or '', '^(%d+) (%d+%-%d+)$')
  if partial then
    sum, start = tonumber(partial), '(' .. after
  end
  local more, stop = sum_slice(start, '+')
  sum = sum + more
  if stop then
    redis.call('HSET', META, 'r', int(sum) .. ' ' .. stop)
    error({ err = 'TOLLGATE_AGAIN rebuilding the totals from the log: call again' })
  end
  if partial then
    redis.call('HDEL', META, 'r')
  end
  return sum, nil, sum > 0
end

-- The total of the plan's first limit: its longest window's, or (a plan of
-- periods only) its longest period's.
local function longest_used()
  local l = LIMITS and LIMITS[1]
  if l and l.cal then
    return period_used(l)
  end
  if FIRST == 1 and SHORTS[1] then
    return SHORTS[1].total
  end
  return TOTAL
end

-- Writes the totals (TOTAL, the windows' and the periods'); returns the
-- longest window's (`longest_used`).
-- Keeps the log and meta a retention past `now` (see KEPT).
local function write_total(now)
  if TOTAL < 0 then
    TOTAL = 0
  end
  local value = int(TOTAL)
  if #SHORTS > 0 then
    local parts = { value }
    for _, s in ipairs(SHORTS) do
      if s.total < 0 then
        s.total = 0
      end
      parts[#parts + 1] = int(s.window) .. ' ' .. int(s.total) .. ' ' .. int(s.cursor)
    end
    value = table.concat(parts, ' ')
  end
  SHORTS_STALE = false
  save_periods(now)
  if MV then
    local parts = { 'm' }
    for k = 1, #SHORTS do
      parts[#parts + 1] = int(MV[k] or 0)
    end
    redis.call('HSET', META, 'v', table.concat(parts, ' '))
  end
  local k = SUBJECT == 'user' and NEW_DIMS
  if k then
    -- The dimensions this call charged under, and their code (`dims_code`).
    LAST_DIMS, NEW_DIMS = k, nil
  end
  if KEPT < now + RETAIN then
    KEPT = now + RETAIN + slack()
    if k then
      redis.call('HSET', META, 't', value, 'x', int(KEPT), 'k', k)
    else
      redis.call('HSET', META, 't', value, 'x', int(KEPT))
    end
    redis.call('PEXPIREAT', LOG, int(KEPT))
    redis.call('PEXPIREAT', META, int(KEPT))
    if MV then
      redis.call('PEXPIREAT', moved_key(), int(KEPT))
    end
  elseif k then
    redis.call('HSET', META, 't', value, 'k', k)
  else
    redis.call('HSET', META, 't', value)
  end
  return longest_used()
end

-- Appends one change to the export stream (when there is one); `forced`: an
-- operator's forced correction, with a field forced '1'. A spend entry of a
-- priced charge carries its prices ('pr'): the export alone rebuilds spend.
local function export(kind, request, cost, at, prev, op, forced)
  if EXPORT > 0 then
    if kind == 'spend' and PRICE ~= '' then
      redis.call('XADD', AUDIT, 'MAXLEN', '~', int(EXPORT), '*', 'kind', kind, 'id', request,
        'cost', int(cost), 'prev', int(prev or 0), 'at', int(at or 0), 'op', op or '', 'pr', PRICE)
    elseif forced then
      redis.call('XADD', AUDIT, 'MAXLEN', '~', int(EXPORT), '*', 'kind', kind, 'id', request,
        'cost', int(cost), 'prev', int(prev or 0), 'at', int(at or 0), 'op', op or '', 'forced', '1')
    else
      redis.call('XADD', AUDIT, 'MAXLEN', '~', int(EXPORT), '*', 'kind', kind, 'id', request,
        'cost', int(cost), 'prev', int(prev or 0), 'at', int(at or 0), 'op', op or '')
    end
  end
end

-- Takes `cost` off every shorter window the event at `at` is still inside.
local function unshort(at, cost, now)
  for _, s in ipairs(SHORTS) do
    if at and at > now - s.window then
      s.total = s.total - cost
    end
  end
end

-- Drops one event from the log and its index (not from the totals).
local function drop(ev)
  redis.call('HDEL', ev.key, ev.field)
  redis.call('XDEL', LOG, entry_id(ev))
  if ev.real then
    redis.call('ZREM', moved_key(), ev.rec.id)
  end
end
