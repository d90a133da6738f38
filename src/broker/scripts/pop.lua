#!lua
-- pop.lua: default mode. Take up to ARGV[2] tasks from the first non-empty list, each level's quarantine before
-- its ready list, highest level first: the tasks leave Redis (at most once). A unique task's id stays held, now
-- by the popping owner (recorded in the unique-popped hash), until its outcome is settled, or until a monitor
-- finds that owner's lease expired (a daemon that died with it: the task is lost, and its id must not be).
--
-- KEYS[1] unique hash, KEYS[2] unique-popped hash (id -> owner), KEYS[3] dead list, KEYS[4] stats hash,
-- KEYS[5 ..] the lists to pop from, in order (quarantine then ready, per level)
-- ARGV[1] owner; ARGV[2] the most tasks to take; ARGV[3] max_task_bytes; ARGV[4] dead list bound;
-- ARGV[5] queue name; ARGV[6] daemon (host:pid, for dead records)
-- Returns {now_ms, index of the list popped (1-based among KEYS[5 ..], 0: all empty), {payloads}}.
-- A payload longer than max_task_bytes is dead-lettered here, never handed to the daemon.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lists, args = {}, {#KEYS - 4}
for i = 5, #KEYS do
  lists[#lists + 1] = KEYS[i]
  args[#args + 1] = KEYS[i]
end
args[#args + 1], args[#args + 2], args[#args + 3] = 'LEFT', 'COUNT', ARGV[2]
local popped = redis.call('LMPOP', unpack(args))
if not popped then
  return {now, 0, {}}
end
local index = 0
for i = 1, #lists do
  if lists[i] == popped[1] then
    index = i
    break
  end
end
local items, kept, dead = popped[2], {}, 0
local max_bytes = tonumber(ARGV[3])
local held = redis.call('HLEN', KEYS[1]) > 0
for k = 1, #items do
  local payload = items[k]
  if #payload > max_bytes then
    dead = dead + 1
    redis.call('LPUSH', KEYS[3], '{"dead_at":' .. string.format('%d', now) .. ',"queue":' .. cjson.encode(ARGV[5]) ..
      ',"id":"","type":"","attempt":0,"reason":"task is ' .. string.format('%d', #payload) ..
      ' bytes, more than max_task_bytes (' .. ARGV[3] .. '); it was not run","size":' ..
      string.format('%d', #payload) .. ',"daemon":' .. cjson.encode(ARGV[6]) .. ',"task":' ..
      cjson.encode(payload) .. '}')
  else
    kept[#kept + 1] = payload
    -- Decoding costs, so only where a unique id may be held and the payload says "unique".
    if held and string.find(payload, '"unique"', 1, true) then
      local ok, task = pcall(cjson.decode, payload)
      if ok and type(task) == 'table' and task.unique == true and type(task.id) == 'string'
          and redis.call('HEXISTS', KEYS[1], task.id) == 1 then
        redis.call('HSET', KEYS[2], task.id, ARGV[1])
      end
    end
  end
end
if dead > 0 then
  redis.call('LTRIM', KEYS[3], 0, tonumber(ARGV[4]) - 1)
  redis.call('HINCRBY', KEYS[4], 'dead_lettered', dead)
end
return {now, index, kept}
