-- (The broker prepends `#!lua` and checks.lua: src/broker/mod.rs, `sources`.)
-- release.lua: forget an owner that holds no task any more, and its registration; a default-mode owner's running
-- slots come back with it.
--
-- KEYS[1] owners zset, KEYS[2] the owner's info hash, KEYS[3] the running hash, KEYS[4] the owner's popped-running
-- hash (default mode: scope -> the tasks it popped under a running limit and has not settled), KEYS[5] the wake
-- list, KEYS[6 ..] the owner's claim sets (every level it registered with)
-- ARGV[1] owner; ARGV[2] "expired" (a monitor: only if the lease has run out) or "owner" (its daemon, stopping)
-- Returns 1 released, 0 kept (it still holds tasks, or its lease is live and the caller is a monitor).
--
-- Running slots. A default-mode owner's popped tasks left Redis; what they count in the running hash is kept
-- under the owner (KEYS[4]) until their settles subtract it. What is left when the owner goes is given back
-- here, in the step that forgets the owner: its daemon died with those tasks (a monitor, once the lease ran
-- out), or stopped while some still ran after the shutdown grace. A settle of the owner that comes later finds
-- nothing to subtract. A field never goes below 0 (`running_underflow` is settle.lua's), and a freed count that
-- was at its limit wakes an idle fetcher.
-- Checks before it writes: the types of the keys it writes and that every count it reads is an integer (the
-- info hash is deleted whatever it holds); a call that fails writes nothing.
local wrong_type = type_check('release.lua')
for i, kind in ipairs({'zset', 'hash', 'hash', 'hash', 'list'}) do
  local refused = i ~= 2 and wrong_type(KEYS[i], kind)
  if refused then return refused end
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
for i = 6, #KEYS do
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
local integer = integer_check('release.lua')
local held = redis.call('HGETALL', KEYS[4])
local counts = {}
for i = 1, #held, 2 do
  local scope = held[i]
  local value = redis.call('HMGET', KEYS[3], scope, scope .. ':limit')
  local refused = integer(KEYS[4], scope, held[i + 1]) or integer(KEYS[3], scope, value[1]) or
    integer(KEYS[3], scope .. ':limit', value[2])
  if refused then return refused end
  counts[#counts + 1] = {scope, tonumber(held[i + 1]), tonumber(value[1] or '0'), tonumber(value[2] or '0')}
end
local wake = false
for _, c in ipairs(counts) do
  local scope, mine, count, limit = c[1], c[2], c[3], c[4]
  local left = math.max(0, count - mine)
  if left == 0 then
    redis.call('HDEL', KEYS[3], scope)
  else
    redis.call('HSET', KEYS[3], scope, left)
  end
  if mine > 0 and count >= limit and limit > 0 then wake = true end
end
redis.call('DEL', KEYS[2], KEYS[4])
if wake then
  redis.call('LPUSH', KEYS[5], 1)
  redis.call('LTRIM', KEYS[5], 0, 0)
end
return redis.call('ZREM', KEYS[1], ARGV[1])
