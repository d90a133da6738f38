#!lua
-- pop.lua: default mode. Take up to ARGV[2] tasks from the first non-empty list, each level's quarantine before
-- its ready list, highest level first: the tasks leave Redis (at most once). A unique task's id stays held, now
-- by the popping owner (recorded in the unique-popped hash), until its outcome is settled, or until a monitor
-- finds that owner's lease expired (a daemon that died with it: the task is lost, and its id must not be).
--
-- KEYS[1] unique hash, KEYS[2] unique-popped hash (id -> owner), KEYS[3] the queue's paused key (nothing is
-- popped while it exists), KEYS[4] the queue's throttle (nothing is popped while it exists: a handler's
-- back-pressure, set by settle.lua), KEYS[5 ..] the lists to pop from, in order (quarantine then ready, per level)
-- ARGV[1] owner; ARGV[2] the most tasks to take
-- Returns {now_ms, index of the list popped (1-based among KEYS[5 ..], 0: all empty, paused or throttled),
-- {payloads}, the number of unique ids held in the queue, 1 if the queue is paused (nothing was popped) else 0,
-- the ms (Redis's clock) when the queue's throttle ends if it is throttled (nothing was popped) else 0}.
--
-- The daemon calls this only while unique ids are held in the queue; otherwise it pops with a plain LMPOP in a
-- transaction guarded by WATCH on the unique hash (Popper in src/broker/tasks.rs), which spares Redis converting
-- every payload into a Lua string and back. (Payloads over max_task_bytes are dead-lettered by the daemon: in
-- default mode a pop has read them anyway.)
-- Checks before it writes: every key's type (KEYS[3] is only tested for existence, KEYS[4] for its time to
-- live); a call that fails writes nothing (and pops nothing).
local function wrong_type(key, kind)
  local found = redis.call('TYPE', key).ok
  if found ~= 'none' and found ~= kind then
    return redis.error_reply('WRONGTYPE pop.lua: ' .. key .. ' is a ' .. found .. ', not a ' .. kind ..
      '; nothing was written')
  end
end
local refused = wrong_type(KEYS[1], 'hash') or wrong_type(KEYS[2], 'hash')
refused = refused or wrong_type(KEYS[4], 'string')
for i = 5, #KEYS do
  refused = refused or wrong_type(KEYS[i], 'list')
end
if refused then return refused end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
-- One EXISTS for both keys, as claim.lua.
if redis.call('EXISTS', KEYS[3], KEYS[4]) > 0 then
  if redis.call('EXISTS', KEYS[3]) == 1 then
    return {now, 0, {}, redis.call('HLEN', KEYS[1]), 1, 0}
  end
  -- By its time to live, as claim.lua; one set by hand without an expiry is looked at again every second.
  local left = redis.call('PTTL', KEYS[4])
  if left ~= -2 then
    if left < 0 then left = 1000 end
    return {now, 0, {}, redis.call('HLEN', KEYS[1]), 0, now + math.max(1, left)}
  end
end
local args = {#KEYS - 4}
for i = 5, #KEYS do
  args[#args + 1] = KEYS[i]
end
args[#args + 1], args[#args + 2], args[#args + 3] = 'LEFT', 'COUNT', ARGV[2]
local popped = redis.call('LMPOP', unpack(args))
local held = redis.call('HLEN', KEYS[1])
if not popped then
  return {now, 0, {}, held, 0, 0}
end
local index = 0
for i = 5, #KEYS do
  if KEYS[i] == popped[1] then
    index = i - 4
    break
  end
end
local items = popped[2]
if held > 0 then
  for k = 1, #items do
    -- Decoding costs, so only where a unique id may be held and the payload says "unique".
    if string.find(items[k], '"unique"', 1, true) then
      local ok, task = pcall(cjson.decode, items[k])
      if ok and type(task) == 'table' and task.unique == true and type(task.id) == 'string'
          and redis.call('HEXISTS', KEYS[1], task.id) == 1 then
        redis.call('HSET', KEYS[2], task.id, ARGV[1])
      end
    end
  end
end
return {now, index, items, held, 0, 0}
