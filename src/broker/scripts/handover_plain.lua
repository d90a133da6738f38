-- handover_plain.lua: the settle that hands its freed slots over, made for the case that sets a limited queue's pace
-- (docs/PERFORMANCE.md, "A settle made for the handover of a plain queue"): the owner acknowledges tasks of K of its
-- claims (bitmaps, as settle.lua's), and the `max_running` slots they free go, in the same step, to the next tasks of
-- the ready lists, highest level first, as the claim of settle.lua's claim block (handover.lua) takes them. A queue
-- with `max_running` and none of rate limits, priority weights, type limits or groups; a call of acknowledgements
-- only (no record, no kept result, no note). It writes what settle.lua with that claim block writes for the call,
-- answers the same reply and stores it as settle.lua does, so that either script answers a copy of the other's call
-- sent again (tests/it/handover.rs compares the two, key by key).
--
-- It asks Redis the least that call must (about 24 commands, and few Lua steps: no argument offsets, closures or
-- type loops of the generic scripts), and leaves the rest to settle.lua, having written nothing: it answers
-- "GENERIC ...", and the daemon sends the same call to settle.lua (src/broker/plain_handover.rs). That is every
-- refusal (a key of another type, a counter that is not an integer: settle.lua's checks name them), and every case
-- but the plain one: a lost lease or a fenced claim, a pause, a throttle, a quarantined task or group, a claim list
-- counted under other scopes than `q` (or none), a claim gone (recovered by the monitors), a running count below
-- what the call frees, tasks past the claim's byte budget or max_task_bytes (settle.lua's claim cuts or
-- dead-letters them), a limit that the call leaves full (a rolling change of `max_running`).
--
-- KEYS[1] owners zset, [2] stats hash, [3] the settler's last call, [4] running hash, [5] wake list, [6] the owner's
-- info hash, [7] the queue's paused key, [8] its throttle; then, each in level order: [9 .. 8+L] ready lists,
-- [9+L .. 8+2L] the owner's claim sets, [9+2L .. 8+5L] quarantine lists (stage by stage), [9+5L .. 8+6L] the new
-- claim's lists, [9+6L .. 8+7L] their scopes strings; then, for each claim acknowledged, its list, its settled bitmap
-- and its scopes string.
-- ARGV[1] owner, [2] the call's number, [3] the new claim's number, [4] the most tasks to take (the daemon's free
-- workers), [5] max_running, [6] max_task_bytes, [7] the claim's byte budget, [8] L, [9] K, then K groups of 4, as
-- settle.lua's: the claim's level (1-based), its number, the acknowledged positions (a bitmap), how many.
-- Checks before it writes: every key it writes is read first (a read of another type is refused) or known absent,
-- and every counter it increments is read and found an integer. Its one write before a GENERIC is the copy of the
-- next tasks onto the new claim's lists (absent before), deleted again.
-- (`x == '1' and 1 or tonumber(x)`: a comparison of interned strings, where a tonumber costs some 1,800
-- instructions; and likewise `n == 1 and '1' or n` for a number given to Redis.)
local levels = ARGV[8] == '1' and 1 or tonumber(ARGV[8])
local claims = ARGV[9] == '1' and 1 or tonumber(ARGV[9])
local READY, SETS, QUARANTINE, NEW, SCOPES = 8, 8 + levels, 8 + 2 * levels, 8 + 5 * levels, 8 + 6 * levels
local CLAIMS = 8 + 7 * levels
-- (Its costs, as Redis runs it: docs/PERFORMANCE.md, "A settle made for the handover of a plain queue". Each table
-- is built whole by its constructor, as a table that grows is reallocated; a number given to Redis or put in the
-- stored reply is formatted by snprintf, some 2,000 instructions, so each is formatted once, and constants are
-- written as strings.)
local function generic(why)
  return redis.error_reply('GENERIC handover_plain.lua: ' .. why .. '; left to settle.lua')
end
-- Redis's refusal of a read (`redis.pcall`), as of a key of another type: an error is the one table a read of a
-- string, a count or a score answers.
local function refused(reply) return type(reply) == 'table' end
-- A counter HINCRBY takes, as Redis parses one: absent, 0, or digits without a leading 0.
local function integer(value)
  return not value or value == '0' or (#value <= 18 and string.match(value, '^-?[1-9]%d*$') ~= nil)
end

-- Reads, each its key's type check.
local prior = redis.pcall('GET', KEYS[3])
local done = redis.pcall('HGET', KEYS[2], 'done')
local running = redis.pcall('HMGET', KEYS[4], 'q', 'q:limit')
local info = redis.pcall('HMGET', KEYS[6], 'floor', 'group', 'journal', 'registered_at')
local lease = redis.pcall('ZSCORE', KEYS[1], ARGV[1])
if refused(prior) or refused(done) or running.err or info.err or refused(lease) then
  return generic('a key of another type')
end
-- Each level's ready tasks, and its claim set.
local waiting = {}
for i = 1, levels do
  waiting[i] = redis.pcall('LLEN', KEYS[READY + i])
  if refused(waiting[i]) or refused(redis.pcall('ZCARD', KEYS[SETS + i])) then
    return generic('a key of another type')
  end
end
-- The claims acknowledged: each list's length, its settled bits, its scopes.
local claim = {}
for k = 1, claims do
  local at, key = 6 + 4 * k, CLAIMS + 3 * k
  local list, bits, scopes = KEYS[key - 2], KEYS[key - 1], KEYS[key]
  local level, count = ARGV[at], ARGV[at + 3]
  local c = {level = level == '1' and 1 or tonumber(level), number = ARGV[at + 1], acks = ARGV[at + 2],
    count = count == '1' and 1 or tonumber(count),
    list = list, bits = bits, scopes = scopes, length = redis.pcall('LLEN', list), old = redis.pcall('GET', bits),
    named = redis.pcall('GET', scopes), fresh = 0, settled = 0}
  if refused(c.length) or refused(c.old) or refused(c.named) then return generic('a key of another type') end
  claim[k] = c
end
-- A call sent again (its reply was lost) answers the first call's result, whichever script applied it; a call
-- older than the stored one applies nothing (settle.lua, "Calls").
if prior then
  local bar = string.find(prior, '|', 1, true)
  local stored = bar and string.sub(prior, 1, bar - 1)
  if stored == ARGV[2] then
    local result = {}
    for n in string.gmatch(string.sub(prior, bar + 1), '[^,]+') do result[#result + 1] = tonumber(n) end
    return result
  end
  if stored and tonumber(stored) and tonumber(ARGV[2]) < tonumber(stored) then return {-1, tonumber(stored)} end
end
if not (integer(done) and integer(running[1]) and integer(running[2]) and integer(info[1]) and integer(info[3])) then
  local key = not integer(done) and KEYS[2] or (integer(running[1]) and integer(running[2]) and KEYS[6] or KEYS[4])
  return generic(key .. ' holds a counter that is not an integer')
end
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
lease = lease and tonumber(lease)
if not lease or lease <= now or not info[4] then return generic('no live lease') end
if info[1] and tonumber(ARGV[3]) < tonumber(info[1]) then return generic('a claim below the floor') end
if info[2] then return generic('a quarantined group') end
if redis.call('EXISTS', KEYS[7], KEYS[8], unpack(KEYS, QUARANTINE + 1, CLAIMS)) > 0 then
  return generic('a pause, a throttle, a quarantined task, or the claim made already')
end

-- What the call settles: each claim's new bits (`fresh`) and those it then has in all (`settled`), counted in `q`
-- alone. Bits merged into settled ones are OR-ed here, for bitmaps of up to 8 bytes (claims of up to 64 tasks;
-- settle.lua's BITOP takes the larger): so that what the call frees is known before the first write.
local freed, stale = 0, 0
for k = 1, claims do
  local c = claim[k]
  if not c.level or c.level < 1 or c.level > levels or not c.count or c.count < 1 or c.length == 0 or
      c.named ~= c.length .. ' q' then
    return generic('a claim that is not a plain one, whole')
  end
  if not c.old then
    c.fresh, c.settled = c.count, c.count
  else
    local width = math.max(#c.acks, #c.old)
    if width > 8 then return generic('a merge of a bitmap over 8 bytes') end
    local fresh, settled, merged = 0, 0, {}
    for j = 1, width do
      local a, o = string.byte(c.acks, j) or 0, string.byte(c.old, j) or 0
      local new, all = bit.band(a, bit.bnot(o)), bit.bor(a, o)
      merged[j] = all
      while new > 0 do new, fresh = bit.band(new, new - 1), fresh + 1 end
      while all > 0 do all, settled = bit.band(all, all - 1), settled + 1 end
    end
    c.fresh, c.settled, c.acks = fresh, settled, string.char(unpack(merged))
  end
  freed, stale = freed + c.fresh, stale + c.count - c.fresh
end
local q, known_limit = tonumber(running[1] or '0'), tonumber(running[2] or '0')
if q < freed then return generic('a running count below the tasks it frees') end
local max_running, max_bytes, budget = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local left = q - freed

-- The claim for the freed slots (claim.lua's, through handover_run.lua): up to the daemon's free workers and the
-- slots freed, within the limit, highest level first, copied natively (SORT ... STORE) and weighed; nothing that
-- would need cutting or checking one by one.
-- Each level's tasks taken, as a number and as the string given to Redis.
local taken, texts, took, room, max = {}, {}, 0, true, 0
for i = 1, levels do taken[i], texts[i] = 0, '0' end
if freed > 0 then
  max = math.min(tonumber(ARGV[4]), freed)
  if max >= max_running - left then max, room = max_running - left, false end
  if max <= 0 then return generic('a limit full after the call') end
  for i = 1, levels do
    local take = max - took
    if take > 0 and waiting[i] > 0 and (took == 0 or budget > 0) then
      local n = redis.call('SORT', KEYS[READY + i], 'BY', 'nosort', 'LIMIT', '0', take == 1 and '1' or take, 'STORE',
        KEYS[NEW + i])
      local bytes = redis.call('MEMORY', 'USAGE', KEYS[NEW + i], 'SAMPLES', '0')
      if bytes > max_bytes or (bytes > budget and n > (took == 0 and 1 or 0)) then
        local copies = {}
        for j = 1, i do copies[j] = KEYS[NEW + j] end
        redis.call('DEL', unpack(copies))
        return generic('tasks past the byte bounds')
      end
      budget, taken[i], texts[i], took = budget - bytes, n, n == 1 and '1' or tostring(n), took + n
    end
  end
end
-- Wake-up markers: claim.lua's pass of one to another fetcher (it took all it might, and tasks are left; or it
-- filled its own limit below a higher one another daemon noted), and settle.lua's for slots of a full count that
-- the claim did not fill.
local wake = false
if freed > 0 and ((took == max and room) or (took > 0 and left + took >= max_running and left + took < known_limit)) then
  for i = 1, levels do
    if waiting[i] > taken[i] then wake = true end
  end
end
if freed > 0 and q >= known_limit and took < freed then wake = true end
if wake and refused(redis.pcall('LLEN', KEYS[5])) then
  local copies = {}
  for j = 1, levels do copies[j] = KEYS[NEW + j] end
  redis.call('DEL', unpack(copies))
  return generic('a key of another type')
end

-- Writes. The owner's journal: the settle's bump, and the claim's when it took tasks (settle.lua's and claim.lua's
-- HINCRBYs, in one).
local journal = tonumber(info[3] or '0')
redis.call('HINCRBY', KEYS[6], 'journal', took > 0 and '2' or '1')
for k = 1, claims do
  local c = claim[k]
  local set = KEYS[SETS + c.level]
  if c.settled >= c.length then
    redis.call('DEL', c.list, c.bits, c.scopes, c.list .. ':progress')
    redis.call('ZREM', set, c.number)
  else
    redis.call('SET', c.bits, c.acks)
    redis.call('ZADD', set, 'XX', c.length - c.settled, c.number)
  end
end
-- The reply, and its text for the stored call (the same values; the strings of those formatted already).
local result, text
if freed == 0 then
  -- Nothing freed (every acknowledgement was stale): no claim (handover_run.lua's `handover_none`).
  result, text = {stale, journal + 1, 0, -1, 0}, {stale, journal + 1, '0', '-1', '0'}
  for i = 1, levels + 3 do result[5 + i], text[5 + i] = 0, '0' end
else
  for i = 1, levels do
    if taken[i] > 0 then
      redis.call('LTRIM', KEYS[READY + i], texts[i], '-1')
      redis.call('ZADD', KEYS[SETS + i], texts[i], ARGV[3])
      redis.call('SET', KEYS[SCOPES + i], texts[i] .. ' q')
    end
  end
  local count = left + took
  if count == 0 then
    redis.call('HDEL', KEYS[4], 'q')
    if known_limit ~= max_running then redis.call('HSET', KEYS[4], 'q:limit', ARGV[5]) end
  else
    -- At the limit, the count is max_running's own string.
    local value = count == max_running and ARGV[5] or count
    if known_limit ~= max_running then
      redis.call('HSET', KEYS[4], 'q', value, 'q:limit', ARGV[5])
    else
      redis.call('HSET', KEYS[4], 'q', value)
    end
  end
  local state = (took > 0 and count >= max_running) and '8' or '0'
  local last = took > 0 and journal + 2 or journal
  if levels == 1 then
    result = {stale, journal + 1, now, state == '8' and 8 or 0, 0, taken[1], 0, last, lease - now}
    text = {stale, journal + 1, now, state, '0', texts[1], '0', last, lease - now}
  else
    result, text = {stale, journal + 1, now, state == '8' and 8 or 0, 0}, {stale, journal + 1, now, state, '0'}
    for i = 1, levels do result[5 + i], text[5 + i] = taken[i], texts[i] end
    result[6 + levels], result[7 + levels], result[8 + levels] = 0, last, lease - now
    text[6 + levels], text[7 + levels], text[8 + levels] = '0', last, lease - now
  end
end
if stale == 0 then text[1] = '0' end
redis.call('SET', KEYS[3], ARGV[2] .. '|' .. table.concat(text, ','), 'PX', '86400000')
if freed > 0 then redis.call('HINCRBY', KEYS[2], 'done', freed == 1 and '1' or freed) end
if wake then
  redis.call('LPUSH', KEYS[5], '1')
  redis.call('LTRIM', KEYS[5], '0', '0')
end
return result
