-- budget/lib/codec.lua: the packed forms of the log's records and the index's values.
-- Part of the budget library's prelude (see budget/lib/state.lua).

-- Hex text <-> bytes, 8 hex digits (4 bytes) at a time where they can be.
local function unhex(h)
  local out, i = {}, 1
  while i + 7 <= #h do
    out[#out + 1] = struct.pack('>I4', tonumber(string.sub(h, i, i + 7), 16))
    i = i + 8
  end
  for j = i, #h - 1, 2 do
    out[#out + 1] = string.char(tonumber(string.sub(h, j, j + 1), 16))
  end
  return table.concat(out)
end

local function tohex(s)
  local out, i = {}, 1
  while i + 3 <= #s do
    out[#out + 1] = string.format('%08x', (struct.unpack('>I4', string.sub(s, i, i + 3))))
    i = i + 4
  end
  for j = i, #s do
    out[#out + 1] = string.format('%02x', string.byte(s, j))
  end
  return table.concat(out)
end

-- The packed request id: 'u' + 16 bytes (a lowercase UUID), 'i' + 16 bytes
-- ('idem-' + 32 lowercase hex), else 'x' + its length + the id.
-- A lowercase UUID; 'idem-' and 32 lowercase hex digits. (Literal: a function
-- library's top level has no string library.)
local UUID = '^[0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f]%-[0-9a-f][0-9a-f][0-9a-f][0-9a-f]%-[0-9a-f][0-9a-f][0-9a-f][0-9a-f]%-[0-9a-f][0-9a-f][0-9a-f][0-9a-f]%-'
  .. '[0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f]$'
local IDEM = '^idem%-[0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f]'
  .. '[0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f]$'

local function hex(s, i, j)
  return tonumber(string.sub(s, i, j), 16)
end

local function pack_id(id)
  if #id == 36 and string.find(id, UUID) then
    return 'u' .. struct.pack('>I4I2I2I2I2I4', hex(id, 1, 8), hex(id, 10, 13), hex(id, 15, 18),
      hex(id, 20, 23), hex(id, 25, 28), hex(id, 29, 36))
  end
  if #id == 37 and string.find(id, IDEM) then
    return 'i' .. struct.pack('>I4I4I4I4', hex(id, 6, 13), hex(id, 14, 21), hex(id, 22, 29), hex(id, 30, 37))
  end
  return 'x' .. string.char(#id) .. id
end

-- The request id at the start of a packed record, and the position after it.
local function unpack_id(r)
  local tag = string.sub(r, 1, 1)
  if tag == 'u' then
    return string.format('%08x-%04x-%04x-%04x-%04x%08x', struct.unpack('>I4I2I2I2I2I4', r, 2)), 18
  elseif tag == 'i' then
    return string.format('idem-%08x%08x%08x%08x', struct.unpack('>I4I4I4I4', r, 2)), 18
  end
  local n = string.byte(r, 2)
  return string.sub(r, 3, 2 + n), 3 + n
end

-- A nonce or fingerprint, packed: its length byte (+128: lowercase hex, packed).
local function pack_token(s)
  if #s % 2 == 0 and #s <= 254 and not string.find(s, '[^0-9a-f]') then
    return string.char(128 + #s / 2) .. unhex(s)
  end
  return string.char(#s) .. s
end

local function unpack_token(r, i)
  local n = string.byte(r, i)
  if n >= 128 then
    return tohex(string.sub(r, i + 1, i + n - 128)), i + 1 + n - 128
  end
  return string.sub(r, i + 1, i + n), i + 1 + n
end

-- The record of the log: id, and for a charge nonce, fp, deadline, op. An
-- organisation's: the request id packed, then the user ('<request>/<user>').
local function pack_record(id, o)
  if SUBJECT == 'org' then
    local request, user = string.match(id, '^([^/]+)/(.+)$')
    return pack_id(request) .. user
  end
  local r = pack_id(id)
  if o then
    r = r .. pack_token(o.nonce) .. pack_token(o.fp) .. struct.pack('>I6', o.deadline) .. o.op
  end
  return r
end

local function unpack_record(r)
  local id, i = unpack_id(r)
  if SUBJECT == 'org' then
    local user = string.sub(r, i)
    return { id = id .. '/' .. user, request = id, user = user }
  end
  local rec = { id = id }
  if i <= #r then
    rec.nonce, i = unpack_token(r, i)
    rec.fp, i = unpack_token(r, i)
    rec.deadline = struct.unpack('>I6', string.sub(r, i, i + 5))
    rec.op = string.sub(r, i + 6)
  end
  return rec
end

-- An index value: { at, seq, state, cost, estimate, real, code }: `at` and
-- `seq` name its log entry; `real`, only for an event moved in with its past
-- time behind later ones (see MOVED), the time it was spent; `code`, its
-- dimensions' code in the spend rollups (its digits, a string: no number to
-- format; budget/lib/rollups.lua; absent: the
-- event counts in none).
local function pack_value(ev)
  local v = struct.pack('>I6', ev.at) .. ev.state .. int(ev.seq) .. ' ' .. int(ev.cost)
  if ev.estimate then
    v = v .. ' ' .. int(ev.estimate)
  end
  if ev.real then
    v = v .. ' @' .. int(ev.real)
  end
  if ev.code then
    v = v .. '#' .. ev.code
  end
  if ev.m then
    v = v .. '!' .. ev.m
  end
  return v
end

local function unpack_value(v)
  -- '!<tags>': the model limits it counted under (budget/lib/model_limits.lua).
  local bang, m = string.find(v, '!', 8, true), nil
  if bang then
    m = string.sub(v, bang + 1)
    v = string.sub(v, 1, bang - 1)
  end
  local rest, code = string.match(string.sub(v, 8), '^([^#]*)#?(%d*)$')
  local seq, cost, est, real = string.match(rest, '^(%d+) (%d+) ?(%d*) ?@?(%d*)$')
  return { at = struct.unpack('>I6', string.sub(v, 1, 6)), state = string.sub(v, 7, 7),
    seq = tonumber(seq), cost = tonumber(cost), estimate = tonumber(est), real = tonumber(real),
    code = code ~= '' and code or nil, m = m }
end

-- When an event was spent (its log entry's time, or a moved one's real time).
local function spent(ev)
  return ev.real or ev.at
end
