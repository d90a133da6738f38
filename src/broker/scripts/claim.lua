-- claim.lua: safe mode. Atomically take up to ARGV[1] tasks, highest priority first, into the processing area
-- under a lease.
--
-- KEYS[1] processing hash   token -> envelope
-- KEYS[2] leases zset       token -> lease deadline (ms)
-- KEYS[3] seq counter       tokens are never reused
-- KEYS[4] wake list
-- KEYS[5..] ready lists, highest priority first
-- ARGV[1] the most tasks to take; ARGV[2] lease length in ms; ARGV[3..] level names, in KEYS order
-- Returns {now_ms, first_seq, count_level_1, ..., count_level_L, envelope, ...}; the token of the k-th envelope
-- (from 0) is (first_seq + k) .. ":" .. its level name.
local max, lease = tonumber(ARGV[1]), tonumber(ARGV[2])
local levels = #KEYS - 4
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local result = {now, 0}
local taken = {}
for i = 1, levels do
  local count = 0
  if #taken < max then
    local got = redis.call('LPOP', KEYS[4 + i], max - #taken)
    if got then
      count = #got
      for _, envelope in ipairs(got) do
        taken[#taken + 1] = {envelope, ARGV[2 + i]}
      end
    end
  end
  result[2 + i] = count
end
if #taken == 0 then
  return result
end
local last = redis.call('INCRBY', KEYS[3], #taken)
local first = last - #taken + 1
result[2] = first
local fields, scores = {}, {}
local deadline = now + lease
for k, item in ipairs(taken) do
  local token = string.format('%d', first + k - 1) .. ':' .. item[2]
  fields[#fields + 1] = token
  fields[#fields + 1] = item[1]
  scores[#scores + 1] = deadline
  scores[#scores + 1] = token
  result[#result + 1] = item[1]
end
redis.call('HSET', KEYS[1], unpack(fields))
redis.call('ZADD', KEYS[2], unpack(scores))
if #taken == max then
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
