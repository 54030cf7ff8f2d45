-- clock.lua: the time of the scripts that need no other library; the
-- `scripts` module puts it before each of them.

-- Redis TIME, in ms since the epoch.
local function time_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
