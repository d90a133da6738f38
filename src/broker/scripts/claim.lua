-- claim.lua: safe mode. Atomically take up to ARGV[2] tasks, highest priority first, into the owner's
-- processing hashes. The owner's lease (one per daemon, renewed by its heartbeat) covers all of them.
--
-- KEYS[1] owners zset (owner -> lease deadline ms), KEYS[2] wake list,
-- KEYS[3 .. 2+L] ready lists, KEYS[3+L .. 2+2L] the owner's processing hashes (token -> envelope), in level order
-- ARGV[1] owner; ARGV[2] the most tasks to take; ARGV[3 ..] at least that many tokens, unique within the owner
-- Returns {now_ms, {envelopes of level 1}, ..., {envelopes of level L}}; the k-th envelope overall (from 1) was
-- stored under token ARGV[2 + k]. Fails with "LEASELOST ..." when the owner's lease is gone or past: its tasks
-- then belong to the monitors, and the daemon must register a new owner.
--
-- This is the hot path: tokens come from the caller (formatting numbers in Lua costs more than everything else
-- here), no table is made per task, and counters replace `#t` (which is O(log n) in Lua 5.1). Returning the
-- envelopes joined into one string would spare the client's parser, but costs Redis more than it saves (measured:
-- docs/PERFORMANCE.md).
local levels = (#KEYS - 2) / 2
local owner, max = ARGV[1], tonumber(ARGV[2])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lease = redis.call('ZSCORE', KEYS[1], owner)
if not lease or tonumber(lease) <= now then
  return redis.error_reply('LEASELOST owner ' .. owner .. ' has no live lease')
end
local result = {now}
local taken = 0
for i = 1, levels do
  local got = false
  if taken < max then
    got = redis.call('LPOP', KEYS[2 + i], max - taken)
  end
  if got then
    local fields = {}
    for k = 1, #got do
      fields[2 * k - 1] = ARGV[2 + taken + k]
      fields[2 * k] = got[k]
    end
    redis.call('HSET', KEYS[2 + levels + i], unpack(fields))
    taken = taken + #got
    result[1 + i] = got
  else
    result[1 + i] = {}
  end
end
if taken == max then
  -- The queue may hold more than this fetcher can take: pass the wake-up on to another idle fetcher.
  for i = 1, levels do
    if redis.call('LLEN', KEYS[2 + i]) > 0 then
      redis.call('LPUSH', KEYS[2], 1)
      redis.call('LTRIM', KEYS[2], 0, 0)
      break
    end
  end
end
return result
