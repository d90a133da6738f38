#!lua
-- claim.lua: safe mode. Atomically take up to ARGV[2] tasks into the owner's processing hashes: first, when the
-- owner runs no quarantined task, one quarantined task (to run alone), then ready tasks, highest priority first.
-- The owner's lease (one per daemon, renewed by its heartbeat) covers all of them.
--
-- KEYS[1] owners zset (owner -> lease deadline ms), KEYS[2] wake list, KEYS[3] the owner's info hash,
-- KEYS[4] dead list, KEYS[5] stats hash,
-- KEYS[6 .. 5+L] ready lists, KEYS[6+L .. 5+2L] quarantine lists, KEYS[6+2L .. 5+3L] the owner's processing
-- hashes (token -> envelope), all in level order
-- ARGV[1] owner; ARGV[2] the most tasks to take; ARGV[3] max_task_bytes; ARGV[4] dead list bound;
-- ARGV[5] queue name; ARGV[6] daemon (host:pid, for dead records); ARGV[7 ..] at least ARGV[2] tokens, unique
-- within the owner and increasing from call to call
-- Returns {now_ms, isolated level (0: none), isolated envelope (or false), {envelopes of level 1}, ...,
-- {envelopes of level L}}: the isolated task, if any, was stored under token ARGV[7], and the k-th envelope of
-- the level lists overall under the next tokens in order.
-- Fails with "LEASELOST ..." when the owner's lease is gone or past: its tasks then belong to the monitors, and
-- the daemon must register a new owner; with "FENCED ..." when ARGV[7] is below the owner's floor, which adopt.lua
-- raised after this call's reply was given up for lost: the call then takes nothing, so its tokens cannot
-- strand tasks.
--
-- A payload longer than max_task_bytes is never handed to a daemon: it goes straight to the dead list, kept
-- whole (as a JSON string) with its size in the reason.
--
-- This is the hot path: tokens come from the caller (formatting numbers in Lua costs more than everything else
-- here), no table is made per task unless a payload is too large, and counters replace `#t` (which is O(log n)
-- in Lua 5.1). Returning the envelopes joined into one string would spare the client's parser, but costs Redis
-- more than it saves (measured: docs/PERFORMANCE.md).
local levels = (#KEYS - 5) / 3
local READY, QUARANTINE, PROCESSING = 5, 5 + levels, 5 + 2 * levels
local owner, max, max_bytes = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lease = redis.call('ZSCORE', KEYS[1], owner)
if not lease or tonumber(lease) <= now then
  return redis.error_reply('LEASELOST owner ' .. owner .. ' has no live lease')
end
local info = redis.call('HMGET', KEYS[3], 'floor', 'isolated')
if info[1] and tonumber(ARGV[7]) < tonumber(info[1]) then
  return redis.error_reply('FENCED claim with token ' .. ARGV[7] .. ' below the floor ' .. info[1])
end
for i = 1, levels do
  local expected = {[KEYS[READY + i]] = 'list', [KEYS[QUARANTINE + i]] = 'list', [KEYS[PROCESSING + i]] = 'hash'}
  for key, kind in pairs(expected) do
    local found = redis.call('TYPE', key).ok
    if found ~= 'none' and found ~= kind then
      return redis.error_reply('WRONGTYPE claim.lua: ' .. key .. ' is a ' .. found .. ', not a ' .. kind)
    end
  end
end

local dead_lettered = 0
local function dead_oversized(payload)
  dead_lettered = dead_lettered + 1
  redis.call('LPUSH', KEYS[4], '{"dead_at":' .. string.format('%d', now) .. ',"queue":' .. cjson.encode(ARGV[5]) ..
    ',"id":"","type":"","attempt":0,"reason":"task is ' .. string.format('%d', #payload) ..
    ' bytes, more than max_task_bytes (' .. ARGV[3] .. '); it was not run","size":' ..
    string.format('%d', #payload) .. ',"daemon":' .. cjson.encode(ARGV[6]) .. ',"task":' .. cjson.encode(payload) ..
    '}')
end

local result = {now, 0, false}
local taken = 0
if max > 0 then
  -- One quarantined task at a time per owner: it runs while the owner runs no other, so if the daemon dies
  -- meanwhile, the monitors know which task to charge (monitor: LeaseExpired { ran_alone }).
  local busy = false
  if info[2] then
    local colon = string.find(info[2], ':', 1, true)
    local level = tonumber(string.sub(info[2], 1, colon - 1))
    if level and level <= levels then
      busy = redis.call('HEXISTS', KEYS[PROCESSING + level], string.sub(info[2], colon + 1)) == 1
    end
  end
  local i = 1
  while not busy and i <= levels do
    local payload = false
    if redis.call('LLEN', KEYS[QUARANTINE + i]) > 0 then
      payload = redis.call('LPOP', KEYS[QUARANTINE + i])
    end
    if payload and #payload > max_bytes then
      dead_oversized(payload)
    elseif payload then
      redis.call('HSET', KEYS[PROCESSING + i], ARGV[7], payload)
      redis.call('HSET', KEYS[3], 'isolated', i .. ':' .. ARGV[7])
      result[2], result[3] = i, payload
      taken = 1
      busy = true
    else
      i = i + 1
    end
  end
end
for i = 1, levels do
  local got = false
  if taken < max then
    got = redis.call('LPOP', KEYS[READY + i], max - taken)
  end
  if got then
    local oversized = false
    for k = 1, #got do
      if #got[k] > max_bytes then
        oversized = true
        break
      end
    end
    if oversized then
      local kept = {}
      for k = 1, #got do
        if #got[k] > max_bytes then
          dead_oversized(got[k])
        else
          kept[#kept + 1] = got[k]
        end
      end
      got = kept
    end
    if #got > 0 then
      local fields = {}
      for k = 1, #got do
        fields[2 * k - 1] = ARGV[6 + taken + k]
        fields[2 * k] = got[k]
      end
      redis.call('HSET', KEYS[PROCESSING + i], unpack(fields))
      taken = taken + #got
    end
    result[3 + i] = got
  else
    result[3 + i] = {}
  end
end
if dead_lettered > 0 then
  redis.call('LTRIM', KEYS[4], 0, tonumber(ARGV[4]) - 1)
  redis.call('HINCRBY', KEYS[5], 'dead_lettered', dead_lettered)
end
if taken == max then
  -- The queue may hold more than this fetcher can take: pass the wake-up on to another idle fetcher.
  for i = 1, levels do
    if redis.call('LLEN', KEYS[READY + i]) > 0 or redis.call('LLEN', KEYS[QUARANTINE + i]) > 0 then
      redis.call('LPUSH', KEYS[2], 1)
      redis.call('LTRIM', KEYS[2], 0, 0)
      break
    end
  end
end
return result
