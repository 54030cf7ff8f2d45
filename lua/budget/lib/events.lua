-- budget/lib/events.lua: recording, re-costing and removing events; what fits; retry_after.
-- Part of the budget library's prelude (see budget/lib/state.lua).

-- Whether `cost` fits every limit (`used`: ignored, see window_used).
local function fits(limits, used, cost)
  for k, l in ipairs(limits) do
    if window_used(k, used) + cost > l.limit then
      return false
    end
  end
  return true
end

-- Walks the log from `start` (an XRANGE bound) adding the live events' costs
-- to `freed` until they reach `need`: the exact retry_after (ms after `now`)
-- is when that event leaves a window of `window` ms. Reads at most WORK
-- entries: where it runs out, answers 'more <bound> <freed> <need>', which the
-- caller passes to `retry.lua` to go on (a slice per call). Terminates within
-- the log because cost <= limit; answers a full window if the totals and the
-- log disagree.
local function retry_walk(window, need, freed, start, now)
  while true do
    local n = math.min(BATCH, WORK)
    if n <= 0 then
      return 'more ' .. start .. ' ' .. int(freed) .. ' ' .. int(need)
    end
    local batch = redis.call('XRANGE', LOG, start, '+', 'COUNT', n)
    spend(#batch)
    for _, e in ipairs(batch) do
      local ev = at_entry(e[1], e[2][2])
      -- A moved event (MOVED) is not in time order here: leaving it out
      -- only ever answers later, never too early.
      if ev and not ev.real then
        freed = freed + ev.cost
        if freed >= need then
          return ev.at + window - now
        end
      end
    end
    if #batch < n then
      return window
    end
    start = '(' .. batch[#batch][1]
  end
end

-- The exact retry_after of a cost in limit k's window: walk its oldest events
-- until their costs free enough room (0: it fits). See `retry_walk`.
local function retry_after(k, l, used, cost, now)
  local need = window_used(k, used) + cost - l.limit
  if need <= 0 then
    return 0
  end
  if l.cal then
    -- Nothing leaves a period before it ends.
    return l.stop - now
  end
  return retry_walk(l.window, need, 0, int(now - l.window + 1), now)
end

-- Appends to `out` the number of limits, then per limit: used, limit, window_ms,
-- reset_after_ms (until its oldest event leaves it; -1 when none is in it) and
-- retry_after_ms (with `cost`: until that cost fits it; else 0; or, when the
-- walk to it ran out of this call's slice, the text 'more <bound> <freed>
-- <need>': the caller goes on with `retry.lua`), and the period's start (-1:
-- a trailing window). A period's window_ms is its length, its reset_after_ms
-- until it ends.
local function push_windows(out, limits, used, now, cost)
  out[#out + 1] = #limits + model_count()
  for k, l in ipairs(limits) do
    if l.cal then
      out[#out + 1] = window_used(k, used)
      out[#out + 1] = l.limit
      out[#out + 1] = l.stop - l.start
      out[#out + 1] = l.stop - now
      out[#out + 1] = cost and retry_after(k, l, used, cost, now) or 0
      out[#out + 1] = l.start
    else
      local oldest = redis.call('XRANGE', LOG, k < FIRST and '-' or int(now - l.window + 1), '+', 'COUNT', 1)
      local reset = -1
      if #oldest > 0 then
        reset = tonumber(string.match(oldest[1][1], '^(%d+)')) + l.window - now
      end
      out[#out + 1] = window_used(k, used)
      out[#out + 1] = l.limit
      out[#out + 1] = l.window
      out[#out + 1] = reset
      out[#out + 1] = cost and retry_after(k, l, used, cost, now) or 0
      out[#out + 1] = -1
    end
  end
  push_model_windows(out, now, cost)
  return out
end

-- Removes one live event (from `find`); returns the longest window's total
-- after (`used`: ignored, see window_used). `forced`: exported as an
-- operator's forced correction (settle.lua).
local function remove(ev, _used, now, forced)
  local before = snapshot()
  if #SHORTS > 0 or EXPORT > 0 then
    unshort(spent(ev), ev.cost, now)
    export('refund', ev.rec.id, ev.cost, spent(ev), nil, nil, forced)
  end
  period_move(spent(ev), -ev.cost)
  model_move(ev.m, spent(ev), -ev.cost)
  rollup(spent(ev), ev.code, -ev.cost, now)
  CREDITS.give(ev.rec.id, spent(ev), 0, now)
  drop(ev)
  redis.call('ZREM', HOLDS, ev.rec.id)
  TOTAL = TOTAL - ev.cost
  local used = write_total(now)
  lowered(before, spent(ev), now)
  return used
end

-- Sets a live event's cost (from `find`; >= 1) in every window it is inside;
-- returns the longest window's total after.
local function recost(ev, cost, now)
  local before = snapshot()
  local previous = ev.cost
  if #SHORTS > 0 or EXPORT > 0 then
    unshort(spent(ev), previous - cost, now)
    export('settle', ev.rec.id, cost, spent(ev), previous)
  end
  period_move(spent(ev), cost - previous)
  model_move(ev.m, spent(ev), cost - previous)
  rollup(spent(ev), ev.code, cost - previous, now)
  CREDITS.recost(ev.rec.id, spent(ev), previous, cost, now)
  ev.cost = cost
  update(ev)
  TOTAL = TOTAL - previous + cost
  local used = write_total(now)
  if cost < previous then
    lowered(before, spent(ev), now)
  else
    crossed(before, now)
  end
  return used
end

-- Records a spend event of `cost` at `now` (inside every window); `o`: the
-- owner of a charge (nonce, deadline, op, fp), held by its submission; `slot`:
-- where `find` answered the id goes. The keys expire with it, so an idle user
-- leaves nothing behind. Returns the total and the event's time: now, or the
-- log's last time if the clock went back. (`limits`, `used`: ignored.)
local function record(request, cost, now, limits, used, o, slot)
  local before = snapshot()
  local packed = pack_record(request, o)
  local sid = redis.pcall('XADD', LOG, int(now) .. '-*', 'r', packed)
  if type(sid) ~= 'string' then
    sid = redis.call('XADD', LOG, '*', 'r', packed)
  end
  local ms, seq = string.match(sid, '^(%d+)-(%d+)$')
  local ev = { at = tonumber(ms), seq = tonumber(seq), state = o and 'h' or 'r', cost = cost,
    code = dims_code(), m = model_record(cost, now) }
  if slot.kept < now + 2 * RETAIN then
    local at = int(now + 2 * RETAIN + slack())
    redis.call('HSET', slot.key, '~', at, slot.field, pack_value(ev))
    redis.call('PEXPIREAT', slot.key, at)
  else
    redis.call('HSET', slot.key, slot.field, pack_value(ev))
  end
  export('spend', request, cost, ev.at, nil, o and o.op)
  CREDITS.charged(request, cost, ev.at, now)
  for _, s in ipairs(SHORTS) do
    s.total = s.total + cost
  end
  period_move(nil, cost)
  rollup(ev.at, ev.code, cost, now)
  TOTAL = TOTAL + cost
  -- A log this entry started has no expiry yet, whatever meta says.
  if grow(now) == 1 then
    KEPT = 0
  end
  used = write_total(now)
  if o then
    redis.call('PEXPIRE', HOLDS, int(RETAIN))
  end
  crossed(before, now)
  return used, ev.at
end

-- Inserts an event moved in from another location (a user moving between
-- organisations), after `expire`, with the time `at` it was spent (inside the
-- retention): appended to the log in time order when nothing later is there,
-- else appended now and kept in MOVED by its real time, so that it still
-- leaves each window at `at`. Counted in every window it is still inside.
-- `ev`: { state, cost, estimate }; `o`: a charge's owner record; `slot`: from
-- `find`.
local function insert(request, at, ev, o, now, slot)
  local packed = pack_record(request, o)
  local sid = redis.pcall('XADD', LOG, int(at) .. '-*', 'r', packed)
  if type(sid) ~= 'string' then
    sid = redis.pcall('XADD', LOG, int(now) .. '-*', 'r', packed)
    if type(sid) ~= 'string' then
      sid = redis.call('XADD', LOG, '*', 'r', packed)
    end
    ev.real = at
    if not MV then
      -- After `expire` every window's moved walk starts at its edge.
      MV = {}
      for k, s in ipairs(SHORTS) do
        MV[k] = now - s.window
      end
    end
    redis.call('ZADD', moved_key(), int(at), request)
  end
  local ms, seq = string.match(sid, '^(%d+)-(%d+)$')
  ev.at, ev.seq = tonumber(ms), tonumber(seq)
  local keep_until = int(now + 2 * RETAIN + slack())
  redis.call('HSET', slot.key, '~', keep_until, slot.field, pack_value(ev))
  redis.call('PEXPIREAT', slot.key, keep_until)
  for _, s in ipairs(SHORTS) do
    -- After `expire` nothing in (cursor, now - window] is left to subtract
    -- (its walk may leave the cursor behind when it found nothing): move it
    -- up, so that an event appended in order that already left the window
    -- is not subtracted later.
    if s.cursor < now - s.window then
      s.cursor = now - s.window
    end
    if at > now - s.window then
      s.total = s.total + ev.cost
    end
  end
  period_move(at, ev.cost, true)
  TOTAL = TOTAL + ev.cost
  grow(now)
  KEPT = 0
  write_total(now)
  if ev.real then
    redis.call('PEXPIREAT', moved_key(), int(KEPT))
  end
end
