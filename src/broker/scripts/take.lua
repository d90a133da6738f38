#!lua
-- take.lua: default mode's plain pop (src/broker/tasks.rs, `pop_plain`). Takes up to ARGV[1] tasks from the first
-- non-empty list, and no more than ARGV[2] bytes of them (review M8: a pop of a thousand large tasks would be
-- gigabytes in one reply; at least one task is taken, whatever its size). It runs in the calling transaction,
-- which pops them: `MULTI`, `SET KEYS[1] 1`, this script, `LMPOP 1+N KEYS[1] KEYS[2..] LEFT COUNT ARGV[1]`,
-- `DEL KEYS[1]`, `EXEC`. The string set first guards the pop: a transaction runs every command whatever the one
-- before answered, so had this script not run (NOSCRIPT after a restart, or a key of the wrong type), the `LMPOP`
-- would take the head of a list nobody weighed, and its reply would be read by nobody; on the string it fails
-- (WRONGTYPE) and takes nothing. This script deletes it first thing after its checks. Outside that transaction
-- KEYS[1] is always absent, so every daemon uses the same one. The caller runs it only while no unique id is held
-- in the queue and the queue is neither paused nor throttled (its `WATCH` on those keys makes the transaction run
-- only if none of them changed since it looked).
--
-- No payload becomes a Lua string. When the list's head is surely within the bytes, the script writes nothing and
-- the transaction's `LMPOP` takes it from the list itself (KEYS[1] is empty, the list the first non-empty one
-- after it): `MEMORY USAGE list SAMPLES n` weighs the list's first n nodes and counts every node as their
-- average, so it is never under what they hold, and the first n tasks lie in the first n nodes (a node holds at
-- least one). A head that may be over the bytes (large tasks, or a list so long that its nodes' count weighs
-- more than the bytes) is copied natively into KEYS[1] (`SORT list BY nosort LIMIT 0 N STORE`, in order),
-- weighed (`MEMORY USAGE`: a little over the payloads' bytes, never under), cut to what fits (`LTRIM`) and taken
-- off the list (`LTRIM`); the transaction's `LMPOP` takes it from KEYS[1] (docs/PERFORMANCE.md, "Byte budgets").
--
-- KEYS[1] the taking list (`P:{Q}:taking`: the transaction's guard string, or absent), KEYS[2..] the lists to
-- take from, in order (per level: its three quarantine lists, then its ready list)
-- ARGV[1] the most tasks to take; ARGV[2] the most bytes
-- Returns {index of the list taken from (1-based among KEYS[2..]; 0: all were empty), tasks taken, Redis's clock
-- (ms)}.
-- Checks before it writes: every key's type; a call that fails writes nothing.
for i = 1, #KEYS do
  local found = redis.call('TYPE', KEYS[i]).ok
  if found ~= 'none' and found ~= 'list' and not (i == 1 and found == 'string') then
    return redis.error_reply('WRONGTYPE take.lua: ' .. KEYS[i] .. ' is a ' .. found .. ', not a list; nothing ' ..
      'was written')
  end
end
local max, max_bytes = tonumber(ARGV[1]), tonumber(ARGV[2])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
-- The guard goes: the transaction's LMPOP may take what this script weighed.
redis.call('DEL', KEYS[1])
for i = 2, #KEYS do
  local n = math.min(max, redis.call('LLEN', KEYS[i]))
  if n > 0 then
    if redis.call('MEMORY', 'USAGE', KEYS[i], 'SAMPLES', n) <= max_bytes then
      return {i - 1, n, now}
    end
    redis.call('SORT', KEYS[i], 'BY', 'nosort', 'LIMIT', 0, n, 'STORE', KEYS[1])
    local bytes = redis.call('MEMORY', 'USAGE', KEYS[1], 'SAMPLES', 0)
    while n > 1 and bytes > max_bytes do
      -- As many as fit if the tasks are alike; fewer each time until they do fit.
      n = math.max(1, math.min(n - 1, math.floor(n * max_bytes / bytes)))
      redis.call('LTRIM', KEYS[1], 0, n - 1)
      bytes = redis.call('MEMORY', 'USAGE', KEYS[1], 'SAMPLES', 0)
    end
    redis.call('LTRIM', KEYS[i], n, -1)
    return {i - 1, n, now}
  end
end
return {0, 0, now}
