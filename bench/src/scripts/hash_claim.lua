#!lua
-- claim.lua: safe mode. Atomically take up to ARGV[2] tasks into the owner's processing hashes, under the owner's
-- lease (one per daemon, renewed by its heartbeat).
--
-- KEYS[1] owners zset (owner -> lease deadline ms), KEYS[2] wake list, KEYS[3] the owner's info hash,
-- KEYS[4] dead list, KEYS[5] stats hash, KEYS[6] the queue's paused key (claims take nothing while it exists),
-- KEYS[7 .. 6+L] ready lists, KEYS[7+L .. 6+4L] quarantine lists (group sizes 1, 8, 64, each over the levels),
-- KEYS[7+4L .. 6+5L] the owner's processing hashes (token -> envelope), levels in order
-- ARGV[1] owner; ARGV[2] the most tasks to take; ARGV[3] max_task_bytes; ARGV[4] dead list bound;
-- ARGV[5] queue name; ARGV[6] daemon (host:pid, for dead records); ARGV[7 ..] at least ARGV[2] tokens, unique
-- within the owner and increasing from call to call
-- Returns {now_ms, state, group level, {group envelopes}, {envelopes of level 1}, ..., {envelopes of level L},
-- the owner's journal (see renew.lua)}:
--   state 0: ready tasks were claimed (level lists), highest level first;
--   state 1: a quarantined group was claimed, alone (group envelopes, all of `group level`);
--   state 2: nothing was claimed, because this owner must hold nothing while it runs a quarantined group, and
--            it still holds tasks (the caller waits for them to be settled, then claims again);
--   state 3: nothing was claimed, because the queue is paused (`kmqd queue pause`): the caller waits idle_poll
--            and claims again. Checked here, in the claim itself, so that no claim that runs after the pause
--            takes anything, whatever the daemon last saw;
-- the k-th envelope returned overall (group first) was stored under token ARGV[6 + k].
-- Fails with "LEASELOST ..." when the owner's lease is gone or past: its tasks then belong to the monitors (an
-- owner registered but missing from the owners zset is put back in it as expired, for them), and the daemon must
-- register a new owner; with "FENCED ..." when ARGV[7] is below the owner's floor, which
-- adopt.lua raised after this call's reply was given up for lost: the call then takes nothing, so its tokens
-- cannot strand tasks.
--
-- Quarantine. A task that came back twice from an expired lease waits in a quarantine list. An owner takes a
-- group from the most suspect non-empty list (alone first, then groups of 8, then of 64) only when it holds
-- nothing, and claims nothing else until that group is settled (the info hash's `group` records its size): if
-- the daemon dies meanwhile, the crash is the group's. Its tasks then come back in smaller groups, and a task
-- that crashes its daemon running alone is charged for it (monitor.rs). While quarantined tasks wait, an owner
-- claims no ready task: it finishes what it holds, then runs a group.
--
-- A payload longer than max_task_bytes is never handed to a daemon: it goes straight to the dead list, kept
-- whole (as a JSON string) with its size in the reason.
--
-- This is the hot path: tokens come from the caller (formatting numbers in Lua costs more than everything else
-- here), no table is made per task unless a payload is too large, and counters replace `#t` (which is O(log n)
-- in Lua 5.1). Returning the envelopes joined into one string would spare the client's parser, but costs Redis
-- more than it saves (measured: docs/PERFORMANCE.md).
local levels = (#KEYS - 6) / 5
local READY, QUARANTINE, PROCESSING = 6, 6 + levels, 6 + 4 * levels
local GROUPS = {1, 8, 64}
local owner, max, max_bytes = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lease = redis.call('ZSCORE', KEYS[1], owner)
if not lease or tonumber(lease) <= now then
  -- An owner whose lease entry is gone while its registration is there (Redis lost it, or it was removed by hand)
  -- is put back as expired, as renew.lua does, so that the monitors find what it holds: its daemon, told here,
  -- forgets it and never renews it again.
  if not lease and redis.call('EXISTS', KEYS[3]) == 1 then
    redis.call('ZADD', KEYS[1], 0, owner)
  end
  return redis.error_reply('LEASELOST owner ' .. owner .. ' has no live lease')
end
local info = redis.call('HMGET', KEYS[3], 'floor', 'group')
if info[1] and tonumber(ARGV[7]) < tonumber(info[1]) then
  return redis.error_reply('FENCED claim with token ' .. ARGV[7] .. ' below the floor ' .. info[1])
end
for i = 7, #KEYS do
  local found = redis.call('TYPE', KEYS[i]).ok
  local kind = 'list'
  if i > PROCESSING then kind = 'hash' end
  if found ~= 'none' and found ~= kind then
    return redis.error_reply('WRONGTYPE claim.lua: ' .. KEYS[i] .. ' is a ' .. found .. ', not a ' .. kind)
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
local stored = false
-- The owner's journal: one more for a claim that took something; its value ends the reply (see renew.lua).
local function finish(result)
  if dead_lettered > 0 then
    redis.call('LTRIM', KEYS[4], 0, tonumber(ARGV[4]) - 1)
    redis.call('HINCRBY', KEYS[5], 'dead_lettered', dead_lettered)
  end
  if stored then
    result[#result + 1] = redis.call('HINCRBY', KEYS[3], 'journal', 1)
  else
    result[#result + 1] = tonumber(redis.call('HGET', KEYS[3], 'journal') or '0')
  end
  return result
end
-- Drops the payloads over max_task_bytes from a popped list (copying it only when there is one).
local function keep_small(got)
  for k = 1, #got do
    if #got[k] > max_bytes then
      local kept = {}
      for j = 1, #got do
        if #got[j] > max_bytes then dead_oversized(got[j]) else kept[#kept + 1] = got[j] end
      end
      return kept
    end
  end
  return got
end
local function empty(state, level, group)
  local result = {now, state, level, group}
  for i = 1, levels do result[4 + i] = {} end
  return result
end
-- Stores `got` under the tokens from the `taken`-th on.
local function store(level, got, taken)
  local fields = {}
  for k = 1, #got do
    fields[2 * k - 1] = ARGV[6 + taken + k]
    fields[2 * k] = got[k]
  end
  redis.call('HSET', KEYS[PROCESSING + level], unpack(fields))
  stored = true
end

-- After the lease and floor checks, so that a paused queue still tells a lost lease or a fenced claim.
if redis.call('EXISTS', KEYS[6]) == 1 then
  return finish(empty(3, 0, {}))
end

local holds = false
for i = 1, levels do
  if redis.call('HLEN', KEYS[PROCESSING + i]) > 0 then
    holds = true
    break
  end
end
if info[2] then
  if holds then
    return finish(empty(2, 0, {}))
  end
  redis.call('HDEL', KEYS[3], 'group')
end
for stage = 1, 3 do
  for i = 1, levels do
    local list = KEYS[QUARANTINE + (stage - 1) * levels + i]
    if redis.call('LLEN', list) > 0 then
      if holds then
        return finish(empty(2, 0, {}))
      end
      local got = false
      if max > 0 then got = redis.call('LPOP', list, math.min(GROUPS[stage], max)) end
      got = keep_small(got or {})
      if #got == 0 then
        return finish(empty(0, 0, {}))
      end
      store(i, got, 0)
      redis.call('HSET', KEYS[3], 'group', GROUPS[stage])
      return finish(empty(1, i, got))
    end
  end
end

local result = {now, 0, 0, {}}
local taken = 0
for i = 1, levels do
  local got = false
  if taken < max then
    got = redis.call('LPOP', KEYS[READY + i], max - taken)
  end
  if got then
    got = keep_small(got)
    if #got > 0 then
      store(i, got, taken)
      taken = taken + #got
    end
    result[4 + i] = got
  else
    result[4 + i] = {}
  end
end
if taken == max then
  -- The queue may hold more than this fetcher can take: pass the wake-up on to another idle fetcher.
  for i = 1, levels do
    if redis.call('LLEN', KEYS[READY + i]) > 0 then
      redis.call('LPUSH', KEYS[2], 1)
      redis.call('LTRIM', KEYS[2], 0, 0)
      break
    end
  end
end
return finish(result)
