-- unique_hold.lua, a prelude of settle.lua and release_unique.lua: a task's unique id freed as its task ends. An
-- id pushed with the option unique_for=MS (push.lua) has "NOW:MS" as its field in the unique hash; freeing it
-- leaves the string key UNIQUE_HASH:held:ID behind, which expires MS ms later by itself (no sweeper to fall
-- behind), and push.lua refuses every unique push of the id while it exists (docs/PROTOCOL.md, "Debounce, and
-- unique for a time"). Any other field (a plain unique task's, "NOW") is simply deleted.
local function free_unique_id(uniq, uid, now)
  local field = redis.call('HGET', uniq, uid)
  redis.call('HDEL', uniq, uid)
  local hold = field and string.match(field, '^%d+:(%d+)$')
  if hold then
    redis.call('SET', uniq .. ':held:' .. uid, string.format('%d', now), 'PX', hold)
  end
end
