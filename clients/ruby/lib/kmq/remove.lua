-- (The broker prepends checks.lua and unique_hold.lua: src/broker/mod.rs, `sources`.)
-- remove.lua: cancel one waiting task (delayed, retrying or ready) that the caller located.
--
-- KEYS[1] the key holding it: a ready list, a retry zset or a delayed zset; KEYS[2] delayed tasks hash;
-- KEYS[3] unique hash; KEYS[4] stats hash
-- ARGV[1] "list", "retry" or "delayed"
-- ARGV[2] list, retry: the exact payload; delayed: the task id
-- ARGV[3] delayed: the envelope the caller saw (the removal is skipped if it changed); others: unused
-- ARGV[4] the unique id to release, or ""
-- Returns 1 removed, 0 no longer there (it was taken or moved meanwhile).
-- A cancel ends the task: a unique_for task's id stays held for its window from now (unique_hold.lua), as after any
-- other end: the cancel cannot tell a task that never ran from a retry's, whose run started less than the window
-- ago, and one run of the id per window is the promise.
-- Checks before it writes: the keys' types and the stats hash's `cancelled`, and, for a unique_for id, that the
-- caller may write its hold (an operator's user made from an older kmqd's rules may not: refused, naming the rule);
-- a call that fails writes nothing.
local kind, task, unique = ARGV[1], ARGV[2], ARGV[4]
local wrong_type = type_check('remove.lua')
local integer = integer_check('remove.lua')
local holder = 'zset'
if kind == 'list' then holder = 'list' end
local refused = wrong_type(KEYS[1], holder) or wrong_type(KEYS[2], 'hash') or wrong_type(KEYS[3], 'hash') or
  wrong_type(KEYS[4], 'hash') or integer(KEYS[4], 'cancelled', redis.call('HGET', KEYS[4], 'cancelled'))
if refused then return refused end
local window = nil
if unique ~= '' then
  window = unique_window(redis.call('HGET', KEYS[3], unique))
  if window and not redis.acl_check_cmd('SET', KEYS[3] .. ':held:' .. unique, '0', 'PX', window) then
    return redis.error_reply('NOPERM remove.lua: cancelling a unique_for task needs the operators\' rule ~' ..
      KEYS[3] .. ':held:* (docs/OPERATIONS.md, "ACL rules"); nothing was written')
  end
end
local removed = 0
if kind == 'list' then
  removed = redis.call('LREM', KEYS[1], 1, task)
elseif kind == 'retry' then
  removed = redis.call('ZREM', KEYS[1], task)
elseif kind == 'delayed' then
  if redis.call('HGET', KEYS[2], task) == ARGV[3] then
    removed = redis.call('ZREM', KEYS[1], task)
    redis.call('HDEL', KEYS[2], task)
  end
else
  return redis.error_reply('remove.lua: unknown kind ' .. kind)
end
if removed == 1 then
  if unique ~= '' then
    local now = nil
    if window then
      local t = redis.call('TIME')
      now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
    end
    drop_unique_id(KEYS[3], unique, window, now)
  end
  redis.call('HINCRBY', KEYS[4], 'cancelled', 1)
end
return removed
