-- (The broker prepends checks.lua: src/broker/mod.rs, `sources`.)
-- fire.lua: fire one slot of a periodic task, at most once across all daemons, with no leader and no lock: the
-- schedule's last fired slot only moves forward, and this script is the only writer.
--
-- KEYS[1] schedules hash P:{Q}:schedules (schedule name -> last fired slot, ms), KEYS[2] ready list of the level,
-- KEYS[3] wake list, KEYS[4] stats hash
-- ARGV[1] schedule name, ARGV[2] the slot (ms since the epoch), ARGV[3] the task's envelope
-- Returns {result, now_ms}: result 1 fired; 0 this slot, or a later one, was already fired; -1 the slot is not
-- due yet on Redis's clock.
-- The envelope gets "created_at":NOW_MS as push.lua stamps it (the same function, same rules): only a JSON object
-- without a top-level "created_at" does; anything else is queued byte for byte.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local stamp = '"created_at":' .. string.format('%d', now)
local function stamped(envelope)
  -- An object starts at the first byte that is not JSON whitespace (almost always the first byte)...
  local open = 1
  if string.byte(envelope, 1) ~= 123 then
    open = string.find(envelope, '[^ \t\n\r]')
    if open == nil or string.byte(envelope, open) ~= 123 then
      return envelope
    end
  end
  -- ... and ends at the last one.
  local close = #envelope
  local last = string.byte(envelope, close)
  while last == 32 or last == 9 or last == 10 or last == 13 do
    close = close - 1
    last = string.byte(envelope, close)
  end
  if last ~= 125 then
    return envelope
  end
  -- Then comes its first key, or its end: {} and { } take the stamp without a comma.
  local first = open + 1
  if string.byte(envelope, first) ~= 34 then
    first = string.find(envelope, '[^ \t\n\r]', first)
  end
  local comma = ','
  if first == close then
    comma = ''
  elseif string.byte(envelope, first) ~= 34 then
    return envelope
  elseif string.find(envelope, '"created_at"', first, true) then
    -- Only decoding tells a top-level "created_at" from one in data, in a string or in a longer key; decoding
    -- only then keeps pushes cheap. cjson.decode stops at a NUL byte, which JSON never holds unescaped (it also
    -- takes a few things kmqd's decoder refuses, such as the numbers 01 and nan: those are stamped).
    if string.find(envelope, '\0', first, true) then
      return envelope
    end
    local decoded, object = pcall(cjson.decode, envelope)
    if not decoded or object['created_at'] ~= nil then
      return envelope
    end
  end
  if open == 1 then
    return '{' .. stamp .. comma .. string.sub(envelope, 2)
  end
  return string.sub(envelope, 1, open) .. stamp .. comma .. string.sub(envelope, open + 1)
end
-- Checks before it writes: the keys' types, the schedule's last slot and the stats hash's `pushed` (integers);
-- a call that fails writes nothing.
local wrong_type = type_check('fire.lua')
local integer = integer_check('fire.lua')
local refused = wrong_type(KEYS[1], 'hash') or wrong_type(KEYS[2], 'list') or wrong_type(KEYS[3], 'list') or
  wrong_type(KEYS[4], 'hash')
local fired = false
if not refused then
  fired = redis.call('HGET', KEYS[1], ARGV[1])
  refused = integer(KEYS[1], ARGV[1], fired) or integer(KEYS[4], 'pushed', redis.call('HGET', KEYS[4], 'pushed'))
end
if refused then return refused end
local slot = tonumber(ARGV[2])
if slot > now then
  return {-1, now}
end
local last = tonumber(fired or '-1')
if slot <= last then
  return {0, now}
end
redis.call('HSET', KEYS[1], ARGV[1], string.format('%d', slot))
redis.call('RPUSH', KEYS[2], stamped(ARGV[3]))
redis.call('LPUSH', KEYS[3], 1)
redis.call('LTRIM', KEYS[3], 0, 0)
redis.call('HINCRBY', KEYS[4], 'pushed', 1)
return {1, now}
