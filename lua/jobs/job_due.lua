-- job_due.lua: the members of a time-scored set that are due, for maintenance.
-- KEYS[1] a sorted set scored in ms (leases or releases)
-- ARGV[1] age (ms): due when score <= now - age, ARGV[2] most ids returned
-- Returns the due ids, oldest first.

local SET, age, limit = KEYS[1], tonumber(ARGV[1]), tonumber(ARGV[2])
if not age or age < 0 or not limit or limit < 1 then
  return redis.error_reply('job_due: bad age or limit')
end
return redis.call('ZRANGE', SET, '-inf', int(now_ms() - age), 'BYSCORE', 'LIMIT', 0, int(limit))
