-- throttle_position.lua: where a waiting call stands in a provider's queue
-- (`GET /v1/jobs/{id}` of a job waiting for its slot). Reads only.
-- KEYS[1] queue    list: the FIFO tickets (see throttle_grant.lua)
-- KEYS[2] waiting  hash: ticket -> "<deadline_us> <inbox channel>"
-- KEYS[3] tickets, KEYS[4] capped, KEYS[5] tags (throttle/lib/fair.lua)
-- KEYS[6] lists    set: the throttlers that may hold tickets popped from the
--                  queue (<base>:processing:<throttler>): served first (FIFO)
-- KEYS[7] bucket   the token bucket (throttle/lib/bucket.lua): paused, it grants nothing
--                  before its `at`
-- ARGV[1] the call's request id (its tickets are "<request id>~<hex>.<hex>")
-- ARGV[2] 'fair' or 'fifo': the provider's queue
-- ARGV[3] the user of the call (fair)
-- ARGV[4] the provider's key base
-- ARGV[5] most tickets looked at (the scan is O(that))
-- Returns { ahead, others_ahead, users, weight, paused_us } or {} when no waited-for
-- ticket of the request (and, fair, of the user) is found among ARGV[5]
-- tickets: ahead, the calls of its user served before it (FIFO: every call);
-- others_ahead, the calls of other users served before it as the queue stands
-- (FIFO: 0); users, the users waiting; weight, its user's share; paused_us,
-- how long the bucket still grants nothing (an upstream's refusal, 0: none).

local QUEUE, WAITING = KEYS[1], KEYS[2]
local F = { tickets = KEYS[3], capped = KEYS[4], tags = KEYS[5], waiting = WAITING,
  base = ARGV[4] }
local id, mode, user, limit = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[5])
if id == '' or not limit or limit < 1 or not F.base or F.base == '' then
  return redis.error_reply('throttle_position: bad arguments')
end
-- µs until the bucket's `at` (throttle/lib/bucket.lua), when it is ahead of Redis TIME.
local function paused()
  local at = tonumber(redis.call('HGET', KEYS[7], 'at'))
  return at and math.max(0, at - now_us()) or 0
end
local prefix = id .. '~'
local n = #prefix

-- A ticket of exactly this request: the prefix, then the waiter's suffix
-- (an id may contain '~', the suffix cannot), and its weight on a provider
-- with other limits (throttle/lib/bucket.lua).
local function ours(ticket)
  return string.sub(ticket, 1, n) == prefix
    and string.find(string.sub(ticket, n + 1), '^%x+%.%x+%*?%d*$') ~= nil
    and redis.call('HEXISTS', WAITING, ticket) == 1
end

if mode ~= 'fair' then
  -- The tickets throttlers popped come first, then the queue.
  local ahead = 0
  for _, member in ipairs(redis.call('SMEMBERS', KEYS[6])) do
    for _, ticket in ipairs(redis.call('LRANGE', F.base .. ':processing:' .. member, 0, limit - 1)) do
      if ours(ticket) then
        return { ahead, 0, 1, 1, paused() }
      end
      ahead = ahead + 1
    end
  end
  for i, ticket in ipairs(redis.call('LRANGE', QUEUE, 0, limit - 1)) do
    if ours(ticket) then
      return { ahead + i - 1, 0, 1, 1, paused() }
    end
  end
  return {}
end
-- Fair: the ticket, found by its request id (the member is
-- "<stamp><ticket>"), among the provider's tickets or its user's parked ones.
local pattern = string.rep('?', STAMP) .. string.gsub(id, '[%*%?%[%]\\]', '\\%0') .. '~*'
local function find(key)
  local cursor, looked = '0', 0
  repeat
    local r = redis.call('ZSCAN', key, cursor, 'MATCH', pattern, 'COUNT', 1000)
    cursor = r[1]
    for i = 1, #r[2], 2 do
      local member = r[2][i]
      if ours(string.sub(member, STAMP + 1)) then
        return member, tonumber(r[2][i + 1])
      end
    end
    looked = looked + 1000
  until cursor == '0' or looked >= limit
  return nil
end
local member, tag = find(F.tickets)
local parked = false
if not member then
  member, tag = find(parked_key(F.base, user))
  parked = member ~= nil
end
if not member then
  return {}
end
local _, _, _, weight, _, _, owner = fair_parse(redis.call('HGET', WAITING, string.sub(member, STAMP + 1)))
if owner ~= user then
  return {}
end
-- Its user's tickets are spaced 1/weight apart up to the user's finish tag:
-- those behind it are (finish - tag) * weight - 1, the rest are ahead.
local state = redis.call('HMGET', F.tags, user, ':n')
local count, finish = 1, tag + 1 / weight
if state[1] then
  local sp = string.find(state[1], ' ', 1, true)
  count, finish = tonumber(string.sub(state[1], 1, sp - 1)), tonumber(string.sub(state[1], sp + 1))
end
local behind = math.floor((finish - tag) * weight + 0.5) - 1
local ahead = math.max(0, math.min(count - 1, count - 1 - behind))
-- Tickets served before it as the queue stands: the lesser tags (of a parked
-- ticket: the ones below its tag, then the user's parked ones ahead of it).
local before
if parked then
  before = redis.call('ZCOUNT', F.tickets, '-inf', '(' .. float(tag))
    + redis.call('ZRANK', parked_key(F.base, user), member)
else
  before = redis.call('ZRANK', F.tickets, member)
end
return { ahead, math.max(0, before - ahead), tonumber(state[2]) or 0, weight, paused() }
