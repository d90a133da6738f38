-- unique_hold.lua, a prelude of settle.lua, release_unique.lua, remove.lua and dead_requeue.lua: a task's unique
-- id freed as its task ends, and taken again with its window. An id pushed with the option unique_for=MS
-- (push.lua) has "NOW:MS" as its field in the unique hash; freeing it leaves the string key UNIQUE_HASH:held:ID
-- behind, its value "END:MS" (the end's time, then the window), which expires MS ms later by itself (no sweeper to
-- fall behind), and push.lua refuses every unique push of the id while it exists (docs/PROTOCOL.md, "Debounce, and
-- unique for a time"). Any other field (a plain unique task's, "NOW") is simply deleted. Returns the window (MS,
-- as a string) of a unique_for id, nil for a plain one, so that the step that frees it can carry it on (a dead
-- record's "unique_for").
local function free_unique_id(uniq, uid, now)
  local field = redis.call('HGET', uniq, uid)
  redis.call('HDEL', uniq, uid)
  local hold = field and string.match(field, '^%d+:(%d+)$')
  if hold then
    redis.call('SET', uniq .. ':held:' .. uid, string.format('%d', now) .. ':' .. hold, 'PX', hold)
  end
  return hold
end

-- The window of an id whose hold is still there (its task ended, or its owner lost it, less than MS ago): MS, or
-- nil. A hold key that is not a string (somebody's SET of another type) reads as none: pcall, since the callers
-- may have written already.
local function held_window(uniq, uid)
  local hold = redis.pcall('GET', uniq .. ':held:' .. uid)
  return type(hold) == 'string' and string.match(hold, '^%d+:(%d+)$') or nil
end

-- Takes the id again for a task the daemons or an operator queue again after its id was freed (a default-mode task
-- whose owner lost the id, a dead task requeued), as push.lua takes it: with its window, MS (or nil: a plain unique
-- id). Returns whether it was free.
local function take_unique_id(uniq, uid, now, window)
  local field = string.format('%d', now)
  if window then field = field .. ':' .. window end
  return redis.call('HSETNX', uniq, uid, field) == 1
end
