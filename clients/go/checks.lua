-- checks.lua: the checks a script makes before its first write (ARCHITECTURE.md: a script applies all or
-- nothing), one copy for every script that makes them. The broker prepends this file (src/broker/mod.rs,
-- `sources`) to the scripts it runs and to claim.lua's and pop.lua's preludes, after the `#!lua` that must open a
-- script; push.lua, which producers load as it is (docs/PROTOCOL.md), keeps its own. A script binds them to its
-- name, which every refusal starts with: `local integer = integer_check('renew.lua')`.

-- A check of a counter `script` reads or increments: nil when `value` is an integer (of at most 18 digits) or
-- absent, else the error reply that names the key and field.
local function integer_check(script)
  return function(key, field, value)
    local digits = value and string.match(value, '^-?([1-9]%d*)$')
    if value and value ~= '0' and not (digits and #digits <= 18) then
      return redis.error_reply('ERR ' .. script .. ': ' .. key .. ' field ' .. field .. ' is not an integer (' ..
        string.sub(value, 1, 40) .. '); nothing was written')
    end
  end
end

-- A check of a key `script` may write: nil when `key` is absent or of type `kind`, else the error reply that
-- names it.
local function type_check(script)
  return function(key, kind)
    local found = redis.call('TYPE', key).ok
    if found ~= 'none' and found ~= kind then
      return redis.error_reply('WRONGTYPE ' .. script .. ': ' .. key .. ' is a ' .. found .. ', not a ' .. kind ..
        '; nothing was written')
    end
  end
end
