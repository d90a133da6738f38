-- fire.lua: fire one slot of a periodic task, at most once across all daemons, with no leader and no lock: the
-- schedule's last fired slot only moves forward, and this script is the only writer.
--
-- KEYS[1] schedules hash P:{Q}:schedules (schedule name -> last fired slot, ms), KEYS[2] ready list of the level,
-- KEYS[3] wake list, KEYS[4] stats hash
-- ARGV[1] schedule name, ARGV[2] the slot (ms since the epoch), ARGV[3] the task's envelope
-- Returns {result, now_ms}: result 1 fired; 0 this slot, or a later one, was already fired; -1 the slot is not
-- due yet on Redis's clock.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local slot = tonumber(ARGV[2])
if slot > now then
  return {-1, now}
end
local last = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '-1')
if slot <= last then
  return {0, now}
end
redis.call('HSET', KEYS[1], ARGV[1], string.format('%d', slot))
redis.call('RPUSH', KEYS[2], '{"created_at":' .. string.format('%d', now) .. ',' .. string.sub(ARGV[3], 2))
redis.call('LPUSH', KEYS[3], 1)
redis.call('LTRIM', KEYS[3], 0, 0)
redis.call('HINCRBY', KEYS[4], 'pushed', 1)
return {1, now}
