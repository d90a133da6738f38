#!lua
-- take.lua: default mode's plain pop (src/broker/tasks.rs, `pop_plain`). Takes up to ARGV[1] tasks from the first
-- non-empty list, and no more than ARGV[2] bytes of them (review M8: a pop of a thousand large tasks would be
-- gigabytes in one reply; at least one task is taken, whatever its size), into KEYS[1], which the calling
-- transaction reads back and deletes: `MULTI`, this script, `LRANGE KEYS[1] 0 -1`, `DEL KEYS[1]`, `EXEC`. Outside that transaction KEYS[1] is always empty, so every daemon uses the same one. The caller runs it
-- only while no unique id is held in the queue and the queue is neither paused nor throttled (its `WATCH` on
-- those keys makes the transaction run only if none of them changed since it looked).
--
-- No payload becomes a Lua string: `SORT list BY nosort LIMIT 0 N STORE` copies the list's head natively and in
-- order, `MEMORY USAGE` weighs the copy (a little over the payloads' bytes, never under), `LTRIM` cuts it to what
-- fits, and `LTRIM` takes it off the list.
--
-- KEYS[1] the taking list (`P:{Q}:taking`), KEYS[2..] the lists to take from, in order (per level: its three
-- quarantine lists, then its ready list)
-- ARGV[1] the most tasks to take; ARGV[2] the most bytes
-- Returns {index of the list taken from (1-based among KEYS[2..]; 0: all were empty), tasks taken, Redis's clock
-- (ms)}.
-- Checks before it writes: every key's type; a call that fails writes nothing.
for i = 1, #KEYS do
  local found = redis.call('TYPE', KEYS[i]).ok
  if found ~= 'none' and found ~= 'list' then
    return redis.error_reply('WRONGTYPE take.lua: ' .. KEYS[i] .. ' is a ' .. found .. ', not a list; nothing ' ..
      'was written')
  end
end
local max, max_bytes = tonumber(ARGV[1]), tonumber(ARGV[2])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
for i = 2, #KEYS do
  local n = math.min(max, redis.call('LLEN', KEYS[i]))
  if n > 0 then
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
