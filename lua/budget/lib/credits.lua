-- budget/lib/credits.lua: prepaid credits (crates/tollgate-core/src/credits.rs):
-- a user's grants, drawn by the charges of a plan with `credits = "only"`
-- in the same step as its windows and periods.
-- Part of the budget library's prelude (see budget/lib/state.lua); CREDITS
-- is declared in budget/lib/plan.lua (`resolve_plan` sets its `spec`: the
-- user's plan's limits text, which starts with 'C' for a credits plan).
--
-- Keys, in the user's hash tag beside its budget:
--   '<base>:c'        hash: 'n' the last grant number; 'g<n>' per grant held:
--                     '<remaining> <expires_ms (0: never)> <last_ms> <key>',
--                     last_ms the last time a charge drew from it. A grant
--                     with nothing left stays a retention after that (a
--                     refund may give back to it), then goes; an expired
--                     one goes when a step reads it (exported
--                     'credit_expire' with what it still held).
--   '<base>:ck'       hash: idempotency key -> '<n> <amount> <expires_ms>'.
--   '<base>:cd:<day>' hash per day (UTC) a charge was spent in: request id
--                     (packed as the log packs it: `pack_id`) -> what it drew, '<n>:<amount>' space separated in
--                     drawing order. Expires a retention after the day
--                     ends: no live charge is older.
-- Every change is exported (with [export]): kind credit_grant | credit_draw
-- | credit_return | credit_expire | credit_uncovered, id (the charge's
-- request id; a grant's key), cost (the amount), prev (the grant number;
-- 0 for uncovered), at (the charge's time; a grant's expiry).
-- Credits are the user's own: a member of an organisation (its budget
-- under the organisation's tag) holds none, and a credits plan refuses its
-- charges; a move's steps (NOCHECK) leave them alone.

local CREDIT_DAY = 86400000

-- Whether this call's subject is a user drawing on credits.
function CREDITS.on()
  return SUBJECT == 'user' and not NOCHECK and string.sub(CREDITS.spec, 1, 1) == 'C'
end

function CREDITS.key()
  return BASE .. ':c'
end

function CREDITS.drawn_key(at)
  return BASE .. ':cd:' .. int(math.floor(at / CREDIT_DAY))
end

-- Reads the grants (once per call), dropping the expired ones (exported)
-- and the spent ones no live charge can give back to. CREDITS.g: the
-- grants held, by number; CREDITS.balance.
function CREDITS.load(now)
  if CREDITS.g then
    return
  end
  local got = redis.call('HGETALL', CREDITS.key())
  local g, gone, balance = {}, {}, 0
  for j = 1, #got, 2 do
    local n = tonumber(string.match(got[j], '^g(%d+)$'))
    if n then
      local rem, exp, last, key = string.match(got[j + 1], '^(%d+) (%d+) (%d+) (.*)$')
      rem, exp, last = tonumber(rem), tonumber(exp), tonumber(last)
      if exp ~= 0 and exp <= now then
        if rem > 0 then
          export('credit_expire', key, rem, exp, n)
        end
        gone[#gone + 1] = got[j]
      elseif rem == 0 and last + RETAIN < now then
        gone[#gone + 1] = got[j]
      else
        g[n] = { n = n, rem = rem, exp = exp, last = last, key = key }
        balance = balance + rem
      end
    end
  end
  if #gone > 0 then
    redis.call('HDEL', CREDITS.key(), unpack(gone))
  end
  CREDITS.g, CREDITS.balance = g, balance
end

-- Writes the grants this call changed.
function CREDITS.save()
  local args = {}
  for n, c in pairs(CREDITS.g) do
    if c.dirty then
      c.dirty = false
      args[#args + 1] = 'g' .. int(n)
      args[#args + 1] = int(c.rem) .. ' ' .. int(c.exp) .. ' ' .. int(c.last) .. ' ' .. c.key
    end
  end
  if #args > 0 then
    redis.call('HSET', CREDITS.key(), unpack(args))
  end
end

-- The grants with something left, in drawing order: earliest expiry first,
-- one that never expires last, then the older first.
function CREDITS.ordered()
  local list = {}
  for _, c in pairs(CREDITS.g) do
    if c.rem > 0 then
      list[#list + 1] = c
    end
  end
  table.sort(list, function(a, b)
    local ea, eb = a.exp == 0 and math.huge or a.exp, b.exp == 0 and math.huge or b.exp
    if ea ~= eb then
      return ea < eb
    end
    return a.n < b.n
  end)
  return list
end

-- Before a new charge of `cost`: nil when credits do not apply or cover
-- it, else the balance (the charge is refused: 402).
function CREDITS.short(cost, now)
  CREDITS.g = nil
  if not CREDITS.on() then
    return nil
  end
  if is_member() then
    return 0
  end
  CREDITS.load(now)
  if CREDITS.balance < cost then
    CREDITS.save()
    return CREDITS.balance
  end
  return nil
end

-- Draws up to `cost` for the charge `request` spent at `at` (appended to
-- its record; `new`: a new charge, which has none yet); returns what was
-- drawn.
function CREDITS.draw(request, cost, at, now, new)
  CREDITS.load(now)
  local need, parts = cost, {}
  for _, c in ipairs(CREDITS.ordered()) do
    if need == 0 then
      break
    end
    local take = math.min(c.rem, need)
    c.rem, c.last, c.dirty = c.rem - take, now, true
    need = need - take
    parts[#parts + 1] = int(c.n) .. ':' .. int(take)
    export('credit_draw', request, take, at, c.n)
  end
  CREDITS.balance = CREDITS.balance - (cost - need)
  CREDITS.save()
  if #parts > 0 then
    local key = CREDITS.drawn_key(at)
    local old = not new and redis.call('HGET', key, pack_id(request))
    redis.call('HSET', key, pack_id(request), old and (old .. ' ' .. table.concat(parts, ' ')) or table.concat(parts, ' '))
    redis.call('PEXPIREAT', key, int((math.floor(at / CREDIT_DAY) + 1) * CREDIT_DAY + RETAIN + CREDIT_DAY))
  end
  return cost - need
end

-- A new charge recorded (`record`): it draws its cost.
function CREDITS.charged(request, cost, at, now)
  if CREDITS.on() and not is_member() then
    CREDITS.draw(request, cost, at, now, true)
  end
end

-- Whether the user was ever granted credits (its grants' hash never goes):
-- only then can a charge have drawn. Read once a call, so that a settle or
-- refund of a user without credits costs one EXISTS.
function CREDITS.held()
  if CREDITS.has == nil then
    CREDITS.has = CREDITS.g ~= nil or redis.call('EXISTS', CREDITS.key()) == 1
  end
  return CREDITS.has
end

-- Gives what the charge `request` (spent at `at`) drew past `keep` back to
-- the grants it drew from, the last drawn first (keep 0: the charge is
-- gone). A grant that expired since keeps nothing.
function CREDITS.give(request, at, keep, now)
  if SUBJECT ~= 'user' or NOCHECK or is_member() or not CREDITS.held() then
    return
  end
  local key = CREDITS.drawn_key(at)
  local rec = redis.call('HGET', key, pack_id(request))
  if not rec then
    return
  end
  CREDITS.g = nil
  CREDITS.load(now)
  local parts = {}
  for n, a in string.gmatch(rec, '(%d+):(%d+)') do
    parts[#parts + 1] = { tonumber(n), tonumber(a) }
  end
  local drawn = 0
  for _, p in ipairs(parts) do
    drawn = drawn + p[2]
  end
  local left = drawn - keep
  for j = #parts, 1, -1 do
    if left <= 0 then
      break
    end
    local p = parts[j]
    local back = math.min(p[2], left)
    p[2], left = p[2] - back, left - back
    local c = CREDITS.g[p[1]]
    if c and back > 0 then
      c.rem, c.dirty = c.rem + back, true
      CREDITS.balance = CREDITS.balance + back
      export('credit_return', request, back, at, p[1])
    end
  end
  CREDITS.save()
  local kept = {}
  for _, p in ipairs(parts) do
    if p[2] > 0 then
      kept[#kept + 1] = int(p[1]) .. ':' .. int(p[2])
    end
  end
  if #kept > 0 then
    redis.call('HSET', key, pack_id(request), table.concat(kept, ' '))
  else
    redis.call('HDEL', key, pack_id(request))
  end
end

-- A charge's cost set from `previous` to `cost` (`recost`): a credits
-- charge gives the difference back, or draws it; what the balance cannot
-- cover is exported as uncovered (the upstream did the work: the charge
-- keeps its cost, the balance stays at zero).
function CREDITS.recost(request, at, previous, cost, now)
  if cost < previous then
    -- What it drew past its new cost (an uncovered part goes first).
    CREDITS.give(request, at, cost, now)
  elseif cost > previous and SUBJECT == 'user' and not NOCHECK and not is_member() and CREDITS.held()
      and redis.call('HEXISTS', CREDITS.drawn_key(at), pack_id(request)) == 1 then
    CREDITS.g = nil
    local drawn = CREDITS.draw(request, cost - previous, at, now)
    if drawn < cost - previous then
      export('credit_uncovered', request, cost - previous - drawn, at, 0)
    end
  end
end

-- The reply's balance: { balance, count, n, remaining, expires... }
-- appended to `out`, in drawing order.
function CREDITS.push(out)
  local list = CREDITS.ordered()
  out[#out + 1] = CREDITS.balance
  out[#out + 1] = #list
  for _, c in ipairs(list) do
    out[#out + 1] = c.n
    out[#out + 1] = c.rem
    out[#out + 1] = c.exp
  end
  return out
end
