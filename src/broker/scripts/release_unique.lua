-- (The broker prepends `#!lua` and checks.lua: src/broker/mod.rs, `sources`.)
-- release_unique.lua: default mode. Release the unique ids an owner popped and never settled: it died (found by
-- a monitor after its lease expired), or it stopped with tasks it could not hand back.
--
-- KEYS[1] unique hash, KEYS[2] unique-popped hash (id -> owner)
-- ARGV[1] owner, ARGV[2 ..] candidate ids (read from KEYS[2] by the caller; each is checked again here)
-- Returns how many ids were released.
-- Checks before it writes: the keys' types; a call that fails writes nothing.
local wrong_type = type_check('release_unique.lua')
local refused = wrong_type(KEYS[1], 'hash') or wrong_type(KEYS[2], 'hash')
if refused then return refused end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local released = 0
for i = 2, #ARGV do
  if redis.call('HGET', KEYS[2], ARGV[i]) == ARGV[1] then
    redis.call('HDEL', KEYS[2], ARGV[i])
    free_unique_id(KEYS[1], ARGV[i], now, true)
    released = released + 1
  end
end
return released
