-- budget/lib/plan.lua: the plan table (ARGV): a user's plan and limits, what a cost can fit,
-- and the alert thresholds of a plan.
-- Part of the budget library's prelude (see budget/lib/state.lua).

-- Reads a plan's alert thresholds ('<bp>:<tokens>:<tokens>,...': per
-- threshold its basis points, then the token count that reaches it in each
-- limit, in the limits' order) into each limit's `marks` ({ bp, at }).
local function alert_marks(limits, text)
  for group in string.gmatch(text, '[^,]+') do
    local bp, k = nil, 0
    for n in string.gmatch(group, '%d+') do
      if not bp then
        bp = tonumber(n)
      else
        k = k + 1
        local l = limits[k]
        if l then
          l.marks = l.marks or {}
          l.marks[#l.marks + 1] = { bp = bp, at = tonumber(n) }
          limits.alerting = true
        end
      end
    end
  end
end

-- Prepaid credits (budget/lib/credits.lua): `spec` the user's plan's limits
-- text as the plan table has it (a user's own limits keep their plan's
-- credits), `g` the grants read this call, `has` whether the user holds a
-- grants' hash (read once a call).
local CREDITS = { spec = '', g = nil, has = nil }

-- Returns the name and limits ({ limit, window } each, longest window first) of
-- the user's plan, reading the export's maxlen from ARGV[i], the table after it.
local function resolve_plan(i)
  EXPORT = tonumber(ARGV[i]) or 0
  PRICE = ''
  RETAIN = tonumber(ARGV[i + 1]) or 0
  read_keeps(i + 2)
  i = read_calendars(i + 3)
  local got
  if SUBJECT == 'user' and not NOCHECK and is_member() then
    got = redis.call('MGET', PLAN, BASE .. ':limits', at_key())
    check_at(got[3])
  else
    got = redis.call('MGET', PLAN, BASE .. ':limits')
  end
  local stored, custom = got[1], got[2]
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
  -- The plan's model limits ('~...', budget/lib/model_limits.lua), kept
  -- with limits of the user's own; a credits plan's spec starts with 'C'
  -- (budget/lib/credits.lua).
  spec = spec or ''
  local tilde = string.find(spec, '~', 1, true)
  if SUBJECT == 'user' then
    model_plan(tilde and string.sub(spec, tilde + 1))
    CREDITS.spec, CREDITS.g, CREDITS.has = spec, nil, nil
  end
  if tilde then
    spec = string.sub(spec, 1, tilde - 1)
  end
  -- The user's own limits (no plan name has a ':').
  if custom then
    name, spec = 'custom:' .. name, custom
  end
  local limits = PARSED[spec]
  if not limits then
    limits = {}
    local bar = string.find(spec, '|', 1, true)
    -- Windows first ({ limit, window }), then periods ({ limit, cal },
    -- window 0): `nw` is the number of windows.
    limits.nw = 0
    for l, p, w in string.gmatch(bar and string.sub(spec, 1, bar - 1) or spec, '(%d+):(p?)(%d+)') do
      if p == 'p' then
        limits[#limits + 1] = { limit = tonumber(l), window = 0, cal = tonumber(w) }
      else
        limits[#limits + 1] = { limit = tonumber(l), window = tonumber(w) }
        limits.nw = limits.nw + 1
      end
    end
    if bar then
      alert_marks(limits, string.sub(spec, bar + 1))
    end
    if PARSED_N >= 64 then
      PARSED, PARSED_N = {}, 0
    end
    PARSED[spec], PARSED_N = limits, PARSED_N + 1
  end
  local longest = limits[1] and limits[1].window or 0
  if RETAIN < longest then
    RETAIN = longest
  end
  FIRST = (limits.nw > 0 and longest >= RETAIN) and 2 or 1
  LIMITS = limits
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

-- Whether `cost` is no cost at all or one `limits` could never admit (past
-- their smallest limit). Answered only where the user lives: at a place it
-- left (a pod's stale idea of where it lives) the caller gets TOLLGATE_MOVED
-- first, not the refusal of a plan or limits the user no longer has there.
-- (A member's place was checked by `resolve_plan`; at the user's own tag the
-- marker is read here, on this refusal's path only.)
local function too_costly(limits, cost)
  if cost and cost >= 1 and cost <= max_cost(limits) then
    return false
  end
  if SUBJECT == 'user' and not NOCHECK and not is_member() then
    check_home(redis.call('HGET', META, 'w'))
  end
  return true
end
