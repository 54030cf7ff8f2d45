-- activity_record.lua: one pod's buffered notes for the operations dashboard
-- (tollgate_core::activity), written at once. Observational only: nothing here
-- decides a budget, a bucket or a job. Every key is capped and expires when
-- idle, so the log never grows without bound.
-- KEYS[1] events    list: spend events (JSON, as the pod encoded them), newest first
-- KEYS[2] refunded  sorted set: spend key -> when its refund was noted (ms, Redis TIME)
-- KEYS[3] grants    hash: provider -> grants counted
-- KEYS[4] answers   hash: "<provider> <class>" -> upstream answers counted
-- KEYS[5] denials   hash: operation ('(plain reserve)' for a plain one) -> denials counted
-- KEYS[6] denied    list: "<at_ms> <user>[ <operation>]" of the newest denials (Redis TIME)
-- KEYS[7] calls     hash: operation ('(plain reserve)' for a plain one) -> new charges counted
-- KEYS[8] timelines hash: job id -> its steps, one "<at_ms> <user> <step>" per line
-- KEYS[9] timeline_order  list: the timelines' ids, newest first (the oldest goes past the cap)
-- KEYS[10] failed   list: "<at_ms> <id> <user> <operation> <cause>" of the newest job failures
-- KEYS[11..] waits  one list per provider: "<at_ms> <waited_us>", newest first
-- ARGV[1] events cap (also the refund marks' cap), ARGV[2] waits cap,
-- ARGV[3] idle ttl in ms, ARGV[4] denied cap, ARGV[5] timelines cap,
-- ARGV[6] steps kept per timeline, ARGV[7] failures cap
-- ARGV[8..] notes, each one of:
--   "e <json>"                               a spend event
--   "r <spend key>"                          its refund
--   "g <i> <provider> <at_ms> <waited_us>"   a grant; its waits list is KEYS[10 + i]
--   "d <user>[ <operation>]"                 a budget denial (no operation: a plain reserve)
--   "a <provider> <class>"                   an upstream answer
--   "j <id> <at_ms> <user> <step>"           a step of job <id>'s timeline
--     (tollgate_core::activity::JobStep::encode); a "failed <operation>
--     <cause> ..." step is also listed among the failures
-- Returns the number of notes written (a malformed note is skipped).
-- Every key gets one write per flush (a counter: one per field), however many
-- notes it holds.

local events_cap, waits_cap, idle = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local denied_cap = tonumber(ARGV[4])
local timelines_cap, steps_cap, failed_cap = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
if not events_cap or events_cap < 1 or not waits_cap or waits_cap < 1 or not idle or idle < 1
  or not denied_cap or denied_cap < 1 or not timelines_cap or timelines_cap < 1
  or not steps_cap or steps_cap < 1 or not failed_cap or failed_cap < 1 then
  return redis.error_reply('activity_record: bad caps or idle ttl')
end
local WAITS = 10
local CALLS, TIMELINES, ORDER, FAILED = KEYS[7], KEYS[8], KEYS[9], KEYS[10]

-- The notes are gathered first, then written per key.
local now_ms = time_ms()
local written = 0
-- pushes[k]: values LPUSHed to KEYS[k], in the notes' order.
local pushes = {}
local function push(k, v)
  local list = pushes[k]
  if not list then
    list = {}
    pushes[k] = list
  end
  list[#list + 1] = v
end
-- counts[k][field]: HINCRBY of KEYS[k]; fields[k]: their first-seen order.
local counts, fields = {}, {}
local function count(k, field)
  local c = counts[k]
  if not c then
    c = {}
    counts[k] = c
    fields[k] = {}
  end
  if not c[field] then
    c[field] = 0
    local f = fields[k]
    f[#f + 1] = field
  end
  c[field] = c[field] + 1
end
local refunds = {}
local steps_of, jobs = {}, {}
for i = 8, #ARGV do
  local kind, rest = string.match(ARGV[i], '^(%a) (.+)$')
  if kind == 'e' then
    push(1, rest)
    -- The operation as the pod's JSON encoder wrote it (an unescaped key,
    -- which no string value can imitate); decoded only when escaped.
    local op = string.match(rest, '[{,]"operation":"([^"\\]+)"')
    if not op then
      local ok, spend = pcall(cjson.decode, rest)
      op = ok and type(spend) == 'table' and spend.operation
    end
    count(7, type(op) == 'string' and op or '(plain reserve)')
    written = written + 1
  elseif kind == 'j' then
    local id, line = string.match(rest, '^(%S+) (%d+ %S+ %a.*)$')
    if id then
      -- A job's steps of one flush are written together (below).
      local lines = steps_of[id]
      if not lines then
        lines = {}
        steps_of[id] = lines
        jobs[#jobs + 1] = id
      end
      lines[#lines + 1] = line
      local at, user, op, cause = string.match(line, '^(%d+) (%S+) failed (%S+) (%S+)')
      if at then
        push(10, at .. ' ' .. id .. ' ' .. user .. ' ' .. op .. ' ' .. cause)
      end
      written = written + 1
    end
  elseif kind == 'r' then
    refunds[#refunds + 1] = now_ms
    refunds[#refunds + 1] = rest
    written = written + 1
  elseif kind == 'g' then
    local idx, provider, at, waited = string.match(rest, '^(%d+) (%S+) (%d+) (%d+)$')
    idx = tonumber(idx)
    if idx and idx >= 1 and WAITS + idx <= #KEYS then
      count(3, provider)
      push(WAITS + idx, at .. ' ' .. waited)
      written = written + 1
    end
  elseif kind == 'd' then
    local user, operation = string.match(rest, '^(%S+) ?(%S*)$')
    if user then
      count(5, operation ~= '' and operation or '(plain reserve)')
      push(6, now_ms .. ' ' .. rest)
      written = written + 1
    end
  elseif kind == 'a' then
    if string.match(rest, '^%S+ %S+$') then
      count(4, rest)
      written = written + 1
    end
  end
end

local touched = {}
for k, list in pairs(pushes) do
  redis.call('LPUSH', KEYS[k], unpack(list))
  touched[k] = true
end
for k, order in pairs(fields) do
  local c = counts[k]
  for _, field in ipairs(order) do
    redis.call('HINCRBY', KEYS[k], field, c[field])
  end
  touched[k] = true
end
if #refunds > 0 then
  redis.call('ZADD', KEYS[2], unpack(refunds))
  touched[2] = true
end
-- The timelines: one read and one write for all the flush's jobs. A job
-- seen for the first time joins the order list; past its cap, the oldest
-- go, with their steps.
if #jobs > 0 then
  local old = redis.call('HMGET', TIMELINES, unpack(jobs))
  local set, new = {}, {}
  for i, id in ipairs(jobs) do
    local steps = old[i]
    local kept, n = {}, 0
    if steps then
      local _, breaks = string.gsub(steps, '\n', '')
      n = breaks + 1
      kept[1] = steps
    end
    for _, line in ipairs(steps_of[id]) do
      if n < steps_cap then
        kept[#kept + 1] = line
        n = n + 1
      end
    end
    if not steps then
      new[#new + 1] = id
    end
    if not steps or #kept > 1 then
      set[#set + 1] = id
      set[#set + 1] = table.concat(kept, '\n')
    end
  end
  if #set > 0 then
    redis.call('HSET', TIMELINES, unpack(set))
  end
  if #new > 0 then
    local len = redis.call('LPUSH', ORDER, unpack(new))
    if len > timelines_cap then
      local gone = redis.call('RPOP', ORDER, len - timelines_cap)
      if type(gone) == 'table' and #gone > 0 then
        redis.call('HDEL', TIMELINES, unpack(gone))
      end
    end
  end
  touched[8] = true
  touched[9] = true
end
if touched[1] then
  redis.call('LTRIM', KEYS[1], 0, events_cap - 1)
end
if touched[2] then
  redis.call('ZREMRANGEBYRANK', KEYS[2], 0, -(events_cap + 1))
end
if touched[6] then
  redis.call('LTRIM', KEYS[6], 0, denied_cap - 1)
end
if touched[10] then
  redis.call('LTRIM', FAILED, 0, failed_cap - 1)
end
for k in pairs(touched) do
  if k > WAITS then
    redis.call('LTRIM', KEYS[k], 0, waits_cap - 1)
  end
  redis.call('PEXPIRE', KEYS[k], idle)
end
return written
