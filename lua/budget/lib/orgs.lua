-- budget/lib/orgs.lua: organisations: a member's call applied to its organisation's budget.
-- Part of the budget library's prelude (see budget/lib/state.lua).

-- A member's organisation. MEMBER: the user (from its keys' names).
local MEMBER = nil

local function org_id(request)
  return request .. '/' .. MEMBER
end

-- Opens the organisation's side of a member's call, after the user's
-- `expire`: resolves the organisation's plan (ARGV from `i`, as
-- `resolve_plan`), brings its windows to now and removes its copies of the
-- charges the user's `expire` released. Returns { name, limits }, or nil for
-- a user in no organisation. Leaves the user's subject in use.
local function org_open(now, i)
  if not is_member() then
    return nil
  end
  MEMBER = string.match(BASE, ':u:([^:]+)$')
  local released = RELEASED or {}
  RELEASED = nil
  use('org')
  local name, limits = resolve_plan(i)
  EXPORT = 0
  expire(now, limits)
  for _, id in ipairs(released) do
    local ev = find(org_id(id))
    if ev then
      remove(ev, 0, now)
    end
  end
  use('user')
  return { name = name, limits = limits }
end

-- The start of a step on the budget (the plan table from ARGV[i]): resolve
-- the plan, expire, then open the organisation. Returns now, what `expire`
-- left used, the organisation (`org_open`), the plan's limits and its name.
local function open_budget(i)
  local name, limits = resolve_plan(i)
  local now = now_ms()
  local used = expire(now, limits)
  return now, used, org_open(now, i), limits, name
end

-- The start of a step that spends `cost` on `request` (the plan table from
-- ARGV[i]): expire, open the organisation, then find the request's event.
-- Returns the reply { -1, max_cost } when the cost can never fit the user's
-- plan or its organisation's (the smaller max_cost of the two), else nil,
-- limits, now, used, org, the event and slot of `find`, and the user's plan
-- name (`resolve_plan`'s).
local function open_spend(request, cost, i)
  local name, limits = resolve_plan(i)
  local most = max_cost(limits)
  if too_costly(limits, cost) then
    return { -1, most }
  end
  local now = now_ms()
  local used = expire(now, limits)
  local org = org_open(now, i)
  if org and cost > max_cost(org.limits) then
    return { -1, math.min(most, max_cost(org.limits)) }
  end
  local ev, slot = find(request)
  return nil, limits, now, used, org, ev, slot, name
end

-- Whether `cost` fits every window of the organisation's plan too.
local function org_fits(org, cost)
  if not org then
    return true
  end
  use('org')
  local ok = fits(org.limits, 0, cost)
  use('user')
  return ok
end

-- Records the organisation's copy of a member's new event.
local function org_record(org, request, cost, now)
  if not org then
    return
  end
  use('org')
  local ev, slot = find(org_id(request))
  if not ev then
    record(org_id(request), cost, now, org.limits, 0, nil, slot)
  end
  use('user')
end

-- Sets (cost >= 1) or removes (0) the organisation's copy of a member's event.
local function org_recost(org, request, cost, now)
  if not org then
    return
  end
  use('org')
  local ev = find(org_id(request))
  if ev and cost == 0 then
    remove(ev, 0, now)
  elseif ev and ev.cost ~= cost then
    recost(ev, cost, now)
  end
  use('user')
end

-- Appends the organisation's plan name and windows (see push_windows; with
-- `cost`: its retry_after per window) to a member's reply.
local function org_windows(out, org, now, cost)
  if not org then
    return out
  end
  use('org')
  out[#out + 1] = org.name
  push_windows(out, org.limits, 0, now, cost)
  use('user')
  return out
end
