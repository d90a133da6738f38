-- (The broker prepends checks.lua: src/broker/mod.rs, `sources`.)
-- move.lua: move tasks from a queue's source lists (lists its producers push to under their own names, such as
-- Redis in Action's `queue:email`) to the back of the queue's ready lists, at most ARGV[1] per call. No lock:
-- each task is moved by exactly one caller (however many daemons serve the queue), because its pop and its push
-- happen in one script.
--
-- KEYS[1] wake list                                      P:{Q}:wake
-- KEYS[2] stats hash                                     P:{Q}:stats
-- KEYS[3 .. 2+S] the source lists
-- KEYS[3+S .. 2+2S] for each source, the ready list its tasks join   P:{Q}:ready:LEVEL
-- ARGV[1] the most tasks to move
-- ARGV[2] the source to start with (1-based, among the sources): callers rotate it, so that a source that always
--         holds a full batch does not keep the others waiting
-- Each task leaves the head of its source (the oldest a producer RPUSHed) and joins the back of its ready list
-- byte for byte: nothing is stamped or decoded here, so a payload the daemon cannot decode is dead-lettered with
-- the producer's exact bytes. Moved tasks count as `pushed` and `moved`.
-- Returns how many moved; fewer than ARGV[1] means every source was found empty.
local max = tonumber(ARGV[1])
local first = tonumber(ARGV[2])
-- Checks before it writes: every key's type first, then the stats hash's counters, so that a call that fails
-- writes nothing.
for i = 1, #KEYS do
  local kind = redis.call('TYPE', KEYS[i])['ok']
  local expected = 'list'
  if i == 2 then
    expected = 'hash'
  end
  if kind ~= 'none' and kind ~= expected then
    return redis.error_reply('move.lua: ' .. KEYS[i] .. ' holds a ' .. kind .. ', not a ' .. expected ..
      '; a source list must be a list that producers RPUSH tasks to')
  end
end
-- Then the counters it increments.
local integer = integer_check('move.lua')
for _, field in ipairs({'pushed', 'moved'}) do
  local refused = integer(KEYS[2], field, redis.call('HGET', KEYS[2], field))
  if refused then return refused end
end
local sources = (#KEYS - 2) / 2
local moved = 0
for n = 0, sources - 1 do
  if moved >= max then
    break
  end
  local i = (first - 1 + n) % sources
  local tasks = redis.call('LPOP', KEYS[3 + i], max - moved)
  if tasks then
    -- In chunks: unpack's stack is bounded (about 8,000 values).
    for at = 1, #tasks, 1000 do
      redis.call('RPUSH', KEYS[3 + sources + i], unpack(tasks, at, math.min(at + 999, #tasks)))
    end
    moved = moved + #tasks
  end
end
if moved > 0 then
  -- One marker wakes one idle fetcher, as push.lua's does.
  redis.call('LPUSH', KEYS[1], 1)
  redis.call('LTRIM', KEYS[1], 0, 0)
  redis.call('HINCRBY', KEYS[2], 'pushed', moved)
  redis.call('HINCRBY', KEYS[2], 'moved', moved)
end
return moved
