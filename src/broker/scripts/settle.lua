-- settle.lua: apply the outcomes of many runs at once (acknowledge, retry, hand back, dead-letter).
--
-- KEYS[1] owners zset, KEYS[2] stats hash, KEYS[3] dead list, KEYS[4] unique hash, KEYS[5] wake list,
-- KEYS[6 .. 5+L] ready lists, KEYS[6+L .. 5+2L] retry zsets, and in safe mode KEYS[6+2L .. 5+3L] the
-- processing hashes of the owner whose tasks these are (all in level order)
-- ARGV[1] fence: "owner" (the owner settles its own tasks) or "expired" (a monitor settles the tasks of an owner
--         whose lease ran out; nothing is applied unless it has)
-- ARGV[2] dead list bound; ARGV[3] number of levels L; ARGV[4] the delay poller's channel; ARGV[5] the owner
--         ("" in default mode)
-- then, for each level, A and A tokens: plain acknowledgements, applied in bulk (one HDEL per level)
-- then C: plain acknowledgements without a token (default mode), only counted
-- then records of 7: op, token, unique id, level (1-based), delay ms, payload, failed ("1" or "0")
--   op "ack":   done; the token leaves the processing area
--   op "retry": payload (the envelope with attempt + 1) goes to the front of its ready list now (delay 0) or
--               to the level's retry zset, due in delay ms
--   op "back":  handed back at shutdown: payload goes to the front of its ready list, attempt unchanged
--   op "dead":  payload (a dead record, a JSON object) is pushed on the dead list with "dead_at" stamped
-- A task whose token is not (or no longer) in its processing hash is stale and changes nothing: this fences a
-- slow owner against a monitor that already recovered its task, and two monitors against each other.
-- Default-mode records have an empty token and are never stale.
-- Returns {number of stale plain acknowledgements, then one integer per record: 1 applied, 0 stale}.
local owners, stats, dead, uniq, wake = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local fence, dead_max, levels, channel, owner = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4], ARGV[5]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local done, retried, failed, dead_lettered = 0, 0, 0, 0
local wake_fetchers, wake_poller = false, false
local live = true
if fence == 'expired' then
  local lease = redis.call('ZSCORE', owners, owner)
  live = lease ~= false and tonumber(lease) <= now
end
local stale = 0
local i = 6
for level = 1, levels do
  local acks = tonumber(ARGV[i])
  if acks > 0 then
    local tokens = {}
    for k = 1, acks do
      tokens[k] = ARGV[i + k]
    end
    local removed = redis.call('HDEL', KEYS[5 + 2 * levels + level], unpack(tokens))
    done = done + removed
    stale = stale + acks - removed
  end
  i = i + 1 + acks
end
done = done + tonumber(ARGV[i])
i = i + 1
local result = {stale}
while i <= #ARGV do
  local op, token, uid = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  local level, delay, payload = tonumber(ARGV[i + 3]), tonumber(ARGV[i + 4]), ARGV[i + 5]
  local ok = 1
  if token ~= '' then
    if live then
      ok = redis.call('HDEL', KEYS[5 + 2 * levels + level], token)
    else
      ok = 0
    end
  end
  if ok == 1 then
    if ARGV[i + 6] == '1' then
      failed = failed + 1
    end
    if op == 'ack' then
      done = done + 1
      if uid ~= '' then
        redis.call('HDEL', uniq, uid)
      end
    elseif op == 'retry' or op == 'back' then
      if op == 'retry' then
        retried = retried + 1
      end
      if delay <= 0 then
        redis.call('LPUSH', KEYS[5 + level], payload)
        wake_fetchers = true
      else
        local zset = KEYS[5 + levels + level]
        redis.call('ZADD', zset, now + delay, payload)
        local head = redis.call('ZRANGE', zset, 0, 0)
        if head[1] == payload then
          wake_poller = true
        end
      end
    elseif op == 'dead' then
      dead_lettered = dead_lettered + 1
      redis.call('LPUSH', dead, '{"dead_at":' .. string.format('%d', now) .. ',' .. string.sub(payload, 2))
      if uid ~= '' then
        redis.call('HDEL', uniq, uid)
      end
    else
      return redis.error_reply('settle.lua: unknown op ' .. op)
    end
  end
  result[#result + 1] = ok
  i = i + 7
end
if dead_lettered > 0 then
  redis.call('LTRIM', dead, 0, dead_max - 1)
  redis.call('HINCRBY', stats, 'dead_lettered', dead_lettered)
end
if done > 0 then redis.call('HINCRBY', stats, 'done', done) end
if retried > 0 then redis.call('HINCRBY', stats, 'retried', retried) end
if failed > 0 then redis.call('HINCRBY', stats, 'failed', failed) end
if wake_fetchers then
  redis.call('LPUSH', wake, 1)
  redis.call('LTRIM', wake, 0, 0)
end
if wake_poller then
  redis.call('PUBLISH', channel, now)
end
return result
