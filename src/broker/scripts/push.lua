-- push.lua: enqueue tasks (protocol v1). Published: producers in any language may EVAL this file.
--
-- KEYS[1] ready list of the level      kmq:{Q}:ready:LEVEL
-- KEYS[2] delayed zset of the level    kmq:{Q}:delayed:LEVEL
-- KEYS[3] wake list                    kmq:{Q}:wake
-- KEYS[4] unique hash                  kmq:{Q}:unique
-- KEYS[5] stats hash                   kmq:{Q}:stats
-- ARGV[1] delay in ms relative to Redis's clock (0: none)
-- ARGV[2] due time in ms since the epoch (0: none; wins over ARGV[1])
-- ARGV[3] the delay poller's channel    kmq:{Q}:delay-wake
-- ARGV[4], ARGV[5], ... pairs of (unique id or "", envelope JSON)
-- Returns one integer per task: 1 accepted, 0 refused (its unique id is live, or the same envelope is
-- already delayed).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local due = tonumber(ARGV[2])
if due <= 0 and tonumber(ARGV[1]) > 0 then
  due = now + tonumber(ARGV[1])
end
local result, ready, accepted = {}, {}, 0
local earliest = nil
if due > now then
  local head = redis.call('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')
  earliest = tonumber(head[2])
end
for i = 4, #ARGV, 2 do
  local uid, envelope = ARGV[i], ARGV[i + 1]
  local ok = 1
  if uid ~= '' and redis.call('HSETNX', KEYS[4], uid, now) == 0 then
    ok = 0
  end
  if ok == 1 then
    -- Stamp the enqueue time on Redis's clock unless the producer set one.
    if not string.find(envelope, '"created_at"', 1, true) then
      envelope = '{"created_at":' .. string.format('%d', now) .. ',' .. string.sub(envelope, 2)
    end
    if due > now then
      ok = redis.call('ZADD', KEYS[2], 'NX', due, envelope)
      if ok == 0 and uid ~= '' then
        redis.call('HDEL', KEYS[4], uid)
      end
    else
      ready[#ready + 1] = envelope
    end
  end
  accepted = accepted + ok
  result[#result + 1] = ok
end
if #ready > 0 then
  redis.call('RPUSH', KEYS[1], unpack(ready))
  -- One marker wakes one idle fetcher; a fetcher that finds more than it can take passes the marker on.
  redis.call('LPUSH', KEYS[3], 1)
  redis.call('LTRIM', KEYS[3], 0, 0)
end
if due > now and accepted > 0 and (earliest == nil or due < earliest) then
  redis.call('PUBLISH', ARGV[3], due)
end
if accepted > 0 then
  redis.call('HINCRBY', KEYS[5], 'pushed', accepted)
end
return result
