-- budget/lib/model_limits.lua: the counters of a plan's model limits
-- (`[plans.X] model_limits`: at most so much spent on the models a pattern
-- names, per calendar period), checked in the same step as the plan's
-- other limits.
-- Part of the budget library's prelude (see budget/lib/state.lua).
--
-- The plan table names them after the limits ('~' then
-- '<limit>:p<calendar>:<tag>' each, comma separated; the tag, 8 hex digits,
-- names the pattern and the calendar: tollgate_core::config::ModelLimit).
-- The caller decides which of them a charge counts under (it knows the
-- model the request named and the sheet entry that priced it) and passes
-- their tags (charge.lua); the user's plan decides which of those are
-- limits here.
--
-- Each counter is one field of the hash '<base>:m' (the user's hash tag):
-- '<tag>:<start_ms>-<end_ms>' -> total, the spend of the period that starts
-- and ends there. A charge adds its cost to the current period of each
-- model limit it counts under, and keeps their tags with its event
-- (`pack_value`: '!<tags>'); a settle, refund, release or a hold's end
-- changes the counter of each of its tags whose period holds the time the
-- charge was spent, if it is still kept (a period that ended is gone:
-- nothing current changes). The fields of periods that ended are dropped
-- when a field for a new period is made; the key expires PERIOD_GRACE after
-- the end of the latest period it counts. Only the user's own steps count
-- (not its organisation's copies, not a move's steps: move_in.lua carries
-- the hash whole).

-- The model limits of the user's plan ({ limit, cal, tag }; nil: none),
-- those this call counts under or shows (ACTIVE, each with its `field`,
-- `start`, `stop` and `total` once loaded; nil: none).
local MODELS, ACTIVE = nil, nil

local function models_key()
  return BASE .. ':m'
end

-- Reads the plan table's model limits ('<limit>:p<cal>:<tag>,...'; nil:
-- none) of the user's plan: called by `resolve_plan` on every call.
local function model_plan(text)
  MODELS, ACTIVE = nil, nil
  if not text or text == '' then
    return
  end
  MODELS = {}
  for l, c, t in string.gmatch(text, '(%d+):p(%d+):(%x+)') do
    MODELS[#MODELS + 1] = { limit = tonumber(l), cal = tonumber(c), tag = t }
  end
end

-- Picks the model limits of the user's plan that this call counts under
-- (`tags`: their tags, concatenated, from the caller; '*': all of them, to
-- show) and reads their current periods' totals (one HMGET). A time outside
-- the boundaries passed is refused as `load_periods` refuses it.
local function model_select(tags, now)
  ACTIVE = nil
  if not MODELS or not tags or tags == '' then
    return
  end
  local fields = {}
  for _, m in ipairs(MODELS) do
    if tags == '*' or string.find(tags, m.tag, 1, true) then
      local cal = CALS[m.cal]
      if not (cal and cal[4]) or now < cal[1] or now >= cal[4] then
        error({ err = 'TOLLGATE_PERIOD ' .. int(now)
          .. ' the ledger clock is outside the period boundaries passed: call again with boundaries around it' })
      end
      if now < cal[2] then
        m.start, m.stop = cal[1], cal[2]
      elseif now < cal[3] then
        m.start, m.stop = cal[2], cal[3]
      else
        m.start, m.stop = cal[3], cal[4]
      end
      m.field = m.tag .. ':' .. int(m.start) .. '-' .. int(m.stop)
      ACTIVE = ACTIVE or {}
      ACTIVE[#ACTIVE + 1] = m
      fields[#fields + 1] = m.field
    end
  end
  if ACTIVE then
    local got = redis.call('HMGET', models_key(), unpack(fields))
    for j, m in ipairs(ACTIVE) do
      m.total = tonumber(got[j])
    end
  end
end

-- Whether `cost` fits every model limit this call counts under.
local function model_fits(cost)
  for _, m in ipairs(ACTIVE or {}) do
    if (m.total or 0) + cost > m.limit then
      return false
    end
  end
  return true
end

-- How many windows `push_model_windows` appends (the user's only).
local function model_count()
  if SUBJECT ~= 'user' or not ACTIVE then
    return 0
  end
  return #ACTIVE
end

-- Appends each model limit of this call as `push_windows` does a period's,
-- its start as '<start_ms> <tag>' (the caller names the pattern by its tag).
local function push_model_windows(out, now, cost)
  if model_count() == 0 then
    return
  end
  for _, m in ipairs(ACTIVE) do
    local used = m.total or 0
    out[#out + 1] = used
    out[#out + 1] = m.limit
    out[#out + 1] = m.stop - m.start
    out[#out + 1] = m.stop - now
    out[#out + 1] = (cost and used + cost > m.limit) and (m.stop - now) or 0
    out[#out + 1] = int(m.start) .. ' ' .. m.tag
  end
end

-- Counts a new charge of `cost` in the current period of each model limit
-- this call counts under; returns their tags (for its event), or nil.
local function model_record(cost, now)
  if not ACTIVE or SUBJECT ~= 'user' or NOCHECK then
    return nil
  end
  local key, tags, new = models_key(), {}, false
  for _, m in ipairs(ACTIVE) do
    new = new or not m.total
    m.total = redis.call('HINCRBY', key, m.field, cost)
    tags[#tags + 1] = m.tag
  end
  if new then
    -- A new period's field: the ended ones go (budget/lib/periods.lua).
    drop_ended(key, '^%x+:%d+%-(%d+)$', now, 0)
  end
  return table.concat(tags)
end

-- Counts `delta` (a cost's change) of an event spent at `at` that counted
-- under the model limits of `tags` (its '!<tags>') in each of their
-- counters whose period holds `at`.
local function model_move(tags, at, delta)
  if not tags or tags == '' or delta == 0 or SUBJECT ~= 'user' or NOCHECK then
    return
  end
  local key = models_key()
  local got = redis.call('HGETALL', key)
  for j = 1, #got, 2 do
    local tag, start, stop = string.match(got[j], '^(%x+):(%d+)%-(%d+)$')
    if tag and at >= tonumber(start) and at < tonumber(stop) then
      for k = 1, #tags - 7, 8 do
        if string.sub(tags, k, k + 7) == tag then
          local t = math.max((tonumber(got[j + 1]) or 0) + delta, 0)
          redis.call('HSET', key, got[j], int(t))
          for _, m in ipairs(ACTIVE or {}) do
            if m.field == got[j] then
              m.total = t
            end
          end
        end
      end
    end
  end
end
