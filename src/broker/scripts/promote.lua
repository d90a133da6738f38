-- (The broker prepends checks.lua: src/broker/mod.rs, `sources`.)
-- promote.lua: move due tasks from the retry and delayed zsets to their ready lists, at most ARGV[1] per call.
-- No lock: each task is moved by exactly one caller, because the read and the removal happen in one script.
--
-- KEYS[1] wake list, KEYS[2] delayed tasks hash (id -> envelope),
-- KEYS[3 .. 2+L] ready lists, KEYS[3+L .. 2+2L] delayed zsets (members: ids), KEYS[3+2L .. 2+3L] retry zsets
-- (members: envelopes), all in level order
-- ARGV[1] the most tasks to move
-- Retries go to the front of their level (they already waited their turn), delayed tasks to the back.
-- Returns {moved, ms until the next task is due (-1: none)}.
-- Checks before it writes: every key's type, and that ARGV[1] is at most 1,000 (the bound of unpack's stack is
-- about 8,000 values); a call that fails writes nothing.
local levels = (#KEYS - 2) / 3
local max = tonumber(ARGV[1])
local wrong_type = type_check('promote.lua')
local refused = wrong_type(KEYS[1], 'list') or wrong_type(KEYS[2], 'hash')
for i = 3, #KEYS do
  refused = refused or wrong_type(KEYS[i], i <= 2 + levels and 'list' or 'zset')
end
if refused then return refused end
if not max or max > 1000 then
  return redis.error_reply('promote.lua: at most 1000 tasks a call, not ' .. ARGV[1] .. '; nothing was written')
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local moved = 0
for i = 1, levels do
  local ready, delayed, retry = KEYS[2 + i], KEYS[2 + levels + i], KEYS[2 + 2 * levels + i]
  if moved < max then
    local due = redis.call('ZRANGE', retry, '-inf', now, 'BYSCORE', 'LIMIT', 0, max - moved)
    if #due > 0 then
      -- LPUSH a b c leaves c b a: push in reverse so the earliest due ends up first.
      local reversed = {}
      for k = #due, 1, -1 do reversed[#reversed + 1] = due[k] end
      redis.call('LPUSH', ready, unpack(reversed))
      redis.call('ZREM', retry, unpack(due))
      moved = moved + #due
    end
  end
  if moved < max then
    local ids = redis.call('ZRANGE', delayed, '-inf', now, 'BYSCORE', 'LIMIT', 0, max - moved)
    if #ids > 0 then
      local envelopes = redis.call('HMGET', KEYS[2], unpack(ids))
      local found = {}
      for k = 1, #ids do
        if envelopes[k] then found[#found + 1] = envelopes[k] end
      end
      if #found > 0 then
        redis.call('RPUSH', ready, unpack(found))
      end
      redis.call('ZREM', delayed, unpack(ids))
      redis.call('HDEL', KEYS[2], unpack(ids))
      moved = moved + #found
    end
  end
end
if moved > 0 then
  redis.call('LPUSH', KEYS[1], 1)
  redis.call('LTRIM', KEYS[1], 0, 0)
end
local next_due = -1
for i = 3 + levels, #KEYS do
  local head = redis.call('ZRANGE', KEYS[i], 0, 0, 'WITHSCORES')
  if head[2] then
    local wait = math.max(tonumber(head[2]) - now, 0)
    if next_due < 0 or wait < next_due then next_due = wait end
  end
end
return {moved, next_due}
