-- job_unstick.lua: an id sits in a live worker's processing list but its job was
-- never leased (the worker's lease script failed after its BLMOVE: a broken
-- connection, a Redis restart): put it back at the head of the queue.
-- KEYS[1] job, KEYS[2] processing (the worker's), KEYS[3] queue
-- ARGV[1] id
-- Only a job still `queued` moves: a leased one is the lease's to finish, and a
-- missing or ended one is a stale entry, dropped from the list. Moving a queued
-- entry is harmless even if the worker leases it meanwhile: the lease script
-- drops a queue entry whose job is not queued.
-- Returns 1 requeued, 0 dropped as stale, -1 left alone (leased, or not listed).

local JOB, PROCESSING, QUEUE, id = KEYS[1], KEYS[2], KEYS[3], ARGV[1]
local state = redis.call('HGET', JOB, 'state')
if state == 'running' then
  return -1
end
if redis.call('LREM', PROCESSING, 1, id) == 0 then
  return -1
end
if state ~= 'queued' then
  return 0
end
redis.call('RPUSH', QUEUE, id)
return 1
