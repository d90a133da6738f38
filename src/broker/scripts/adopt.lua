-- (The broker prepends `#!lua` and checks.lua: src/broker/mod.rs, `sources`.)
-- adopt.lua: safe mode. Settles the fate of a claim whose reply was lost (a reset, a stall past the read
-- timeout): either it ran, and its tasks are in its claim lists, or it has not run and never will take anything,
-- because this script raises the owner's floor past the numbers the claim reserved (claim.lua refuses a claim
-- below the floor). Either way the daemon knows exactly what it holds: the caller reads the claim's lists in the
-- same transaction (`MULTI`, this script, `LRANGE` of each list, `EXEC`).
--
-- KEYS[1] owners zset, KEYS[2] the owner's info hash, KEYS[3 .. 2+L] the lost claim's lists (level order)
-- ARGV[1] owner; ARGV[2] the lost claim; ARGV[3] how many numbers it reserved (its most tasks)
-- Returns {now_ms, the owner's journal (see renew.lua)}; fails with "LEASELOST ..." when the owner's lease is
-- gone (its tasks belong to the monitors).
-- Checks before it writes: the keys' types (the claim's lists too, which the caller reads in the transaction) and
-- the info hash's `floor` and `journal` (integers); a call that fails writes nothing (but LEASELOST's putting
-- back of a lost owner as expired, as in claim.lua, which a second call repeats harmlessly).
local wrong_type = type_check('adopt.lua')
local integer = integer_check('adopt.lua')
local refused = wrong_type(KEYS[1], 'zset') or wrong_type(KEYS[2], 'hash')
for i = 3, #KEYS do
  refused = refused or wrong_type(KEYS[i], 'list')
end
if refused then return refused end
local numbers = redis.call('HMGET', KEYS[2], 'floor', 'journal')
refused = integer(KEYS[2], 'floor', numbers[1]) or integer(KEYS[2], 'journal', numbers[2])
if refused then return refused end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lease = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not lease or tonumber(lease) <= now then
  -- As in claim.lua: a registered owner missing from the owners zset goes back in it as expired, for the monitors.
  if not lease and redis.call('EXISTS', KEYS[2]) == 1 then
    redis.call('ZADD', KEYS[1], 0, ARGV[1])
  end
  return redis.error_reply('LEASELOST owner ' .. ARGV[1] .. ' has no live lease')
end
local past = tonumber(ARGV[2]) + math.max(tonumber(ARGV[3]), 1)
local floor = tonumber(numbers[1] or '0')
if past > floor then
  redis.call('HSET', KEYS[2], 'floor', string.format('%d', past))
end
return {now, tonumber(numbers[2] or '0')}
