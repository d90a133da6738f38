#!lua
-- settle.lua: apply the outcomes of many runs at once (acknowledge, retry, recover, hand back, dead-letter),
-- exactly once.
--
-- KEYS[1] owners zset, KEYS[2] stats hash, KEYS[3] dead list, KEYS[4] unique hash, KEYS[5] wake list,
-- KEYS[6] the settling party's last call (a string, see "Calls" below), KEYS[7] the unique-popped hash (default
-- mode: unique id -> the owner that popped it),
-- KEYS[8 .. 7+L] ready lists, KEYS[8+L .. 7+2L] retry zsets, KEYS[8+2L .. 7+5L] quarantine lists (stages 1, 2, 3
-- for groups of 1, 8 and 64, each over the levels), and in safe mode KEYS[8+5L .. 7+6L] the processing hashes of
-- the owner whose tasks these are (all in level order), then with fence "owner" KEYS[8+6L] that owner's info hash
-- ARGV[1] fence: "owner" (the owner settles its own tasks) or "expired" (a monitor settles the tasks of an owner
--         whose lease ran out; nothing is applied unless it has)
-- ARGV[2] dead list bound; ARGV[3] number of levels L; ARGV[4] the delay poller's channel; ARGV[5] the owner
--         ("" in default mode); ARGV[6] the call's number (unique for the settling party)
-- then, for each level, A and A tokens: plain acknowledgements, applied in bulk (one HDEL per level)
-- then C: plain acknowledgements without a token (default mode), only counted
-- then records of 7: op, token, unique id, level (1-based), delay ms, payload, failed ("1" or "0")
--   op "ack":   done; the token leaves the processing area
--   op "retry": payload (the envelope with attempt + 1) goes to the front of its ready list now (delay 0) or
--               to the level's retry zset, due in delay ms; counted in "retried"
--   op "retry_isolated": as "retry" with no delay, to the front of the level's quarantine list of stage
--               "delay" (a crash while the task ran alone: stage 1)
--   op "recover": an expired lease's task, uncharged: payload (recovered + 1) to the front of its ready list;
--               counted in "recovered"
--   op "recover_isolated": as "recover", to the front of the level's quarantine list of stage "delay"
--   op "back":  handed back at shutdown: payload goes to the front of its ready list, attempt unchanged; its
--               unique id, if any, stays held (the task waits again) but no longer by the popping owner
--   op "dead":  payload (a dead record, a JSON object) is pushed on the dead list with "dead_at" stamped
-- A task whose token is not (or no longer) in its processing hash is stale and changes nothing: this fences a
-- slow owner against a monitor that already recovered its task, and two monitors against each other.
-- Default-mode records have an empty token and are never stale.
-- Returns {number of stale plain acknowledgements, then one integer per record: 1 applied, 0 stale, then the
-- owner's journal after this call (0 without an info hash)}.
--
-- Calls. A caller whose reply was lost sends the same call again (same KEYS[6], same ARGV[6]): the script then
-- returns the first call's result, stored in KEYS[6], without applying anything, so nothing is applied twice (a
-- default-mode retry queued twice, a dead letter recorded twice) and the caller learns what was applied. Each
-- settling party has its own KEYS[6] and makes one call at a time, so one stored result per party is enough.
--
-- Atomic: every key is checked for its type before anything is written, and the shebang makes Redis refuse the
-- whole script up front when it is out of memory, so the script applies all or nothing.
local owners, stats, dead, uniq, wake, last_call = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local popped = KEYS[7]
local fence, dead_max, levels, channel, owner = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4], ARGV[5]
local call = ARGV[6]
local READY, RETRY, QUARANTINE, PROCESSING = 7, 7 + levels, 7 + 2 * levels, 7 + 5 * levels
local OPS = {ack = true, retry = true, retry_isolated = true, recover = true, recover_isolated = true,
  back = true, dead = true}

local prior = redis.call('GET', last_call)
if prior then
  local bar = string.find(prior, '|', 1, true)
  if bar and string.sub(prior, 1, bar - 1) == call then
    local result = {}
    for n in string.gmatch(string.sub(prior, bar + 1), '[^,]+') do
      result[#result + 1] = tonumber(n)
    end
    return result
  end
end

local expected = {[owners] = 'zset', [stats] = 'hash', [dead] = 'list', [uniq] = 'hash', [wake] = 'list',
  [last_call] = 'string', [popped] = 'hash'}
for level = 1, levels do
  expected[KEYS[READY + level]] = 'list'
  expected[KEYS[RETRY + level]] = 'zset'
  for stage = 0, 2 do
    expected[KEYS[QUARANTINE + stage * levels + level]] = 'list'
  end
  if KEYS[PROCESSING + level] then expected[KEYS[PROCESSING + level]] = 'hash' end
end
-- The settling owner's info hash, whose journal counts its claims and settles (see renew.lua).
local info = KEYS[PROCESSING + levels + 1]
if info then expected[info] = 'hash' end
for key, kind in pairs(expected) do
  local found = redis.call('TYPE', key).ok
  if found ~= 'none' and found ~= kind then
    return redis.error_reply('WRONGTYPE settle.lua: ' .. key .. ' is a ' .. found .. ', not a ' .. kind ..
      '; nothing was applied')
  end
end
local records = 7
for level = 1, levels do
  records = records + 1 + tonumber(ARGV[records])
end
records = records + 1
for j = records, #ARGV, 7 do
  if not OPS[ARGV[j]] then
    return redis.error_reply('settle.lua: unknown op ' .. ARGV[j] .. '; nothing was applied')
  end
end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local done, retried, recovered, failed, dead_lettered = 0, 0, 0, 0, 0
local wake_fetchers, wake_poller = false, false
local live = true
if fence == 'expired' then
  local lease = redis.call('ZSCORE', owners, owner)
  live = lease ~= false and tonumber(lease) <= now
end
local stale = 0
local i = 7
for level = 1, levels do
  local acks = tonumber(ARGV[i])
  if acks > 0 then
    local tokens = {}
    for k = 1, acks do
      tokens[k] = ARGV[i + k]
    end
    local removed = redis.call('HDEL', KEYS[PROCESSING + level], unpack(tokens))
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
      ok = redis.call('HDEL', KEYS[PROCESSING + level], token)
    else
      ok = 0
    end
  end
  if ok == 1 then
    if ARGV[i + 6] == '1' then
      failed = failed + 1
    end
    if uid ~= '' then
      redis.call('HDEL', popped, uid)
    end
    if op == 'ack' then
      done = done + 1
      if uid ~= '' then
        redis.call('HDEL', uniq, uid)
      end
    elseif op == 'retry_isolated' or op == 'recover_isolated' then
      if op == 'retry_isolated' then retried = retried + 1 else recovered = recovered + 1 end
      redis.call('LPUSH', KEYS[QUARANTINE + (delay - 1) * levels + level], payload)
      wake_fetchers = true
    elseif op == 'retry' or op == 'back' or op == 'recover' then
      if op == 'retry' then
        retried = retried + 1
      elseif op == 'recover' then
        recovered = recovered + 1
      end
      if delay <= 0 then
        redis.call('LPUSH', KEYS[READY + level], payload)
        wake_fetchers = true
      else
        local zset = KEYS[RETRY + level]
        -- Members of a sorted set are unique, and two tasks can have the very same retry envelope (a producer
        -- pushed one envelope twice): trailing spaces, which JSON ignores, keep each a member of its own.
        while redis.call('ZADD', zset, 'NX', now + delay, payload) == 0 do
          payload = payload .. ' '
        end
        local head = redis.call('ZRANGE', zset, 0, 0)
        if head[1] == payload then
          wake_poller = true
        end
      end
    else
      dead_lettered = dead_lettered + 1
      redis.call('LPUSH', dead, '{"dead_at":' .. string.format('%d', now) .. ',' .. string.sub(payload, 2))
      if uid ~= '' then
        redis.call('HDEL', uniq, uid)
      end
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
if recovered > 0 then redis.call('HINCRBY', stats, 'recovered', recovered) end
if failed > 0 then redis.call('HINCRBY', stats, 'failed', failed) end
if wake_fetchers then
  redis.call('LPUSH', wake, 1)
  redis.call('LTRIM', wake, 0, 0)
end
if wake_poller then
  redis.call('PUBLISH', channel, now)
end
-- Only a registered owner has a journal: a late settle after the monitors forgot the owner must not bring its
-- info hash back.
if info and redis.call('EXISTS', info) == 1 then
  result[#result + 1] = redis.call('HINCRBY', info, 'journal', 1)
else
  result[#result + 1] = 0
end
-- Kept a day: long enough for any retry (a caller retries until Redis answers), then it cleans itself up
-- after a daemon that died.
redis.call('SET', last_call, call .. '|' .. table.concat(result, ','), 'PX', 86400000)
return result
