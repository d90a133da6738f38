-- claim.lua: safe mode. Atomically take up to ARGV[1] tasks, highest priority first, into the processing area
-- under a lease.
--
-- KEYS[1] processing hash   token -> envelope
-- KEYS[2] leases zset       token -> lease deadline (ms)
-- KEYS[3] seq counter       tokens are never reused
-- KEYS[4] wake list
-- KEYS[5..] ready lists, highest priority first
-- ARGV[1] the most tasks to take; ARGV[2] lease length in ms; ARGV[3..] level names, in KEYS order
-- Returns {now_ms, first_seq, {envelopes of level 1}, ..., {envelopes of level L}}; the token of the k-th
-- envelope overall (from 0) is (first_seq + k) .. ":" .. its level name.
--
-- This script is the hot path: no table or string is made per task beyond the token, counters replace `#t`
-- (which is O(log n) in Lua 5.1), and the popped tables are returned as they are.
local max, lease = tonumber(ARGV[1]), tonumber(ARGV[2])
local levels = #KEYS - 4
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local result = {now, 0}
local taken = 0
for i = 1, levels do
  local got = false
  if taken < max then
    got = redis.call('LPOP', KEYS[4 + i], max - taken)
  end
  if got then
    taken = taken + #got
    result[2 + i] = got
  else
    result[2 + i] = {}
  end
end
if taken == 0 then
  return result
end
local seq = redis.call('INCRBY', KEYS[3], taken) - taken + 1
result[2] = seq
local fields, scores = {}, {}
local f, s = 0, 0
local deadline = now + lease
for i = 1, levels do
  local got = result[2 + i]
  local suffix = ':' .. ARGV[2 + i]
  for k = 1, #got do
    -- seq is a whole number below 2^53, which Lua prints without exponent up to 10^14 claims.
    local token = seq .. suffix
    fields[f + 1] = token
    fields[f + 2] = got[k]
    scores[s + 1] = deadline
    scores[s + 2] = token
    f, s, seq = f + 2, s + 2, seq + 1
  end
end
redis.call('HSET', KEYS[1], unpack(fields))
redis.call('ZADD', KEYS[2], unpack(scores))
if taken == max then
  -- The queue may hold more than this fetcher can take: pass the wake-up on to another idle fetcher.
  for i = 1, levels do
    if redis.call('LLEN', KEYS[4 + i]) > 0 then
      redis.call('LPUSH', KEYS[4], 1)
      redis.call('LTRIM', KEYS[4], 0, 0)
      break
    end
  end
end
return result
