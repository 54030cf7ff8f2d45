-- A job's record for its owner only: KEYS[1] the job's hash, ARGV[1] the
-- caller. Anyone else gets what a missing job gets (an empty reply), after the
-- same work (one field read), so neither the answer nor its time says whether
-- the id is someone else's. Read only; decides nothing.
if redis.call('HGET', KEYS[1], 'user') ~= ARGV[1] then
  return {}
end
return redis.call('HGETALL', KEYS[1])
