-- unique_hold.lua, a prelude of settle.lua, release_unique.lua, remove.lua and dead_requeue.lua: a task's unique
-- id freed as its task ends, and taken again with its window. An id pushed with the option unique_for=MS
-- (push.lua) has "NOW:MS" as its field in the unique hash; freeing it leaves the string key UNIQUE_HASH:held:ID
-- behind, its value "END:MS" (the end's time, then the window), which expires MS ms later by itself (no sweeper to
-- fall behind; ":released" after it when a monitor freed the id of a task lost with its owner), and push.lua
-- refuses every unique push of the id while it exists (docs/PROTOCOL.md, "Debounce, and
-- unique for a time"). Any other field (a plain unique task's, "NOW") is simply deleted.

-- The window (MS, as a string) of a unique hash's field: "NOW:MS" for a unique_for id; nil for a plain one's "NOW"
-- (or no field). The one place that reads the field's format.
local function unique_window(field)
  return field and string.match(field, '^%d+:(%d+)$')
end

-- Frees an id whose window the caller already read (`unique_window`; remove.lua reads it to check its ACL first):
-- the field goes, and a window leaves its hold.
local function drop_unique_id(uniq, uid, window, now, released)
  redis.call('HDEL', uniq, uid)
  if window then
    local value = string.format('%d', now) .. ':' .. window
    if released then value = value .. ':released' end
    redis.call('SET', uniq .. ':held:' .. uid, value, 'PX', window)
  end
end

-- Frees an id as its task ends. Returns its window (nil for a plain id), so that the step that frees it can carry
-- it on (a dead record's "unique_for"). `released`: the id is freed by release_unique.lua, for a task lost with its
-- owner, which may yet come back (a woken daemon's): its hold says so ("END:MS:released"), see `held_window`.
local function free_unique_id(uniq, uid, now, released)
  local window = unique_window(redis.call('HGET', uniq, uid))
  drop_unique_id(uniq, uid, window, now, released)
  return window
end

-- The hold of an id while it is there (its task ended, or its owner was lost, less than MS ago): its window MS
-- (nil: none there), and whether a task's end left it rather than a lost owner's release. A lost owner's task that
-- comes back (handed back, retried) takes the id again with the window of its own release's hold; after another
-- task's end it is dropped, as when a newer task holds the id: that one ran instead, within the window. A hold key
-- that is not a string (somebody's SET of another type) reads as none: pcall, since the callers may have written
-- already.
local function held_window(uniq, uid)
  local hold = redis.pcall('GET', uniq .. ':held:' .. uid)
  if type(hold) ~= 'string' then return nil, false end
  local window = string.match(hold, '^%d+:(%d+)')
  return window, window ~= nil and string.sub(hold, -9) ~= ':released'
end

-- Takes the id again for a task the daemons or an operator queue again after its id was freed (a default-mode task
-- whose owner lost the id, a dead task requeued), as push.lua takes it: with its window, MS (or nil: a plain unique
-- id). Returns whether it was free.
local function take_unique_id(uniq, uid, now, window)
  local field = string.format('%d', now)
  if window then field = field .. ':' .. window end
  return redis.call('HSETNX', uniq, uid, field) == 1
end
