#!lua
-- release.lua: forget an owner that holds no task any more, and its registration.
--
-- KEYS[1] owners zset, KEYS[2] the owner's info hash, KEYS[3 ..] the owner's claim sets (every level it
-- registered with)
-- ARGV[1] owner; ARGV[2] "expired" (a monitor: only if the lease has run out) or "owner" (its daemon, stopping)
-- Returns 1 released, 0 kept (it still holds tasks, or its lease is live and the caller is a monitor).
-- Checks before it writes: the owners zset's type (the info hash is deleted whatever it holds); a call that fails
-- writes nothing.
local found = redis.call('TYPE', KEYS[1]).ok
if found ~= 'none' and found ~= 'zset' then
  return redis.error_reply('WRONGTYPE release.lua: ' .. KEYS[1] .. ' is a ' .. found .. ', not a zset; nothing ' ..
    'was written')
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
for i = 3, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 1 then
    return 0
  end
end
if ARGV[2] == 'expired' then
  local lease = redis.call('ZSCORE', KEYS[1], ARGV[1])
  if lease and tonumber(lease) > now then
    return 0
  end
end
redis.call('DEL', KEYS[2])
return redis.call('ZREM', KEYS[1], ARGV[1])
