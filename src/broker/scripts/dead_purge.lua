-- (The broker prepends `#!lua` and checks.lua: src/broker/mod.rs, `sources`.)
-- dead_purge.lua: remove dead-letter records (kmqd dead purge).
--
-- KEYS[1] dead list, KEYS[2] stats hash
-- ARGV: the records, each its exact bytes as LRANGE read it
-- Returns one integer per record: 1 removed, 0 not found (it left the dead list since it was read).
--
-- Records are addressed by their bytes, never by their index, because daemons LPUSH new ones meanwhile: LREM
-- of the exact value, count -1: from the tail, where `kmqd dead purge` reads its pages (src/broker/dead.rs), so
-- the scan finds the record near where it starts instead of crossing the whole list (dead_max may be 10^8).
-- Checks before it writes: the keys' types and the stats hash's `purged`; a call that fails writes nothing.
local wrong_type = type_check('dead_purge.lua')
local integer = integer_check('dead_purge.lua')
local refused = wrong_type(KEYS[1], 'list') or wrong_type(KEYS[2], 'hash') or
  integer(KEYS[2], 'purged', redis.call('HGET', KEYS[2], 'purged'))
if refused then return refused end
local removed = 0
local result = {}
for i = 1, #ARGV do
  local n = redis.call('LREM', KEYS[1], -1, ARGV[i])
  removed = removed + n
  result[i] = n
end
if removed > 0 then
  redis.call('HINCRBY', KEYS[2], 'purged', removed)
end
return result
