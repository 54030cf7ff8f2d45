-- throttle_position.lua: where a waiting call stands in a provider's queue
-- (`GET /v1/jobs/{id}` of a job waiting for its slot). Reads only.
-- KEYS[1] queue    list: the FIFO tickets (see throttle_grant.lua)
-- KEYS[2] waiting  hash: ticket -> "<deadline_us> <inbox channel>"
-- KEYS[3] active, KEYS[4] capped, KEYS[5] idle, KEYS[6] fair, KEYS[7] shares
--   (lib/fair.lua)
-- KEYS[8] lists    set: the throttlers that may hold tickets popped from the
--                  queue (<base>:processing:<throttler>): served first (FIFO)
-- ARGV[1] the call's request id (its tickets are "<request id>~<hex>.<hex>")
-- ARGV[2] 'fair' or 'fifo': the provider's queue
-- ARGV[3] the user (fair: its queue is <base>:fq:<user>)
-- ARGV[4] the provider's key base
-- ARGV[5] most tickets looked at (the scan is O(that))
-- Returns { ahead, users_ahead, users, weight } or {} when no waited-for
-- ticket of the request is among the first ARGV[5] of its queue.

local QUEUE, WAITING = KEYS[1], KEYS[2]
local F = { active = KEYS[3], capped = KEYS[4], idle = KEYS[5], fair = KEYS[6],
  shares = KEYS[7], base = ARGV[4] }
local id, mode, user, limit = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[5])
if id == '' or not limit or limit < 1 or not F.base or F.base == '' then
  return redis.error_reply('throttle_position: bad arguments')
end
local prefix = id .. '~'
local n = #prefix

-- A ticket of exactly this request: the prefix, then the waiter's suffix
-- (an id may contain '~', the suffix cannot).
local function ours(ticket)
  return string.sub(ticket, 1, n) == prefix
    and string.find(string.sub(ticket, n + 1), '^%x+%.%x+$') ~= nil
    and redis.call('HEXISTS', WAITING, ticket) == 1
end

if mode ~= 'fair' then
  -- The tickets throttlers popped come first, then the queue.
  local ahead = 0
  for _, member in ipairs(redis.call('SMEMBERS', KEYS[8])) do
    for _, ticket in ipairs(redis.call('LRANGE', F.base .. ':processing:' .. member, 0, limit - 1)) do
      if ours(ticket) then
        return { ahead, 0, 1, 1 }
      end
      ahead = ahead + 1
    end
  end
  for i, ticket in ipairs(redis.call('LRANGE', QUEUE, 0, limit - 1)) do
    if ours(ticket) then
      return { ahead + i - 1, 0, 1, 1 }
    end
  end
  return {}
end
for i, ticket in ipairs(redis.call('LRANGE', fq_key(F.base, user), 0, limit - 1)) do
  if ours(ticket) then
    local rank = redis.call('ZRANK', F.active, user)
    local active = redis.call('ZCARD', F.active)
    local weight = fair_share(F, user)
    return { i - 1, rank or active, active + redis.call('ZCARD', F.capped), weight }
  end
end
return {}
