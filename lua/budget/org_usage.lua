-- org_usage.lua: an organisation's budget: its plan and windows (the running
-- totals, brought to now). Its members' events are theirs (usage.lua).
-- KEYS[1..6] the organisation's budget keys (see budget/lib/state.lua)
-- ARGV[1..] export maxlen, retention, then the plan table (budget/lib/state.lua)
-- Returns { plan, now_ms, windows... } (see push_windows in budget/lib/state.lua).

SUBJECT, NOCHECK = 'org', true
local name, limits = resolve_plan(1)
EXPORT = 0
local now = now_ms()
expire(now, limits)
return push_windows({ name, now }, limits, 0, now)
