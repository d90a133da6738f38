-- promote.lua: move due tasks from the delayed and retry zsets to their ready lists, at most ARGV[1] per call.
-- No lock: each member is moved by exactly one caller, because the read and the ZREM happen in one script.
--
-- KEYS[1] wake list, KEYS[2 .. 1+L] ready lists, KEYS[2+L .. 1+2L] delayed zsets, KEYS[2+2L .. 1+3L] retry zsets
-- ARGV[1] the most tasks to move
-- Retries go to the front of their level (they already waited their turn), delayed tasks to the back.
-- Returns {moved, ms until the next task is due (-1: none)}.
local levels = (#KEYS - 1) / 3
local max = tonumber(ARGV[1])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local moved = 0
for i = 1, levels do
  local ready = KEYS[1 + i]
  for _, kind in ipairs({'retry', 'delayed'}) do
    local zset = kind == 'retry' and KEYS[1 + 2 * levels + i] or KEYS[1 + levels + i]
    if moved < max then
      local due = redis.call('ZRANGE', zset, '-inf', now, 'BYSCORE', 'LIMIT', 0, max - moved)
      if #due > 0 then
        if kind == 'retry' then
          -- LPUSH a b c leaves c b a: push in reverse so the earliest due ends up first.
          local reversed = {}
          for k = #due, 1, -1 do reversed[#reversed + 1] = due[k] end
          redis.call('LPUSH', ready, unpack(reversed))
        else
          redis.call('RPUSH', ready, unpack(due))
        end
        redis.call('ZREM', zset, unpack(due))
        moved = moved + #due
      end
    end
  end
end
if moved > 0 then
  redis.call('LPUSH', KEYS[1], 1)
  redis.call('LTRIM', KEYS[1], 0, 0)
end
local next_due = -1
for i = 2 + levels, #KEYS do
  local head = redis.call('ZRANGE', KEYS[i], 0, 0, 'WITHSCORES')
  if head[2] then
    local wait = math.max(tonumber(head[2]) - now, 0)
    if next_due < 0 or wait < next_due then next_due = wait end
  end
end
return {moved, next_due}
