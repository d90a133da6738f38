-- (The broker prepends `#!lua` and checks.lua: src/broker/mod.rs, `sources`.)
-- history.lua: take this minute's sample of a queue's counters and depths into its history (the dashboard's
-- charts), unless a daemon took it already, and drop the samples older than the history keeps. Every daemon's
-- monitor calls it every 15 s for each of its queues; the first call in a minute (of Redis's clock) writes.
--
-- KEYS[1] the history zset (score: the minute, ms / 60000; member: the sample, JSON)
-- KEYS[2] the stats hash
-- KEYS[3] the dead list
-- KEYS[4 .. 3+ARGV[1]] the lists counted as ready (ready:L and quarantine lists)
-- KEYS[4+ARGV[1] ..] the zsets counted as delayed (delayed:L and retry:L)
-- ARGV[1] how many ready lists
-- ARGV[2] how many minutes of samples to keep
-- Returns 1 written, 0 this minute had its sample already.
-- Checks before it writes: every key's type (the counters are read with tonumber, so any value is taken); a
-- call that fails writes nothing.
local wrong_type = type_check('history.lua')
local refused = wrong_type(KEYS[1], 'zset') or wrong_type(KEYS[2], 'hash') or wrong_type(KEYS[3], 'list')
for i = 4, #KEYS do
  refused = refused or wrong_type(KEYS[i], i <= 3 + tonumber(ARGV[1]) and 'list' or 'zset')
end
if refused then return refused end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local minute = math.floor(now / 60000)
if #redis.call('ZRANGE', KEYS[1], minute, minute, 'BYSCORE', 'LIMIT', 0, 1) > 0 then
  return 0
end
local lists = tonumber(ARGV[1])
local ready, delayed = 0, 0
for i = 4, 3 + lists do
  ready = ready + redis.call('LLEN', KEYS[i])
end
for i = 4 + lists, #KEYS do
  delayed = delayed + redis.call('ZCARD', KEYS[i])
end
local counters = redis.call('HMGET', KEYS[2], 'done', 'failed')
redis.call('ZADD', KEYS[1], minute, string.format(
  '{"at":%d,"done":%d,"failed":%d,"ready":%d,"delayed":%d,"dead":%d}',
  now, tonumber(counters[1]) or 0, tonumber(counters[2]) or 0, ready, delayed, redis.call('LLEN', KEYS[3])))
local old = redis.call('ZRANGE', KEYS[1], '-inf', '(' .. (minute - tonumber(ARGV[2])), 'BYSCORE')
-- In chunks: unpack's stack is bounded (about 8,000 values), and a shorter history may leave more.
for at = 1, #old, 1000 do
  redis.call('ZREM', KEYS[1], unpack(old, at, math.min(at + 999, #old)))
end
return 1
