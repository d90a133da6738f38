#!lua
-- dead_purge.lua: remove dead-letter records (kmqd dead purge).
--
-- KEYS[1] dead list, KEYS[2] stats hash
-- ARGV: the records, each its exact bytes as LRANGE read it
-- Returns one integer per record: 1 removed, 0 not found (it left the dead list since it was read).
--
-- Records are addressed by their bytes, never by their index, because daemons LPUSH new ones meanwhile: LREM
-- of the exact value, count 1.
local removed = 0
local result = {}
for i = 1, #ARGV do
  local n = redis.call('LREM', KEYS[1], 1, ARGV[i])
  removed = removed + n
  result[i] = n
end
if removed > 0 then
  redis.call('HINCRBY', KEYS[2], 'purged', removed)
end
return result
