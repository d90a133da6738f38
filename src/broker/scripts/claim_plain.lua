-- claim_plain.lua: the claim made for the case an idle push waits on (issue 38; docs/PERFORMANCE.md, "A claim made
-- for the plain queue"): safe mode, a queue with none of max_running, rate limits, priority weights, type limits
-- (drained flows included) or groups, nothing quarantined or throttled. It takes the next ready tasks,
-- highest level first, as claim.lua takes them on that path, writes what claim.lua writes and answers what it
-- answers: it is sent with claim.lua's own KEYS and ARGV (src/broker/tasks.rs, `claim_call`), and
-- tests/it/plain_claim.rs compares the two, key by key.
--
-- It asks Redis the least such a claim must (ten commands for an idle queue's claim of one task, claim.lua's eleven
-- less its dead count, and none of its preludes, argument offsets, closures or type loops), and leaves every other
-- case to claim.lua, having written nothing: it answers "GENERIC ...", and the daemon sends the same call to
-- claim.lua. That is every refusal (a key of another type, a counter that is not an integer: claim.lua's checks name
-- them), a lost lease (claim.lua puts a lost owner back as expired) and a fenced claim, a throttle, a
-- quarantined task or an owner running a quarantined group, tasks past the claim's byte budget (claim.lua cuts the
-- copy) or max_task_bytes (claim.lua dead-letters them), and a call laid out for any limit.
--
-- KEYS and ARGV: claim.lua's (its header), for L levels and no limit: KEYS[1] owners zset, [2] wake list, [3] the
-- owner's info hash, [4] dead list, [5] stats hash, [6] paused key, [7] throttle, [8 .. 7+L] ready lists,
-- [8+L .. 7+4L] quarantine lists, [8+4L .. 7+5L] the owner's claim sets, [8+5L .. 7+6L] this claim's lists,
-- [8+6L .. 7+7L] their scopes strings, [8+7L] running hash. ARGV[1] owner, [2] the most tasks to take, [3]
-- max_task_bytes, [4] .. [6] (the dead records', unused here), [7] the claim's number, [8] max_running '0', [9]
-- rate windows '0', [10] weights '0', [11] type flows '0', [12] the foreign type field, [13] groups '0', [14] the
-- claim's byte budget.
-- Checks before it writes: every key it writes is read first (a read of another type is refused) or known absent,
-- and the counter it increments (the owner's journal) is read and found an integer. Its one write before a GENERIC
-- is the copy of the next tasks onto this claim's lists (absent before), deleted again.
local levels = (#KEYS - 8) / 7
local function generic(why)
  return redis.error_reply('GENERIC claim_plain.lua: ' .. why .. '; left to claim.lua')
end
if #ARGV ~= 14 or ARGV[8] ~= '0' or ARGV[9] ~= '0' or ARGV[10] ~= '0' or ARGV[11] ~= '0' or ARGV[13] ~= '0' or
    levels < 1 or levels % 1 ~= 0 then
  return generic('a call laid out for a limit')
end
local READY, QUARANTINE, CLAIMS, LISTS = 7, 7 + levels, 7 + 4 * levels, 7 + 5 * levels
-- Redis's refusal of a read (`redis.pcall`), as of a key of another type: an error is the one table a read of a
-- count or a score answers.
local function refused(reply) return type(reply) == 'table' end
-- The journal as HINCRBY parses it: absent, 0, or digits without a leading 0.
local function integer(value)
  return not value or value == '0' or (#value <= 18 and string.match(value, '^-?[1-9]%d*$') ~= nil)
end

-- Keys a plain claim finds absent: the pause, the throttle, the quarantine lists, this claim's lists and scopes
-- strings (claim.lua's `absent`); with them the wake list and the owner's claim sets, absent for an idle fetcher's
-- claim (its BLPOP took the marker; it holds nothing), whose look answers their type checks.
local idle = redis.call('EXISTS', KEYS[2], KEYS[6], KEYS[7], unpack(KEYS, QUARANTINE + 1, 7 + 7 * levels)) == 0
local paused = false
if not idle then
  local rare = {KEYS[6], KEYS[7], unpack(KEYS, QUARANTINE + 1, CLAIMS)}
  for i = LISTS + 1, 7 + 7 * levels do rare[#rare + 1] = KEYS[i] end
  local present = redis.call('EXISTS', unpack(rare))
  if present > 0 then
    -- The pause alone among them is answered here, as claim.lua answers it (state 3, nothing written), once every
    -- key claim.lua checks is found of its type: a paused queue's idle polls cost one script run each, not two.
    if present > 1 or redis.call('EXISTS', KEYS[6]) == 0 then
      return generic('a throttle, a quarantined task, or the claim made already')
    end
    paused = true
  end
end
local info = redis.pcall('HMGET', KEYS[3], 'floor', 'group', 'journal')
local lease = redis.pcall('ZSCORE', KEYS[1], ARGV[1])
if info.err or refused(lease) then return generic('a key of another type') end
if not (integer(info[1]) and integer(info[3])) then
  return generic(KEYS[3] .. ' holds a counter that is not an integer')
end
-- Each level's ready tasks; the read is the ready list's type check (a SORT would copy a set's or a zset's members).
local lengths = {}
for i = 1, levels do
  lengths[i] = redis.pcall('LLEN', KEYS[READY + i])
  if refused(lengths[i]) then return generic('a key of another type') end
end
if not idle then
  -- The claim sets this claim adds to: their reads are their type checks.
  for i = 1, levels do
    if refused(redis.pcall('ZCARD', KEYS[CLAIMS + i])) then return generic('a key of another type') end
  end
end
if paused then
  -- The keys claim.lua checks that a take would not have read: the wake and dead lists, the stats hash's dead count
  -- (an integer), the running hash.
  local dead_count = redis.pcall('HGET', KEYS[5], 'dead_lettered')
  if refused(dead_count) or refused(redis.pcall('LLEN', KEYS[2])) or refused(redis.pcall('LLEN', KEYS[4])) or
      refused(redis.pcall('HLEN', KEYS[8 + 7 * levels])) then
    return generic('a key of another type')
  end
  if not integer(dead_count) then return generic(KEYS[5] .. ' holds a counter that is not an integer') end
end
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
lease = lease and tonumber(lease)
if not lease or lease <= now then return generic('no live lease') end
if info[1] and tonumber(ARGV[7]) < tonumber(info[1]) then return generic('a claim below the floor') end
if paused then
  local result = {now, 3, 0}
  for i = 1, levels do result[3 + i] = 0 end
  result[4 + levels], result[5 + levels], result[6 + levels] = 0, tonumber(info[3] or '0'), lease - now
  return result
end
if info[2] then return generic('an owner that ran a quarantined group') end

-- The take: claim.lua's, copied natively (SORT ... STORE) and weighed, highest level first; nothing written to the
-- ready lists until every level's copy is weighed.
local max, max_bytes, budget = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[14])
if max < 1 then return generic('a claim of nothing') end
local taken, texts, took = {}, {}, 0
local function undo(why)
  redis.call('DEL', unpack(KEYS, LISTS + 1, LISTS + levels))
  return generic(why)
end
for i = 1, levels do
  taken[i], texts[i] = 0, '0'
  local take = max - took
  if take > 0 and lengths[i] > 0 and (took == 0 or budget > 0) then
    local n = redis.call('SORT', KEYS[READY + i], 'BY', 'nosort', 'LIMIT', '0', take == 1 and '1' or take, 'STORE',
      KEYS[LISTS + i])
    if n > 0 then
      local bytes = redis.call('MEMORY', 'USAGE', KEYS[LISTS + i], 'SAMPLES', '0')
      if bytes > max_bytes or (bytes > budget and n > (took == 0 and 1 or 0)) then
        return undo('tasks past the byte bounds')
      end
      budget, taken[i], texts[i], took = budget - bytes, n, n == 1 and '1' or tostring(n), took + n
    end
  end
end
-- claim.lua passes the wake-up on to another idle fetcher when it took all it might and a level holds tasks still:
-- the wake list's read is its type check, before the first write.
if took == max and not idle and refused(redis.pcall('LLEN', KEYS[2])) then return undo('a key of another type') end

-- Writes: claim.lua's `record` and `finish` for a plain claim.
local result = {now, 0, 0}
for i = 1, levels do
  result[3 + i] = taken[i]
  if taken[i] > 0 then
    redis.call('LTRIM', KEYS[READY + i], texts[i], '-1')
    redis.call('ZADD', KEYS[CLAIMS + i], texts[i], ARGV[7])
  end
end
if took == max then
  for i = 1, levels do
    if lengths[i] > taken[i] then
      redis.call('LPUSH', KEYS[2], '1')
      redis.call('LTRIM', KEYS[2], '0', '0')
      break
    end
  end
end
result[4 + levels] = 0
result[5 + levels] = took > 0 and redis.call('HINCRBY', KEYS[3], 'journal', '1') or tonumber(info[3] or '0')
result[6 + levels] = lease - now
return result
