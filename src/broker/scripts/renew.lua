#!lua
-- renew.lua: the heartbeat of one owner (a daemon's identity on a queue): push its lease deadline forward.
--
-- KEYS[1] owners zset, KEYS[2] the owner's info hash; ARGV[1] owner; ARGV[2] lease length in ms
-- Only a live lease is renewed: once an owner's lease has run out it never comes back, so a monitor that sees it
-- expired may recover its tasks without racing the owner. Returns 1 renewed, 0 lost.
-- An owner whose registration is there but whose lease entry is gone (removed by hand, or lost by Redis while
-- the rest survived) is put back as expired, so that the monitors find it and recover what it holds.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lease = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not lease then
  if redis.call('EXISTS', KEYS[2]) == 1 then
    redis.call('ZADD', KEYS[1], 0, ARGV[1])
  end
  return 0
end
if tonumber(lease) <= now then
  return 0
end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
return 1
