-- session_touch.lua: reads a live dashboard session and restarts its idle time
-- (never past its lifetime). A session past its lifetime is deleted.
-- KEYS[1] the session's hash
-- ARGV[1] idle timeout (ms)
-- Returns { role, csrf, credential, expires_ms }, or false when there is no
-- live session.

local idle = tonumber(ARGV[1])
if not idle or idle < 1 then
  return redis.error_reply('session_touch: bad idle timeout')
end
local s = redis.call('HMGET', KEYS[1], 'role', 'csrf', 'credential', 'expires_ms')
local expires = tonumber(s[4])
if not s[1] or not expires then
  return false
end
local now_ms = time_ms()
if now_ms >= expires then
  redis.call('DEL', KEYS[1])
  return false
end
redis.call('PEXPIRE', KEYS[1], math.min(idle, expires - now_ms))
return { s[1], s[2], s[3], s[4] }
