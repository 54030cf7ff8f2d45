-- session_open.lua: stores a new dashboard session (see crates/tollgate-redis/src/sessions.rs).
-- KEYS[1] the session's hash (named by the SHA-256 of its id)
-- ARGV[1] role (admin|viewer), ARGV[2] CSRF token, ARGV[3] credential digest,
-- ARGV[4] lifetime (ms), ARGV[5] idle timeout (ms)
-- Returns the session's expiry (ms since the epoch, Redis TIME), or an error
-- when the id is already in use (nothing written).

local role, csrf, credential = ARGV[1], ARGV[2], ARGV[3]
local lifetime, idle = tonumber(ARGV[4]), tonumber(ARGV[5])
if (role ~= 'admin' and role ~= 'viewer') or csrf == '' or credential == ''
    or not lifetime or lifetime < 1 or not idle or idle < 1 then
  return redis.error_reply('session_open: bad arguments')
end
if redis.call('EXISTS', KEYS[1]) == 1 then
  return redis.error_reply('session_open: id in use')
end
local now_ms = time_ms()
local expires = now_ms + lifetime
redis.call('HSET', KEYS[1], 'role', role, 'csrf', csrf, 'credential', credential,
  'expires_ms', tostring(expires))
redis.call('PEXPIRE', KEYS[1], math.min(idle, lifetime))
return expires
