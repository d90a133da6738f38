-- (The broker prepends checks.lua: src/broker/mod.rs, `sources`.)
-- group_resume.lua: `kmqd group resume`: a paused group's flows go back to their rings' turns.
--
-- KEYS[1] the group's pause (`hold:g:GROUP`), KEYS[2] the sched hash (each level's virtual time, `vt:N`),
-- KEYS[3] the wake list, KEYS[4] the group's park index (`park:g:GROUP`: its parked flows of a limited type, beside
-- type limits, as `LEVEL|MEMBER`), KEYS[5 ..] the levels' rings, in order
-- ARGV[1] the group's member in the rings (`GROUP:`, encoded)
-- Deletes the pause and moves each of the group's flows that a claim parked (`GROUP:` on each level, and those the
-- park index names) (groups.lua's PARKED band: it met the
-- pause, or the group's full count) back to its level's virtual time, then wakes an idle fetcher. A flow parked
-- for a full count that comes back takes its turn and parks again if the count is still full. Returns 1 if the
-- group was paused, 0 if not (its parked flows are moved back all the same).
-- Checks before it writes: the rings' and the sched hash's types, and each level's virtual time.
local PARKED = 2e15
local levels = #KEYS - 4
local wrong = type_check('group_resume.lua')
local refused = wrong(KEYS[2], 'hash') or wrong(KEYS[3], 'list') or wrong(KEYS[4], 'zset')
for level = 1, levels do refused = refused or wrong(KEYS[4 + level], 'zset') end
if refused then return refused end
local vt = {}
for level = 1, levels do
  local value = redis.call('HGET', KEYS[2], 'vt:' .. level)
  if value and not tonumber(value) then
    return redis.error_reply('ERR group_resume.lua: ' .. KEYS[2] .. ' field vt:' .. level .. ' is not a number; ' ..
      'nothing was written')
  end
  vt[level] = tonumber(value or '0')
end
local parked = {}
for level = 1, levels do parked[#parked + 1] = {level, ARGV[1]} end
for _, entry in ipairs(redis.call('ZRANGE', KEYS[4], 0, -1)) do
  local level, member = string.match(entry, '^(%d+)|(.*)$')
  level = tonumber(level)
  if level and level >= 1 and level <= levels then parked[#parked + 1] = {level, member} end
end
local was = redis.call('DEL', KEYS[1])
redis.call('DEL', KEYS[4])
for _, p in ipairs(parked) do
  local score = redis.call('ZSCORE', KEYS[4 + p[1]], p[2])
  if score and tonumber(score) >= PARKED then
    redis.call('ZADD', KEYS[4 + p[1]], 'XX', vt[p[1]], p[2])
  end
end
redis.call('LPUSH', KEYS[3], 1)
redis.call('LTRIM', KEYS[3], 0, 0)
return was
