-- settle.lua: apply the outcomes of many runs at once (acknowledge, retry, hand back, dead-letter).
--
-- KEYS[1] processing hash, KEYS[2] leases zset, KEYS[3] stats hash, KEYS[4] dead list, KEYS[5] unique hash,
-- KEYS[6] wake list, KEYS[7 .. 6+L] ready lists, KEYS[7+L .. 6+2L] retry zsets (both in level order)
-- ARGV[1] fence: "owner" (the claimer settles its own token) or "expired" (a monitor settles a token whose lease
--         has run out; skipped when the lease was renewed meanwhile)
-- ARGV[2] dead list bound; ARGV[3] number of levels L; ARGV[4] the delay poller's channel
-- ARGV[5] A, then A tokens: plain acknowledgements (safe mode, fence "owner"), applied in bulk: one HDEL, one ZREM
-- then C: plain acknowledgements without a token (default mode), only counted
-- then records of 7: op, token, unique id, level (1-based), delay ms, payload, failed ("1" or "0")
--   op "ack":   done; the token leaves the processing area
--   op "retry": payload (the envelope with attempt + 1) goes to the front of its ready list now (delay 0) or
--               to the level's retry zset, due in delay ms
--   op "back":  handed back at shutdown: payload goes to the front of its ready list, attempt unchanged
--   op "dead":  payload (a dead record, a JSON object) is pushed on the dead list with "dead_at" stamped
-- A record whose token is not (or no longer) in the processing area is stale and changes nothing: this fences a
-- slow owner against a monitor that already recovered its task, and two monitors against each other.
-- Default-mode records have an empty token and are never stale.
-- Returns {number of stale plain acknowledgements, then one integer per record: 1 applied, 0 stale}.
local proc, leases, stats, dead, uniq, wake = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local fence, dead_max, levels, channel = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local done, retried, failed, dead_lettered = 0, 0, 0, 0
local wake_fetchers, wake_poller = false, false
local acks = tonumber(ARGV[5])
local stale = 0
if acks > 0 then
  local tokens = {}
  for i = 6, 5 + acks do
    tokens[#tokens + 1] = ARGV[i]
  end
  local removed = redis.call('HDEL', proc, unpack(tokens))
  -- A stale token's lease went with its processing entry, so removing every token's lease is exact.
  redis.call('ZREM', leases, unpack(tokens))
  done = done + removed
  stale = acks - removed
end
done = done + tonumber(ARGV[6 + acks])
local result = {stale}
for i = 7 + acks, #ARGV, 7 do
  local op, token, uid = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  local level, delay, payload = tonumber(ARGV[i + 3]), tonumber(ARGV[i + 4]), ARGV[i + 5]
  local ok = 1
  if token ~= '' then
    if fence == 'expired' then
      local score = redis.call('ZSCORE', leases, token)
      if not score or tonumber(score) > now then
        ok = 0
      end
    end
    if ok == 1 then
      ok = redis.call('HDEL', proc, token)
      if ok == 1 then
        redis.call('ZREM', leases, token)
      end
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
        redis.call('LPUSH', KEYS[6 + level], payload)
        wake_fetchers = true
      else
        local zset = KEYS[6 + levels + level]
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
