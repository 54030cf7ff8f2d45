-- credits.lua: a user's prepaid credits: add a grant, or read the balance
-- (see budget/lib/credits.lua for the keys and what a charge draws).
-- KEYS[1] plan, KEYS[2] holds, KEYS[3] audit, KEYS[4] log, KEYS[5] meta,
-- KEYS[6] cancelled
--   (see budget/lib/state.lua)
-- ARGV[1] 'grant' or 'show'
-- ARGV[2] the grant's amount (integer 1 to 2^53 - 1; show: '0')
-- ARGV[3] its expiry (ms; '0': never; show: '0')
-- ARGV[4] its idempotency key (1 to 64 of [A-Za-z0-9._-]; show: '')
-- ARGV[5..] export maxlen, retention, then the plan table (budget/lib/state.lua)
-- Returns one of
--   { 1, grant, now_ms, balance... }   granted now (show: grant 0)
--   { 2, grant, now_ms, balance... }   the key names this very grant already
--   { 3, amount, expires_ms }          the key names another grant: nothing changed
--   { 4, now_ms }                      the expiry is not after now: nothing changed
--   { 5, max }                         the user holds `max` grants already
--   { -2 }                             a grant to a member of an organisation,
--                                      which holds no credits (show: balance 0)
-- balance: see CREDITS.push. Expired grants go (exported) in either step.

local op, amount, expires, key = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4]
if (op ~= 'grant' and op ~= 'show') or not amount or not expires
    or (op == 'grant' and (amount < 1 or amount > 9007199254740991 or amount % 1 ~= 0 or expires < 0
      or not string.match(key, '^[%w%._%-]+$') or #key > 64)) then
  return redis.error_reply('credits: bad op, amount, expiry or key')
end
resolve_plan(5)
local now = now_ms()
if is_member() then
  -- A member holds no credits: its balance is 0, a grant refused.
  return op == 'show' and { 1, 0, now, 0, 0 } or { -2 }
end
check_home(redis.call('HGET', META, 'w'))
CREDITS.load(now)
if op == 'show' then
  return CREDITS.push({ 1, 0, now })
end
local seen = redis.call('HGET', BASE .. ':ck', key)
if seen then
  local n, a, e = string.match(seen, '^(%d+) (%d+) (%d+)$')
  if tonumber(a) ~= amount or tonumber(e) ~= expires then
    return { 3, tonumber(a), tonumber(e) }
  end
  return CREDITS.push({ 2, tonumber(n), now })
end
if expires ~= 0 and expires <= now then
  return { 4, now }
end
local held = 0
for _ in pairs(CREDITS.g) do
  held = held + 1
end
if held >= 64 then
  return { 5, 64 }
end
local n = redis.call('HINCRBY', CREDITS.key(), 'n', 1)
CREDITS.g[n] = { n = n, rem = amount, exp = expires, last = now, key = key, dirty = true }
CREDITS.balance = CREDITS.balance + amount
CREDITS.save()
redis.call('HSET', BASE .. ':ck', key, int(n) .. ' ' .. int(amount) .. ' ' .. int(expires))
export('credit_grant', key, amount, expires, n)
return CREDITS.push({ 1, n, now })
