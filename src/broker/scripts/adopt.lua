#!lua
-- adopt.lua: safe mode. Settles the fate of a claim whose reply was lost (a reset, a stall past the read
-- timeout): either it ran, and its tasks are in the owner's processing hashes under its tokens, or it has not run
-- and never will take anything, because this script raises the owner's floor past its tokens (claim.lua refuses
-- a call whose first token is below the floor). Either way the daemon knows exactly what it holds.
--
-- KEYS[1] owners zset, KEYS[2] the owner's info hash, KEYS[3 .. 2+L] the owner's processing hashes (level order)
-- ARGV[1] owner; ARGV[2 ..] every token the lost claim carried, in order
-- Returns {now_ms, {level 1: per token, its envelope or false}, ..., {level L: ...}, the owner's journal (see
-- renew.lua)}; fails with "LEASELOST ..."
-- when the owner's lease is gone (its tasks belong to the monitors).
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
local tokens = {}
for i = 2, #ARGV do
  tokens[#tokens + 1] = ARGV[i]
end
local past = tonumber(tokens[#tokens]) + 1
local floor = tonumber(redis.call('HGET', KEYS[2], 'floor') or '0')
if past > floor then
  redis.call('HSET', KEYS[2], 'floor', string.format('%d', past))
end
local result = {now}
for i = 3, #KEYS do
  result[#result + 1] = redis.call('HMGET', KEYS[i], unpack(tokens))
end
result[#result + 1] = tonumber(redis.call('HGET', KEYS[2], 'journal') or '0')
return result
