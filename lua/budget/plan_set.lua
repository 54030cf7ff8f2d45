-- plan_set.lua: stores a user's plan name and drops the limits an admin set
-- for the user (budget/lib/state.lua's custom limits): a named plan replaces them.
-- One step, so no budget script sees the new plan with the old override, and
-- an override set at the same moment is either replaced or set after. O(1).
-- KEYS[1] plan    string: the user's plan name
-- KEYS[2] limits  string: the user's own limits, 'limit:window_ms,...'
-- ARGV[1] the plan name (a configured plan: the caller checked)
-- Returns 1 when limits of the user's own were dropped, else 0.
redis.call('SET', KEYS[1], ARGV[1])
return redis.call('DEL', KEYS[2])
