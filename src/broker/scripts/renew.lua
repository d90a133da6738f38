-- renew.lua: the heartbeat of one owner (a daemon's claim identity on a queue): push its lease deadline forward.
--
-- KEYS[1] owners zset; ARGV[1] owner; ARGV[2] lease length in ms
-- Only a live lease is renewed: once an owner's lease has run out it never comes back, so a monitor that sees it
-- expired may recover its tasks without racing the owner. Returns 1 renewed, 0 lost.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lease = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not lease or tonumber(lease) <= now then
  return 0
end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
return 1
