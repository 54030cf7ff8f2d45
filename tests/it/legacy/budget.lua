-- lib/budget.lua: shared by every budget script; the `scripts` module prepends it
-- to reserve.lua, refund.lua, settle.lua and usage.lua before loading them.
--
-- One user's budget lives in five keys sharing the user's hash tag:
--   KEYS[1] events  sorted set: request id -> time (ms) the tokens were spent
--   KEYS[2] costs   hash: request id -> cost, plus the field ':total' (':' never
--                   occurs in a request id): '<used>', the running sum of live
--                   costs (the longest window's), followed for a plan of several
--                   limits by ' <window_ms> <total> <cursor_ms>' per shorter
--                   window, its running total (events at or before the cursor
--                   were subtracted). Every write of a one-limit plan drops them.
--   KEYS[3] plan    string: the user's plan name (absent: the default plan)
--   KEYS[4] owners  hash: request id -> '<state> <nonce> <deadline_ms> <operation>
--                   <fingerprint>[ <estimate>]' for a charge taken by charge.lua
--                   (the estimate once settle.lua settled it), the record of
--                   who owns it: state 'h' (held by its submission: no job has
--                   claimed it yet) or 'j' (owned by its job). A plain reserve has
--                   no entry. An entry leaves with its event.
--   KEYS[5] holds   sorted set: request id -> end of the hold (ms) of each 'h'
--                   charge: its job's deadline plus a grace. A charge still held
--                   then has no job that can run (a job past its deadline never
--                   starts), so the next budget step releases it.
--   KEYS[6] audit   stream: with [export] configured, every spend, refund and
--                   settle, in order (XADD MAXLEN ~): fields kind (spend | refund
--                   | settle), id, cost (settle: the new cost), prev (settle: the
--                   old one), at (when the event was spent, ms), op (spend of a
--                   job's charge). It outlives the window; billing jobs read it.
-- The ARGV tail is the export's maxlen (0: no export), then the plan table as
-- pairs (name, limits), the default plan first; limits is 'limit:window_ms,...',
-- longest window first. The log keeps events for the longest window; a
-- reservation must fit every window.
-- Time is Redis TIME: pod clocks never decide a budget.

local EVENTS, COSTS, PLAN, OWNERS, HOLDS, AUDIT = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local TOTAL = ':total'
local BATCH = 500
-- The shorter windows' running totals ({ window, total, cursor }, in the order of
-- limits[2..]), read by expire; written back with the total.
local SHORTS, SHORTS_STALE = {}, false
-- The export stream's approximate maxlen; 0: no export.
local EXPORT = 0

local function int(n)
  return string.format('%d', n)
end

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- Returns the name and limits ({ limit, window } each, longest window first) of
-- the user's plan, reading the export's maxlen from ARGV[i], the table after it.
local function resolve_plan(i)
  EXPORT = tonumber(ARGV[i]) or 0
  i = i + 1
  local stored = redis.call('GET', PLAN)
  -- No stored plan, or one the config no longer has: the default.
  local name, spec = ARGV[i], ARGV[i + 1]
  if stored then
    for j = i, #ARGV - 1, 2 do
      if ARGV[j] == stored then
        name, spec = ARGV[j], ARGV[j + 1]
        break
      end
    end
  end
  local limits = {}
  for l, w in string.gmatch(spec or '', '(%d+):(%d+)') do
    limits[#limits + 1] = { limit = tonumber(l), window = tonumber(w) }
  end
  return name, limits
end

-- The largest cost the plan could ever admit: its smallest limit.
local function max_cost(limits)
  local m = nil
  for _, l in ipairs(limits) do
    if not m or l.limit < m then
      m = l.limit
    end
  end
  return m or 0
end

-- The sum of the costs of events whose time is in the score range lo..hi.
local function sum_between(lo, hi)
  local sum, offset = 0, 0
  while true do
    local ids = redis.call('ZRANGE', EVENTS, lo, hi, 'BYSCORE', 'LIMIT', offset, BATCH)
    if #ids == 0 then
      break
    end
    for _, c in ipairs(redis.call('HMGET', COSTS, unpack(ids))) do
      if c then
        sum = sum + tonumber(c)
      end
    end
    offset = offset + BATCH
  end
  return sum
end

-- Reads the shorter windows' totals; a plan whose shorter windows changed (or a
-- log written before there were any) has them rebuilt from the log, once. A
-- one-limit plan has none: its next write drops any left by a former plan.
local function load_shorts(raw, limits, now)
  SHORTS, SHORTS_STALE = {}, false
  local ok = true
  if raw then
    for w, t, c in string.gmatch(raw, '(%d+) (%-?%d+) (%-?%d+)') do
      SHORTS[#SHORTS + 1] = { window = tonumber(w), total = tonumber(t), cursor = tonumber(c) }
    end
  end
  if #SHORTS ~= #limits - 1 then
    ok = false
  else
    for k = 2, #limits do
      if SHORTS[k - 1].window ~= limits[k].window then
        ok = false
      end
    end
  end
  if ok then
    return
  end
  SHORTS, SHORTS_STALE = {}, true
  for k = 2, #limits do
    local w = limits[k].window
    SHORTS[k - 1] = { window = w, total = sum_between('(' .. int(now - w), '+inf'), cursor = now - w }
  end
end

-- The running totals: the longest window's, and the text of the shorter ones'.
-- If they went missing (eviction), the longest is rebuilt once from the costs.
local function read_total()
  local raw = redis.call('HGET', COSTS, TOTAL)
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
  local sum = 0
  for _, c in ipairs(redis.call('HVALS', COSTS)) do
    if tonumber(c) then
      sum = sum + tonumber(c)
    end
  end
  return sum, nil, sum > 0
end

-- Writes the totals; with `request`, also that event's cost (one HSET).
local function write_total(used, request, cost)
  if used < 0 then
    used = 0
  end
  local value = int(used)
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
  if request then
    redis.call('HSET', COSTS, TOTAL, value, request, int(cost))
  else
    redis.call('HSET', COSTS, TOTAL, value)
  end
  return used
end

-- Appends one change to the export stream (when there is one).
local function export(kind, request, cost, at, prev, op)
  if EXPORT > 0 then
    redis.call('XADD', AUDIT, 'MAXLEN', '~', int(EXPORT), '*', 'kind', kind, 'id', request,
      'cost', int(cost), 'prev', int(prev or 0), 'at', int(at or 0), 'op', op or '')
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

-- Brings every window to `now`: subtracts what left each shorter window since its
-- cursor, drops events at or past the longest window (time + window <= now), and
-- releases charges still held past their hold (their submission died before a
-- job claimed them). Each event leaves each window once, so the cost is
-- amortised O(log n) per call whatever the number of live events. Returns the
-- longest window's total.
local function expire(now, limits)
  local used, shorts, changed = read_total()
  load_shorts(shorts, limits, now)
  changed = changed or SHORTS_STALE
  for _, s in ipairs(SHORTS) do
    local edge = now - s.window
    if edge > s.cursor then
      local left = sum_between('(' .. int(s.cursor), int(edge))
      if left > 0 then
        s.total, s.cursor, changed = s.total - left, edge, true
      end
    end
  end
  local window = limits[1].window
  for _, source in ipairs({ { EVENTS, now - window, false }, { HOLDS, now, true } }) do
    while true do
      local ids = redis.call('ZRANGE', source[1], '-inf', source[2], 'BYSCORE', 'LIMIT', 0, BATCH)
      if #ids == 0 then
        break
      end
      -- Released holds may still be inside a shorter window; expired events are not.
      local ats = (source[3] and (#SHORTS > 0 or EXPORT > 0))
        and redis.call('ZMSCORE', EVENTS, unpack(ids)) or {}
      for k, c in ipairs(redis.call('HMGET', COSTS, unpack(ids))) do
        if c then
          used = used - tonumber(c)
          unshort(tonumber(ats[k]), tonumber(c), now)
          if source[3] then
            -- A released hold is a refund; an event leaving the window is not a change.
            export('refund', ids[k], tonumber(c), tonumber(ats[k]))
          end
        end
      end
      redis.call('HDEL', COSTS, unpack(ids))
      redis.call('ZREM', EVENTS, unpack(ids))
      redis.call('HDEL', OWNERS, unpack(ids))
      redis.call('ZREM', HOLDS, unpack(ids))
      changed = true
    end
  end
  if changed then
    used = write_total(used)
  end
  return used
end

-- Tokens spent in limit k's window (after expire).
local function window_used(k, used)
  if k == 1 then
    return used
  end
  return SHORTS[k - 1].total
end

-- Whether `cost` fits every limit.
local function fits(limits, used, cost)
  for k, l in ipairs(limits) do
    if window_used(k, used) + cost > l.limit then
      return false
    end
  end
  return true
end

-- The exact retry_after of a cost in limit k's window: walk its oldest events
-- until their costs free enough room (0: it fits). Terminates within the log
-- because cost <= limit; returns a full window if the total and the log disagree.
local function retry_after(k, l, used, cost, now)
  local need, freed, offset = window_used(k, used) + cost - l.limit, 0, 0
  if need <= 0 then
    return 0
  end
  while true do
    local batch = redis.call('ZRANGE', EVENTS, '(' .. int(now - l.window), '+inf', 'BYSCORE',
      'LIMIT', offset, BATCH, 'WITHSCORES')
    if #batch == 0 then
      break
    end
    local ids = {}
    for i = 1, #batch, 2 do
      ids[#ids + 1] = batch[i]
    end
    local costs = redis.call('HMGET', COSTS, unpack(ids))
    for j = 1, #ids do
      freed = freed + (tonumber(costs[j]) or 0)
      if freed >= need then
        return tonumber(batch[2 * j]) + l.window - now
      end
    end
    offset = offset + BATCH
  end
  return l.window
end

-- Appends to `out` the number of limits, then per limit: used, limit, window_ms,
-- reset_after_ms (until its oldest event leaves it; -1 when none is in it) and
-- retry_after_ms (with `cost`: until that cost fits it; else 0).
local function push_windows(out, limits, used, now, cost)
  out[#out + 1] = #limits
  for k, l in ipairs(limits) do
    local oldest
    if k == 1 then
      oldest = redis.call('ZRANGE', EVENTS, 0, 0, 'WITHSCORES')
    else
      oldest = redis.call('ZRANGE', EVENTS, '(' .. int(now - l.window), '+inf', 'BYSCORE',
        'LIMIT', 0, 1, 'WITHSCORES')
    end
    local reset = -1
    if #oldest > 0 then
      reset = tonumber(oldest[2]) + l.window - now
    end
    out[#out + 1] = window_used(k, used)
    out[#out + 1] = l.limit
    out[#out + 1] = l.window
    out[#out + 1] = reset
    out[#out + 1] = cost and retry_after(k, l, used, cost, now) or 0
  end
  return out
end

-- Removes one event; returns its cost, or nil when it is not live.
local function remove(request, used, now)
  local c = redis.call('HGET', COSTS, request)
  if not c then
    return nil, used
  end
  c = tonumber(c)
  if #SHORTS > 0 or EXPORT > 0 then
    local at = tonumber(redis.call('ZSCORE', EVENTS, request))
    unshort(at, c, now)
    export('refund', request, c, at)
  end
  redis.call('HDEL', COSTS, request)
  redis.call('ZREM', EVENTS, request)
  redis.call('HDEL', OWNERS, request)
  redis.call('ZREM', HOLDS, request)
  return c, write_total(used - c)
end

-- The owner record of a charge: state, nonce, deadline, operation, fingerprint,
-- and the estimate of a settled charge.
local function owner(request)
  local o = redis.call('HGET', OWNERS, request)
  if not o then
    return nil
  end
  local state, nonce, deadline, op, fp, est = string.match(o, '^(%S+) (%S+) (%S+) (%S+) (%S+) ?(%d*)$')
  return { state = state, nonce = nonce, deadline = tonumber(deadline), op = op, fp = fp,
    estimate = tonumber(est) }
end

-- Records a spend event of `cost` at `now` (inside every window); the keys
-- expire with it, so an idle user leaves nothing behind.
local function record(request, cost, now, limits, used, op)
  redis.call('ZADD', EVENTS, int(now), request)
  export('spend', request, cost, now, nil, op)
  for _, s in ipairs(SHORTS) do
    s.total = s.total + cost
  end
  used = write_total(used + cost, request, cost)
  for _, key in ipairs({ EVENTS, COSTS, OWNERS, HOLDS }) do
    redis.call('PEXPIRE', key, int(limits[1].window))
  end
  return used
end
