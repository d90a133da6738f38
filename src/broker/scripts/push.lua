-- push.lua: enqueue tasks (protocol v1). Published: producers in any language may EVAL this file.
--
-- KEYS[1] ready list of the level      P:{Q}:ready:LEVEL
-- KEYS[2] delayed zset of the level    P:{Q}:delayed:LEVEL      (member: task id, score: due ms)
-- KEYS[3] delayed tasks hash           P:{Q}:delayed-tasks      (task id -> envelope)
-- KEYS[4] wake list                    P:{Q}:wake
-- KEYS[5] unique hash                  P:{Q}:unique
-- KEYS[6] stats hash                   P:{Q}:stats
-- ARGV[1] delay in ms relative to Redis's clock (0: none)
-- ARGV[2] due time in ms since the epoch (0: none; wins over ARGV[1])
-- ARGV[3] the delay poller's channel    P:{Q}:delay-wake
-- ARGV[4..] triples: task id, unique ("1" or "0"), envelope JSON (whose "id" should be the same id)
-- A delayed task and a unique task need an id. Returns one integer per task: 1 accepted, 0 refused (its unique
-- id is live, or a delayed task with its id is already waiting).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local due = tonumber(ARGV[2])
if due <= 0 and tonumber(ARGV[1]) > 0 then
  due = now + tonumber(ARGV[1])
end
local delayed = due > now
-- Refuse the whole call before writing anything when an id is missing.
for i = 4, #ARGV, 3 do
  if ARGV[i] == '' and (delayed or ARGV[i + 1] == '1') then
    return redis.error_reply('push.lua: a delayed or unique task needs an id (task ' .. ((i - 1) / 3) .. ')')
  end
end
local result, ready, accepted = {}, {}, 0
local earliest = nil
if delayed then
  local head = redis.call('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')
  earliest = tonumber(head[2])
end
for i = 4, #ARGV, 3 do
  local id, unique, envelope = ARGV[i], ARGV[i + 1] == '1', ARGV[i + 2]
  local ok = 1
  if unique and redis.call('HSETNX', KEYS[5], id, now) == 0 then
    ok = 0
  end
  if ok == 1 then
    -- Stamp the enqueue time on Redis's clock unless the producer set one.
    if not string.find(envelope, '"created_at"', 1, true) then
      envelope = '{"created_at":' .. string.format('%d', now) .. ',' .. string.sub(envelope, 2)
    end
    if delayed then
      ok = redis.call('HSETNX', KEYS[3], id, envelope)
      if ok == 1 then
        redis.call('ZADD', KEYS[2], due, id)
      elseif unique then
        redis.call('HDEL', KEYS[5], id)
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
  redis.call('LPUSH', KEYS[4], 1)
  redis.call('LTRIM', KEYS[4], 0, 0)
end
if delayed and accepted > 0 and (earliest == nil or due < earliest) then
  redis.call('PUBLISH', ARGV[3], due)
end
if accepted > 0 then
  redis.call('HINCRBY', KEYS[6], 'pushed', accepted)
end
return result
