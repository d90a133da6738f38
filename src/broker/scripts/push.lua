-- push.lua: enqueue tasks (protocol v1). Published: producers in any language may EVAL this file.
--
-- KEYS[1] ready list of the level      P:{Q}:ready:LEVEL
-- KEYS[2] delayed zset of the level    P:{Q}:delayed:LEVEL      (member: task id, score: due ms)
-- KEYS[3] delayed tasks hash           P:{Q}:delayed-tasks      (task id -> envelope)
-- KEYS[4] wake list                    P:{Q}:wake
-- KEYS[5] unique hash                  P:{Q}:unique
-- KEYS[6] stats hash                   P:{Q}:stats
-- KEYS[7] (optional) routes hash           P:{Q}:routes     (see "Groups")
-- ARGV[1] delay in ms relative to Redis's clock (0: none)
-- ARGV[2] due time in ms since the epoch (0: none; wins over ARGV[1])
-- ARGV[3] the delay poller's channel    P:{Q}:delay-wake
-- ARGV[4..] triples: task id, options, envelope JSON (whose "id" should be the same id). Options: "1" (unique),
-- "0" (none), or a comma-separated list of words: "unique", "unique_for=MS" (unique, and the id stays held MS ms
-- after its task ended), "debounce" (a delayed task that replaces the delayed task of its id at this level, its
-- due time moved to this call's; docs/PROTOCOL.md, "Debounce, and unique for a time"). An unknown word refuses the
-- call, so that an option is never silently dropped.
-- Unique for a time. A unique_for task's field in the unique hash is "NOW:MS"; the settle that ends it (settle.lua,
-- unique_hold.lua) leaves the string key UNIQUE_HASH:held:ID behind it, expiring MS later by itself, and every unique
-- push here is refused while that key exists. (Built from KEYS[5]'s name, so in its slot; a producer's user
-- without `+exists` on it, made from an older kmqd's rules, pushes as before without seeing holds.)
-- A delayed task and a unique task need an id. Returns one integer per task: 1 accepted (or, debounced, replaced),
-- 0 refused (its unique id is live, or a delayed task with its id is already waiting; debounced: at another
-- level).
-- An envelope that is a JSON object without a top-level "created_at" gets "created_at":NOW_MS (Redis's clock)
-- written right after its opening brace, the rest kept byte for byte. Anything else is stored as it came: an
-- envelope with a top-level "created_at", and a payload that is not a JSON object (the daemon dead-letters it
-- with its exact bytes). Only a payload with the text "created_at" in it is decoded, to keep pushes cheap, so
-- text shaped like an object ({" ... }) that is not JSON gets the stamp too, and so does an object whose
-- "created_at" key is written with \u escapes (docs/PROTOCOL.md).
-- Groups. While the queue's daemons take turns between groups (`[queues.groups]`: they set KEYS[7]'s field
-- `groups` to 1), a task pushed now goes to its group's flow (`P:{Q}:flow:LEVEL:GROUP:`, the group being the
-- envelope's `group`, percent-encoded, or the empty name for a task without a valid one), and the flow joins the
-- level's ring (`P:{Q}:ring:LEVEL`, at the level's virtual time, `vt:LEVEL` of `P:{Q}:sched`) if it was not in it:
-- the claims then give the groups turns from the first task on. The names are built here from KEYS[7]'s and
-- KEYS[1]'s, which must be the queue's (docs/PROTOCOL.md, "Groups"); a payload is decoded only when it holds the
-- text "group" (or an escape). Without KEYS[7], or while no daemon routes, the task goes to the ready list, and
-- the first claim moves it to its group's flow.
-- Checks before it writes: a call that fails writes nothing, takes no unique id, and can be sent again. It
-- fails when a key it would write is of another type ("WRONGTYPE push.lua: KEY is a string, not a list"), when
-- the stats hash's `pushed` is not an integer ("ERR push.lua: KEY field pushed is not an integer"), or when a
-- delayed or unique task has no id. (The type and counter checks need TYPE and HGET: an ACL user without them,
-- made from the producers' rules of an older kmqd, pushes as before, unchecked.) Any number of tasks may come in
-- one call (they are pushed 1,000 at a time).
local t = redis.call('TIME')
-- (Lua's arithmetic converts TIME's strings itself, at half a `tonumber`'s cost; and a plain push's delay and due
-- time, '0', are read without one: a call of `tonumber` costs Redis about 1,800 instructions, a comparison 300.)
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local stamp = '"created_at":' .. string.format('%d', now)
local function stamped(envelope)
  -- An object starts at the first byte that is not JSON whitespace (almost always the first byte)...
  local open = 1
  if string.byte(envelope, 1) ~= 123 then
    open = string.find(envelope, '[^ \t\n\r]')
    if open == nil or string.byte(envelope, open) ~= 123 then
      return envelope
    end
  end
  -- ... and ends at the last one.
  local close = #envelope
  local last = string.byte(envelope, close)
  while last == 32 or last == 9 or last == 10 or last == 13 do
    close = close - 1
    last = string.byte(envelope, close)
  end
  if last ~= 125 then
    return envelope
  end
  -- Then comes its first key, or its end: {} and { } take the stamp without a comma.
  local first = open + 1
  if string.byte(envelope, first) ~= 34 then
    first = string.find(envelope, '[^ \t\n\r]', first)
  end
  local comma = ','
  if first == close then
    comma = ''
  elseif string.byte(envelope, first) ~= 34 then
    return envelope
  elseif string.find(envelope, '"created_at"', first, true) then
    -- Only decoding tells a top-level "created_at" from one in data, in a string or in a longer key; decoding
    -- only then keeps pushes cheap. cjson.decode stops at a NUL byte, which JSON never holds unescaped (it also
    -- takes a few things kmqd's decoder refuses, such as the numbers 01 and nan: those are stamped).
    if string.find(envelope, '\0', first, true) then
      return envelope
    end
    local decoded, object = pcall(cjson.decode, envelope)
    if not decoded or object['created_at'] ~= nil then
      return envelope
    end
  end
  if open == 1 then
    return '{' .. stamp .. comma .. string.sub(envelope, 2)
  end
  return string.sub(envelope, 1, open) .. stamp .. comma .. string.sub(envelope, open + 1)
end
local due = ARGV[2] == '0' and 0 or tonumber(ARGV[2])
if due <= 0 and ARGV[1] ~= '0' and tonumber(ARGV[1]) > 0 then
  due = now + tonumber(ARGV[1])
end
local delayed = due > now
-- Refuse the whole call before writing anything when an id is missing or an option unknown. Options other than
-- "0" and "1" are read into `uniques` and `debounces` (by the task's index), made by the first such task, so a
-- plain push builds neither table and, but for this loop's one comparison, looks at neither (`listed`).
local uniques, debounces, hold_for, listed = nil, nil, nil, false
for i = 4, #ARGV, 3 do
  local options = ARGV[i + 1]
  if options ~= '0' and options ~= '1' then
    if not listed then listed, uniques, debounces, hold_for = true, {}, {}, {} end
    local task = ' (task ' .. ((i - 1) / 3) .. '); nothing was written'
    for word in string.gmatch(options, '[^,]+') do
      -- A hold of 1 ms to about 30 years.
      local ms = string.match(word, '^unique_for=([1-9]%d*)$')
      if ms and #ms > 12 then ms = nil end
      if word == 'unique' then
        uniques[i] = true
      elseif ms then
        uniques[i] = true
        hold_for[i] = ms
      elseif word == 'debounce' then
        debounces[i] = true
      else
        return redis.error_reply('ERR push.lua: unknown option ' .. string.sub(word, 1, 40) .. task)
      end
    end
    if debounces[i] and uniques[i] then
      return redis.error_reply('ERR push.lua: debounce does not combine with unique' .. task)
    end
    if debounces[i] and not delayed then
      return redis.error_reply('ERR push.lua: a debounced task needs a delay' .. task)
    end
    -- A producer's user made from an older kmqd's rules may lack the two commands only a debounce runs.
    if debounces[i] and not (redis.acl_check_cmd('ZSCORE', KEYS[2], ARGV[i]) and
        redis.acl_check_cmd('HSET', KEYS[3], ARGV[i], '')) then
      return redis.error_reply('NOPERM push.lua: a debounced push needs the producers\' rules +zscore and +hset ' ..
        '(docs/OPERATIONS.md, "ACL rules")' .. task)
    end
  end
  if ARGV[i] == '' and (delayed or options == '1' or (listed and uniques[i])) then
    return redis.error_reply('push.lua: a delayed or unique task needs an id (task ' .. ((i - 1) / 3) .. ')')
  end
end
-- The type of every key this call may write, then the counter it increments; the fewest calls for a plain push:
-- the stats hash's type is only asked when reading `pushed` failed, and the ready list's only when a unique id is
-- taken before it is written (otherwise its RPUSH is the first write, and its failure is caught below). The wake
-- list's type also tells whether a marker waits in it already (`wake_found`, see `wake`).
local function refuse(key, kind, found)
  return redis.error_reply('WRONGTYPE push.lua: ' .. key .. ' is a ' .. found .. ', not a ' .. kind ..
    '; nothing was written')
end
local function wrong_type(key, kind)
  local found = redis.call('TYPE', key).ok
  if found ~= 'none' and found ~= kind then return refuse(key, kind, found) end
end
local checked = redis.acl_check_cmd('HGET', KEYS[6], 'pushed') and redis.acl_check_cmd('TYPE', KEYS[6])
local wake_found = nil
local any_unique = false
for i = 5, #ARGV, 3 do
  if ARGV[i] == '1' or (listed and uniques[i - 1]) then
    any_unique = true
    break
  end
end
if checked then
  local pushed = redis.pcall('HGET', KEYS[6], 'pushed')
  if type(pushed) == 'table' then
    return refuse(KEYS[6], 'hash', redis.call('TYPE', KEYS[6]).ok)
  end
  local digits = pushed and string.match(pushed, '^-?([1-9]%d*)$')
  if pushed and pushed ~= '0' and not (digits and #digits <= 18) then
    return redis.error_reply('ERR push.lua: ' .. KEYS[6] .. ' field pushed is not an integer (' ..
      string.sub(pushed, 1, 40) .. '); nothing was written')
  end
  local refused
  if delayed then
    refused = wrong_type(KEYS[2], 'zset') or wrong_type(KEYS[3], 'hash')
  else
    wake_found = redis.call('TYPE', KEYS[4]).ok
    refused = (wake_found ~= 'none' and wake_found ~= 'list' and refuse(KEYS[4], 'list', wake_found)) or
      (any_unique and wrong_type(KEYS[1], 'list'))
  end
  refused = refused or (any_unique and wrong_type(KEYS[5], 'hash'))
  if refused then return refused end
end
-- Groups: the flow of each task pushed now, each flow's and the ring's type checked before any write.
local routed = false
if not delayed and #KEYS >= 7 and redis.acl_check_cmd('HGET', KEYS[7], 'groups') and
    redis.pcall('HGET', KEYS[7], 'groups') == '1' then
  local base = string.match(KEYS[7], '^(.*):routes$')
  local level = base and string.sub(KEYS[1], 1, #base + 7) == base .. ':ready:' and string.sub(KEYS[1], #base + 8)
  if not level or level == '' then
    return redis.error_reply('ERR push.lua: ' .. KEYS[7] .. ' is not the routes key of ' .. KEYS[1] ..
      '\'s queue; nothing was written')
  end
  local function encode(name)
    return (string.gsub(name, '[%%:{}%z\1-\32\127]', function(c) return string.format('%%%02X', string.byte(c)) end))
  end
  routed = {ring = base .. ':ring:' .. level, flows = {}, members = {}, batches = {}}
  local vt = redis.call('HGET', base .. ':sched', 'vt:' .. level)
  routed.vt = tonumber(vt or '0') or 0
  local checks = {routed.ring}
  for i = 6, #ARGV, 3 do
    local envelope, group = ARGV[i], ''
    if string.find(envelope, '"group"', 1, true) or string.find(envelope, '\\', 1, true) then
      local ok, task = pcall(cjson.decode, envelope)
      if ok and type(task) == 'table' and type(task.group) == 'string' and #task.group > 0 and #task.group <= 64 then
        group = encode(task.group)
      end
    end
    local member = group .. ':'
    routed.members[i] = member
    if not routed.flows[member] then
      routed.flows[member] = base .. ':flow:' .. level .. ':' .. member
      checks[#checks + 1] = routed.flows[member]
    end
  end
  if checked then
    for k, key in ipairs(checks) do
      local kind = 'list'
      if k == 1 then kind = 'zset' end
      local refused = wrong_type(key, kind)
      if refused then return refused end
    end
  end
end
-- One marker wakes one idle fetcher; a fetcher that finds more than it can take passes the marker on. A wake list
-- that held a marker before this call (`wake_found`, checked above) needs no other: no fetcher waits on a list
-- that holds one (Redis hands a waiting BLPOP the marker as it comes), and a second would be trimmed away. One
-- found empty takes a marker and needs no trim. So a plain push writes the marker only to wake a fetcher, and a
-- busy queue's pushes write none; a call that did not check the type (a user without TYPE) pushes and trims.
local function wake()
  if wake_found == 'list' then return end
  redis.call('LPUSH', KEYS[4], '1')
  if wake_found ~= 'none' then redis.call('LTRIM', KEYS[4], '0', '0') end
end
local result, ready, accepted, replaced = {}, {}, 0, 0
-- Whether this call's user may read the holds of unique_for ids (see "Unique for a time"): asked once.
local sees_holds = nil
local earliest = nil
if delayed then
  local head = redis.call('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')
  earliest = tonumber(head[2])
end
for i = 4, #ARGV, 3 do
  local id, unique, envelope = ARGV[i], ARGV[i + 1] == '1' or (listed and uniques[i] == true), ARGV[i + 2]
  local ok = 1
  if unique then
    if sees_holds == nil then
      sees_holds = redis.acl_check_cmd('EXISTS', KEYS[5] .. ':held:' .. id)
    end
    local held = listed and hold_for[i]
    if sees_holds and redis.call('EXISTS', KEYS[5] .. ':held:' .. id) == 1 then
      ok = 0
    elseif redis.call('HSETNX', KEYS[5], id, held and string.format('%d', now) .. ':' .. held or now) == 0 then
      ok = 0
    end
  end
  if ok == 1 then
    -- Stamp the enqueue time on Redis's clock unless the producer set one.
    envelope = stamped(envelope)
    if delayed then
      ok = redis.call('HSETNX', KEYS[3], id, envelope)
      if ok == 1 then
        redis.call('ZADD', KEYS[2], due, id)
      elseif listed and debounces[i] and redis.call('ZSCORE', KEYS[2], id) then
        -- Debounced: the task of this id still waits at this level (not yet promoted, so nothing took it): it
        -- takes this push's envelope and due time, in this one step.
        -- No task more: `pushed` does not count it (the counters' conservation, docs/RELIABILITY.md).
        redis.call('HSET', KEYS[3], id, envelope)
        redis.call('ZADD', KEYS[2], due, id)
        replaced = replaced + 1
        ok = 1
      elseif unique then
        redis.call('HDEL', KEYS[5], id)
      end
    elseif routed then
      local member = routed.members[i + 2]
      local batch = routed.batches[member]
      if not batch then
        batch = {}
        routed.batches[member] = batch
        ready[#ready + 1] = member
      end
      batch[#batch + 1] = envelope
    else
      ready[#ready + 1] = envelope
    end
  end
  accepted = accepted + ok
  result[#result + 1] = ok
end
if routed and #ready > 0 then
  -- Each group's tasks to its flow, in the order pushed; the flow joins its ring unless it is there (perhaps parked
  -- or timed: it stays so).
  for _, member in ipairs(ready) do
    local batch = routed.batches[member]
    for first = 1, #batch, 1000 do
      redis.call('RPUSH', routed.flows[member], unpack(batch, first, math.min(first + 999, #batch)))
    end
    redis.call('ZADD', routed.ring, 'NX', routed.vt, member)
  end
  wake()
elseif #ready > 0 then
  -- In chunks: unpack's stack is bounded (about 8,000 values).
  for first = 1, #ready, 1000 do
    local pushed = redis.pcall('RPUSH', KEYS[1], unpack(ready, first, math.min(first + 999, #ready)))
    if type(pushed) == 'table' then
      -- Only the first write can fail for a type here (the ready list's, unchecked above when no id was taken);
      -- any other refusal (OOM, READONLY on a replica, an ACL rule) is passed on as Redis gave it.
      if checked and first == 1 and not any_unique and string.sub(pushed.err, 1, 9) == 'WRONGTYPE' then
        return refuse(KEYS[1], 'list', redis.call('TYPE', KEYS[1]).ok)
      end
      return redis.error_reply(pushed.err)
    end
  end
  wake()
end
if delayed and accepted > 0 and (earliest == nil or due < earliest) then
  redis.call('PUBLISH', ARGV[3], due)
end
if accepted > replaced then
  redis.call('HINCRBY', KEYS[6], 'pushed', accepted - replaced)
end
return result
