-- (The broker prepends `#!lua`, rate.lua, turns.lua and types.lua: src/broker/mod.rs, `sources`.)
-- pop.lua: default mode. Take up to ARGV[2] tasks from the first non-empty list, each level's quarantine before
-- its ready list, highest level first: the tasks leave Redis (at most once). A unique task's id stays held, now
-- by the popping owner (recorded in the unique-popped hash), until its outcome is settled, or until a monitor
-- finds that owner's lease expired (a daemon that died with it: the task is lost, and its id must not be).
--
-- KEYS[1] unique hash, KEYS[2] unique-popped hash (id -> owner), KEYS[3] the queue's paused key (nothing is
-- popped while it exists), KEYS[4] the queue's throttle (nothing is popped while it exists: a handler's
-- back-pressure, set by settle.lua), KEYS[5] the running hash (scope -> tasks taken under its limit and not yet
-- settled), KEYS[6] the owner's popped-running hash (scope -> what of those it popped), KEYS[7] the queue's sched
-- hash (turns.lua's credits), KEYS[8] the owners zset (owner -> lease deadline ms), then the N lists to pop from,
-- in order (per level: its three quarantine lists, then its ready list), then for each of the R windows of the
-- queue's rate limit its log and its sum (rate.lua), then types.lua's keys (with type limits)
-- ARGV[1] owner; ARGV[2] the most tasks to take; ARGV[3] the queue's max_running (0: none); ARGV[4] R (0: no
-- rate limit), then R pairs: the window in ms, the most starts in any such window; then W, the levels' priority
-- weights (0: strict order), then W weights, one per level in order; then types.lua's block (its first value 0:
-- no type limits); last, the most bytes of tasks to take (at least one task is taken, whatever its size)
-- Returns {now_ms, index of the list popped (1-based among the N lists; 0: nothing popped), {payloads}, the
-- number of unique ids held in the queue, state, retry at, {counts}, {recorded}, {flows}}: state 0 popped (or all
-- empty),
-- 1 the queue is paused,
-- 2 a handler throttled it, 3 a window of its rate limit is full, 4 max_running of its tasks are taken and not
-- yet settled (the caller waits for a wake-up marker), 7 tasks wait but their types' limits hold every one back
-- (as claim.lua's state 7); retry at (states 2, 3 and 7) is when the throttle ends or the window's oldest start
-- ages out (Redis's clock, ms; in state 7, 0 when only a running slot will let one go), 0 otherwise. Nothing is
-- popped in states 1-4 and 7. With priority
-- weights and no quarantined task, a pop takes from every level that has tasks by their turns (turns.lua): the
-- reply's 7th element then counts the payloads of each level, in level order (they come in that order); it is
-- empty otherwise, and the index says the one list popped. `recorded` lists the positions (1-based among the
-- payloads) of the unique tasks whose id this pop recorded as held by the owner. `flows` (with type limits: empty
-- otherwise) gives, per payload in order, the 1-based index among the block's flows of the type whose running
-- count it was counted in (0: none), which the daemon's settle names (see "Type limits").
--
-- The holder of a unique id. A popped unique task holds its id through the owner that popped it: the id is freed
-- by that task's settle (settle.lua compares the unique-popped hash with the settling owner), or by a monitor once
-- that owner's lease ran out (release_unique.lua), never by another task's. So an owner must not pop once its
-- lease ran out: the monitors may have released its ids and forgotten it, and what it recorded then would name a
-- holder nobody releases. The pop fails with "LEASELOST ..." then, as a claim does, having written nothing (the
-- daemon gives the owner up and pops under a new one). And an id recorded as popped by another owner is left to
-- it: a second copy of the id (a producer's plain RPUSH of a unique envelope) does not hold it.
--
-- The daemon calls this only while unique ids are held in the queue; otherwise it pops with a plain LMPOP in a
-- transaction guarded by WATCH on the unique hash (Popper in src/broker/tasks.rs), which spares Redis converting
-- every payload into a Lua string and back. (Payloads over max_task_bytes are dead-lettered by the daemon: in
-- default mode a pop has read them anyway.)
-- Rate limit: a pop counts its starts as a claim does (rate.lua), so a default-mode queue's `rate_limit` holds
-- across daemons as a safe-mode one's. The tokens of a pop whose reply was lost are spent: at most once.
--
-- Running limit. With ARGV[3] > 0 a pop takes at most what leaves the running hash's `q` at or below it, and
-- adds what it took both to `q` and to the owner's share (KEYS[6] `q`): the popped tasks leave Redis, so their
-- slots are kept under the owner that popped them. settle.lua subtracts each settled task from both; release.lua
-- gives back the owner's whole share when the owner goes (its daemon stopped, or died and its lease ran out).
-- The daemon gives up an owner whose pop's reply was lost (the tasks are lost, their slots come back with it).
-- Type limits (`[[queues.limits]]`, types.lua), as claim.lua: a pop takes a task of a limited type only while
-- its type's limits admit it, as well as the queue's: from the type's flow first, then from the level's
-- quarantine and ready lists, where a task its type holds back is moved to its flow (`flow:LEVEL::TYPE`; retries
-- and recoveries to the flow's head) instead of blocking the tasks behind it, at most `4 x ARGV[2] + 256` tasks
-- looked at a level. Every task popped so is taken from its list by LPOP, one turn of the level at a time: the
-- tasks of a level come back in the reply in the order taken, `counts` says how many each level gave. What a
-- type with max_running took is added to its running count `t:TYPE` and to the owner's share of it (KEYS[6]
-- `t:TYPE`), as `q`: the popped tasks left Redis, so settle.lua subtracts each task the daemon settles from the
-- scope the reply's `flows` named for it (the daemon sends it back with the settlement), and release.lua gives
-- back every scope of the share when the owner goes. A pop with type limits is bounded by its count only, not
-- by the bytes (as the claim's: the daemon takes only for idle workers there).
--
-- Checks before it writes: the type of every key it touches (KEYS[3] is only tested for existence, KEYS[4] for its
-- time to live) and every rate log's entries and sum; a call that fails writes nothing (and pops nothing).
-- nil and the type of `key` when it is absent or of type `kind`, else the error reply that names it.
local function wrong_type(key, kind)
  local found = redis.call('TYPE', key).ok
  if found ~= 'none' and found ~= kind then
    return redis.error_reply('WRONGTYPE pop.lua: ' .. key .. ' is a ' .. found .. ', not a ' .. kind ..
      '; nothing was written')
  end
  return nil, found
end
-- A read of `key` (`command`, then its arguments after the key) that is also its type check, as claim.lua's `read`:
-- Redis refuses the read of a key of another type than the command's (`kind`), and a TYPE then names what it is,
-- a call fewer than a TYPE before each (docs/PERFORMANCE.md, "The idle take's Lua, line by line"). Returns the
-- reply, or nil and the refusal (Redis's own error, should it refuse the read for another reason).
local function read(key, kind, command, ...)
  local reply = redis.pcall(command, key, ...)
  if type(reply) == 'table' and reply.err then return nil, wrong_type(key, kind) or reply end
  return reply
end
-- The counts a plain pop sends as '0' (no running limit, no rate limit, no weights) are read without `tonumber`
-- then: a call of it costs Redis about 1,800 instructions, the comparison 300 (docs/PERFORMANCE.md, "The idle
-- take's Lua, line by line").
local max_running = ARGV[3] ~= '0' and tonumber(ARGV[3]) or 0
local rates = ARGV[4] ~= '0' and tonumber(ARGV[4]) or 0
local WEIGHTS = 5 + 2 * rates
local weights = ARGV[WEIGHTS] ~= '0' and tonumber(ARGV[WEIGHTS]) or 0
local weighted = weights > 0
-- The type limits' block (types.lua) follows the weights: its flows' count, and the keys it adds after the rate
-- logs (the levels' rings, then per flow one list a level, its throttle and its windows' logs and sums).
local TYPES = WEIGHTS + 1 + weights
local type_flows, type_other_keys = types_size(TYPES)
local per_level = 4
if type_flows > 0 then per_level = 5 + type_flows end
local FIRST = 9
local levels = (#KEYS - 8 - 2 * rates - type_other_keys) / per_level
local LAST = FIRST + 4 * levels - 1
local TYPE_KEYS = LAST + 2 * rates + 1
-- Keys a pop often finds absent, looked up together as claim.lua's are: those found absent need no call of their
-- own below (their type checks, the pause's and the throttle's EXISTS, the quarantine's LLENs, the unique ids'
-- HLEN), each call costing Redis about 5,000 instructions, and each key it names about 500 more (docs/PERFORMANCE.md,
-- "A claim that pays only for the script code it uses"). `idle`: the unique hashes, the pause, the throttle and the
-- quarantine lists, all absent when a queue without unique ids pops a task just pushed (default mode's idle take:
-- one EXISTS for it); `absent`: the pause, the throttle and the quarantine lists, nearly always absent, looked up
-- again when a unique id is held. Read before any write, and nothing writes to these keys before it looks at them.
local quarantine = {}
for i = FIRST, LAST do
  if (i - FIRST) % 4 ~= 3 then quarantine[#quarantine + 1] = KEYS[i] end
end
local idle = redis.call('EXISTS', KEYS[1], KEYS[2], KEYS[3], KEYS[4], unpack(quarantine)) == 0
local absent = idle or redis.call('EXISTS', KEYS[3], KEYS[4], unpack(quarantine)) == 0
-- Every key's type (types.lua's keys are checked by types_read); `unique_ids`: whether the unique hash exists.
local refused, unique_ids = nil, not idle
for i = 1, TYPE_KEYS - 1 do
  -- Whether KEYS[i] needs no type check: known absent, the paused key (only its existence counts), a key whose read
  -- below is its check (`read`: the owners zset, and the running hashes under a running limit without type limits),
  -- or a key this pop does not touch: the running hashes but under a running limit or type limits, the sched hash
  -- but with priority weights (a key the call does not touch cannot make it fail). (Worked out here, not by a
  -- function of its own: a call a key costs more than the test, as in claim.lua.)
  local known = idle and i < 3
  if i == 3 or i == 8 then
    known = true
  elseif i == 4 or (i >= FIRST and i <= LAST and (i - FIRST) % 4 ~= 3) then
    known = absent
  elseif i == 5 or i == 6 then
    known = type_flows == 0
  elseif i == 7 then
    known = not weighted
  end
  if not refused and not known then
    local kind = 'list'
    if i == 4 then
      kind = 'string'
    elseif i < FIRST then
      kind = 'hash'
    elseif i > LAST and (i - LAST) % 2 == 0 then
      kind = 'string'
    end
    local found
    refused, found = wrong_type(KEYS[i], kind)
    if i == 1 then unique_ids = found ~= 'none' end
  end
end
if refused then return refused end
-- How many unique ids the queue holds (the reply's fourth element).
local function held_ids()
  if not unique_ids then return 0 end
  return redis.call('HLEN', KEYS[1])
end
local integer = integer_check('pop.lua')
-- Each prelude's functions are defined only for a call that uses them (`rate_parts` and the others: rate.lua says
-- why).
local windows
if rates > 0 then
  rate_parts()
  windows, refused = rate.read('pop.lua', rates, LAST + 1, 5, integer)
  if refused then return refused end
end
local credits
if weighted then
  turns_parts()
  credits, refused = turns.read('pop.lua', KEYS[7], levels, integer)
  if refused then return refused end
end
-- The type limits' flows, their keys and counts (types.lua), and the owner's share of each counted type, read and
-- checked before any write.
local flowing = type_flows > 0
local block
if flowing then
  types_parts()
  block, refused = types.read('pop.lua', TYPES, TYPE_KEYS, levels, KEYS[5], integer)
  if refused then return refused end
  for _, flow in ipairs(block.flows) do
    if flow.max_running > 0 then
      refused = integer(KEYS[6], flow.scope, redis.call('HGET', KEYS[6], flow.scope))
      if refused then return refused end
    end
  end
end
local running, known_limit = 0, 0
if max_running > 0 then
  local value, share
  value, refused = read(KEYS[5], 'hash', 'HMGET', 'q', 'q:limit')
  if refused then return refused end
  share, refused = read(KEYS[6], 'hash', 'HGET', 'q')
  if refused then return refused end
  refused = integer(KEYS[5], 'q', value[1]) or integer(KEYS[5], 'q:limit', value[2]) or integer(KEYS[6], 'q', share)
  if refused then return refused end
  running, known_limit = tonumber(value[1] or '0'), tonumber(value[2] or '0')
end
local t = redis.call('TIME')
-- (Lua's arithmetic converts TIME's strings itself, at half a tonumber's cost.)
local now = t[1] * 1000 + math.floor(t[2] / 1000)
-- Before the pause, as claim.lua: an owner whose lease is gone or past pops nothing (see "The holder"). The read is
-- the owners zset's type check (`read`), still before any write.
local lease
lease, refused = read(KEYS[8], 'zset', 'ZSCORE', ARGV[1])
if refused then return refused end
if not lease or tonumber(lease) <= now then
  return redis.error_reply('LEASELOST owner ' .. ARGV[1] .. ' has no live lease')
end
-- One EXISTS for both keys, as claim.lua (none when the keys looked up above were absent).
if not absent and redis.call('EXISTS', KEYS[3], KEYS[4]) > 0 then
  if redis.call('EXISTS', KEYS[3]) == 1 then
    return {now, 0, {}, held_ids(), 1, 0, {}, {}, {}}
  end
  rate_parts()
  local ends = rate.throttle_until(KEYS[4], now)
  if ends then
    return {now, 0, {}, held_ids(), 2, ends, {}, {}, {}}
  end
end
local max = tonumber(ARGV[2])
-- The limit this pop counts under, for the settles that free a slot to tell whether to wake a fetcher: written once
-- nothing after it can fail (as claim.lua).
local function note_limit()
  if max_running > 0 and known_limit ~= max_running then redis.call('HSET', KEYS[5], 'q:limit', max_running) end
end
if max_running > 0 then
  if running >= max_running then
    note_limit()
    return {now, 0, {}, held_ids(), 4, 0, {}, {}, {}}
  end
  max = math.min(max, max_running - running)
end
if rates > 0 then
  local free, due, bad = rate.trim('pop.lua', windows, now)
  if bad then return bad end
  if due > 0 then
    return {now, 0, {}, held_ids(), 3, due, {}, {}, {}}
  end
  max = math.min(max, free)
end
note_limit()
-- The ready list of level `level`: the fourth of its lists.
local function ready(level) return KEYS[FIRST + 4 * level - 1] end
-- Quarantined tasks first, as in strict order: they wait to run in small groups.
local quarantined = false
if weighted then
  for i = FIRST, LAST do
    if not absent and (i - FIRST) % 4 ~= 3 and redis.call('LLEN', KEYS[i]) > 0 then
      quarantined = true
      break
    end
  end
end
local items, index, counts
-- With type limits: the flow index (types.lua's block) each popped task counted in, in the order of `items`.
local counted = {}
if flowing then
  -- With type limits, a level's take (types.lua's `types_take`, see "Type limits"): from its flows, then its
  -- quarantine and ready lists, each task into `taken[level]`, with the index of the flow it counted in (0: none);
  -- defined only for a pop with type limits.
  local SCAN = 4 * max + 256
  local index_of = {}
  for f, flow in ipairs(block.flows) do index_of[flow] = f end
  local taken = {}
  local function take_flowing(level, take)
    local into = {items = {}, counted = {}}
    taken[level] = into
    local lists = {}
    for i = FIRST + 4 * (level - 1), FIRST + 4 * level - 1 do lists[#lists + 1] = KEYS[i] end
    return types.take(block, level, lists, take, SCAN, function(flow, payload)
      into.items[#into.items + 1] = payload
      local f = 0
      if flow then
        flow.taken = flow.taken + 1
        if flow.max_running > 0 then f = index_of[flow] end
      end
      into.counted[#into.counted + 1] = f
    end)
  end
  local bad = types.admit('pop.lua', block, KEYS[5], now)
  if bad then return bad end
  items, index, counts = {}, 0, {}
  local want
  if weighted then
    -- The tasks a level holds that this pop may take: its lists, and its flows that their limits admit.
    local available = {}
    for level = 1, levels do
      local n = 0
      for i = FIRST + 4 * (level - 1), FIRST + 4 * level - 1 do n = n + redis.call('LLEN', KEYS[i]) end
      for _, flow in ipairs(block.flows) do
        if flow.room ~= 0 then n = n + redis.call('LLEN', flow.lists[level]) end
      end
      available[level] = n
    end
    want = turns.split(KEYS[7], {unpack(ARGV, WEIGHTS + 1, WEIGHTS + levels)}, credits, available, max)
  end
  local total = 0
  for level = 1, levels do
    local take = max - total
    if want then take = want[level] end
    counts[level] = 0
    if take > 0 then counts[level] = take_flowing(level, take) end
    total = total + counts[level]
  end
  -- A level's turns may fall on tasks their types hold back: the pop then takes what it still may from the levels
  -- that took nothing, in strict order, as claim.lua does.
  if want and total < max then
    for level = 1, levels do
      if counts[level] == 0 and total < max then
        counts[level] = take_flowing(level, max - total)
        total = total + counts[level]
      end
    end
  end
  for level = 1, levels do
    for k, payload in ipairs(taken[level] and taken[level].items or {}) do
      items[#items + 1] = payload
      counted[#counted + 1] = taken[level].counted[k]
    end
  end
elseif weighted and not quarantined then
  local available = {}
  for level = 1, levels do available[level] = redis.call('LLEN', ready(level)) end
  local want = turns.split(KEYS[7], {unpack(ARGV, WEIGHTS + 1, WEIGHTS + levels)}, credits, available, max)
  items, index, counts = {}, 0, {}
  for level = 1, levels do
    counts[level] = 0
    if want[level] > 0 then
      local got = redis.call('LPOP', ready(level), want[level]) or {}
      for _, item in ipairs(got) do items[#items + 1] = item end
      counts[level] = #got
    end
  end
else
  local args = {LAST - FIRST + 1}
  for i = FIRST, LAST do
    args[#args + 1] = KEYS[i]
  end
  args[#args + 1], args[#args + 2], args[#args + 3] = 'LEFT', 'COUNT', max
  local popped = redis.call('LMPOP', unpack(args))
  items, index, counts = {}, 0, {}
  if popped then
    for i = FIRST, LAST do
      if KEYS[i] == popped[1] then
        index = i - FIRST + 1
        break
      end
    end
    items = popped[2]
  end
end
-- Bytes (review M8): a pop hands the daemon no more than the budget (at least one task), so the tasks popped
-- past it go back to the front of the lists they came from, in their order, in this same step: as if they had
-- not been popped. Before anything is counted of them.
local budget = tonumber(ARGV[#ARGV])
if budget and #items > 1 and not flowing then
  local kept, bytes = 0, 0
  for k = 1, #items do
    bytes = bytes + #items[k]
    if k > 1 and bytes > budget then break end
    kept = k
  end
  -- Pushes items[from..to] back to the front of `list` (the last one pushed is the head).
  local function back(list, from, to)
    local again = {}
    for k = to, from, -1 do again[#again + 1] = items[k] end
    redis.call('LPUSH', list, unpack(again))
  end
  if kept < #items and index == 0 then
    -- Taken by turns: each level's tasks, in level order, `counts` of each.
    local last = #items
    for level = levels, 1, -1 do
      local first = last - counts[level] + 1
      local from = math.max(first, kept + 1)
      if from <= last then
        back(ready(level), from, last)
        counts[level] = counts[level] - (last - from + 1)
      end
      last = first - 1
    end
  elseif kept < #items then
    back(KEYS[FIRST + index - 1], kept + 1, #items)
  end
  for k = #items, kept + 1, -1 do items[k] = nil end
end
local held = held_ids()
if #items == 0 then
  if flowing then
    -- Nothing taken though tasks wait, because their types' limits hold them back (state 7).
    local any, at = types.held(block)
    if any then return {now, 0, {}, held, 7, at, {}, {}, {}} end
  end
  return {now, 0, {}, held, 0, 0, {}, {}, {}}
end
if rates > 0 then rate.spend(windows, #items, now) end
if max_running > 0 then
  redis.call('HINCRBY', KEYS[5], 'q', #items)
  redis.call('HINCRBY', KEYS[6], 'q', #items)
end
if flowing then
  types.scopes_spend(block.flows, KEYS[5], now)
  for _, flow in ipairs(block.flows) do
    if flow.taken > 0 and flow.max_running > 0 then redis.call('HINCRBY', KEYS[6], flow.scope, flow.taken) end
  end
end
local recorded = {}
if held > 0 then
  for k = 1, #items do
    -- Decoding costs, so only where a unique id may be held and the payload says "unique".
    if string.find(items[k], '"unique"', 1, true) then
      local ok, task = pcall(cjson.decode, items[k])
      if ok and type(task) == 'table' and task.unique == true and type(task.id) == 'string'
          and redis.call('HEXISTS', KEYS[1], task.id) == 1
          and redis.call('HSETNX', KEYS[2], task.id, ARGV[1]) == 1 then
        recorded[#recorded + 1] = k
      end
    end
  end
end
return {now, index, items, held, 0, 0, counts, recorded, counted}
