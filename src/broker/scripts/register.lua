-- register.lua: a new owner (a daemon's claim identity on a queue), with a lease.
--
-- KEYS[1] owners zset, KEYS[2] seq counter; ARGV[1] lease length in ms
-- Returns the owner id, "o" and a number never used before on this queue.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local owner = 'o' .. redis.call('INCR', KEYS[2])
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[1]), owner)
return owner
