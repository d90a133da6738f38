-- (The broker prepends `#!lua`, results.lua, after.lua, unique_hold.lua, handover.lua, and claim.lua with its
-- preludes and handover_run.lua inside `handover_parts`: src/broker/mod.rs, `sources`.)
-- settle.lua: apply the outcomes of many runs at once (acknowledge, retry, recover, hand back, dead-letter),
-- exactly once.
--
-- KEYS[1] owners zset, KEYS[2] stats hash, KEYS[3] dead list, KEYS[4] unique hash, KEYS[5] wake list,
-- KEYS[6] the settling party's last call (a string, see "Calls" below), KEYS[7] the unique-popped hash (default
-- mode: unique id -> the owner that popped it), KEYS[8] the queue's throttle (a string, see op "throttle"),
-- KEYS[9 .. 8+L] ready lists, KEYS[9+L .. 8+2L] retry zsets, KEYS[9+2L .. 8+5L] quarantine lists (stages 1, 2, 3
-- for groups of 1, 8 and 64, each over the levels), and in safe mode: KEYS[9+5L .. 8+6L] the claim sets of the
-- owner whose tasks these are (`processing:OWNER:LEVEL`, zset claim -> tasks not yet settled; a hash token ->
-- envelope for an owner of kmqd 0.1, see "Older owners"), all in level order, KEYS[9+6L] that
-- owner's info hash, KEYS[10+6L] the settling party's scratch string (`settled:SETTLER:bits`: each claim's new
-- bits, for BITOP; deleted before the script ends), KEYS[11+6L] the running hash (scope -> tasks taken under
-- its limit and not yet settled), for a queue with groups KEYS[12+6L .. 11+7L] the levels' rings and KEYS[12+7L]
-- the sched hash (for the flows of a group whose count this call frees: see "Running limits"), then for each claim
-- the call touches, its list, its settled bitmap and its
-- running scopes (`processing:OWNER:LEVEL:CLAIM`, `...:CLAIM:settled` and `...:CLAIM:scopes`); in default mode
-- under a running limit instead: KEYS[9+5L] the running hash and KEYS[10+5L] the popped-running hash of the owner
-- that popped these tasks (ARGV[5]; see "Running limits"); last, the keys of the task types whose throttles the
-- call sets (see T below)
-- ARGV[1] fence: "owner" (the owner settles its own tasks) or "expired" (a monitor settles the tasks of an owner
--         whose lease ran out; nothing is applied unless it has)
-- ARGV[2] dead list bound; ARGV[3] number of levels L; ARGV[4] the delay poller's channel; ARGV[5] the owner
--         (in default mode, the owner that popped the tasks when Redis keeps their running slots or unique ids
--         under it, "" otherwise); ARGV[6] the call's number (unique for the settling party)
-- ARGV[7] K, the claims touched, then K groups of 4: level (1-based), claim, the positions of its plain
--         acknowledgements as a bitmap (bit p, in GETBIT's order, for the task at position p; "" for none), and
--         how many bits it sets: the bulk of the traffic, applied with a handful of commands per claim
-- then C: plain acknowledgements without a token (default mode), only counted
-- then T, the flows' scopes whose own throttles the call may set, or whose group's tasks it hands back: task
--         types with limits and groups, and T ring members (`:TYPE`, `GROUP:`); their keys follow the claims'
--         (in default mode, the running and popped-running hashes, if any): for each, its throttle (`throttle:t:TYPE`, `throttle:g:GROUP`), its
--         flows (one per level), the levels' rings
-- then S, the types' running counts the call's tasks were counted in by a default-mode pop (0 but in default
--         mode with type limits), and S pairs: the scope (`t:TYPE`), how many of the call's tasks it counted
-- then records of 9: op, claim (its index among the K, 1-based; 0 for none), token (the task's position in the
--         claim's list; a field of an older owner's hash with claim 0; "" in default mode), unique id, level
--         (1-based), delay ms, payload, failed ("1" or "0"), scope (op "throttle": 0 for the queue's, t for the
--         t-th of the T scopes; op "back": 0 for the ready list, t for the t-th scope's flow, a group's; 0 for
--         every other op)
--   op "ack":   done; the task leaves the processing area
--   op "retry": payload (the envelope with attempt + 1) goes to the front of its ready list now (delay 0) or
--               to the level's retry zset, due in delay ms; counted in "retried"
--   op "retry_isolated": as "retry" with no delay, to the front of the level's quarantine list of stage
--               "delay" (a crash while the task ran alone: stage 1)
--   op "recover": an expired lease's task, uncharged: payload (recovered + 1) to the front of its ready list;
--               counted in "recovered"
--   op "recover_isolated": as "recover", to the front of the level's quarantine list of stage "delay"
--   op "back":  handed back (the shutdown; in default mode also a unique task, or one under a running limit,
--               whose popping owner's lease was lost before it started): payload goes to the front of its ready list, attempt unchanged; its unique
--               id, if any, stays held (the task waits again) but no longer by the popping owner. With a group's
--               scope (a grouped queue, safe mode): to the front of the group's flow at its level instead, which
--               joins its ring at the level's virtual time unless it is there (as a push's flow does), so that it
--               keeps its FIFO place within its group; a call's hand-backs to one flow go in their claims' order
--   op "back_isolated": as "back", to the front of the level's quarantine list of stage "delay" (a task that
--               waited in the quarantine goes back there)
--   op "throttle": a handler's back-pressure: payload (the task as it was taken) goes to the front of its ready
--               list, uncharged; the queue's throttle is set to expire in delay ms (its value: the ms it ends),
--               unless it already lasts longer, and no claim or pop takes a task of the queue until then;
--               counted in "throttled". With a type's or a group's scope: to the front of its flow at its level,
--               its ring's member timed for the throttle's end (groups.lua's TIMED band; a type's ring ignores
--               scores), and that scope's throttle is the one set: claims take none of its tasks until then
--   op "dead":  payload (a dead record, a JSON object) is pushed on the dead list with "dead_at" stamped
--               (and, for a unique_for task, "unique_for": MS after it: unique_hold.lua)
-- Running limits. A claim list counted under a running limit has a scopes string (`N q`: claim.lua; with type
-- limits a line `N SCOPE...` per run of the list, in position order); each task of it whose bit this call sets, by whatever op and whichever settling party (the owner, or a monitor for an
-- expired owner), is subtracted from the running hash's fields the string names, in this step, and the string
-- goes with the list. A field is never taken below 0 (that would say the count was wrong: counted in stats as
-- `running_underflow`) and is deleted at 0. A call that frees slots of a count that was at its limit (the field
-- `SCOPE:limit`, which the claims write) wakes an idle fetcher. A call that frees slots of a group (`g:GROUP`)
-- moves the group's parked flows (groups.lua's PARKED band: it was full or paused; `GROUP:` on each level, and
-- those its park index `park:g:GROUP` names, beside type limits) back to their levels' virtual time, and wakes
-- an idle fetcher if it moved one: so a group with tasks never waits for anything but
-- its own running tasks, whichever daemon or monitor settles them.
-- In default mode (pop.lua) the popped tasks left Redis and their count is kept under the owner that popped them
-- (its popped-running hash): each task this call ends (a plain acknowledgement or a record) is subtracted from
-- the owner's share and from the running count, never more than the share holds, so a settle that comes after
-- release.lua gave the share back (the owner's lease ran out) subtracts nothing. Likewise for each type with
-- max_running that pop.lua counted tasks in (S above): the call subtracts what the daemon says of its tasks from
-- the owner's share of `t:TYPE` and from `t:TYPE`, at most the share.
--
-- Unique ids. A record's unique id is released on "ack" and "dead", and kept held by a task queued again, only if
-- the task holds it. In safe mode it does while its bit is unset (a stale record changes nothing). In default
-- mode the id is held by the owner that popped the task (the unique-popped hash, pop.lua), which may have lost
-- it: a monitor released it when that owner's lease ran out (release_unique.lua), and a newer task with the id
-- may hold it since. So a default-mode record names that owner (ARGV[5]) and changes the id only if the
-- unique-popped hash still names it; otherwise an "ack" or "dead" applies without touching the id (it is not
-- the task's to free), and a task to be queued again ("retry", "back", "throttle") takes the id again if it is
-- free (HSETNX, as push.lua, with its window if it is a unique_for id whose hold its owner's loss left: that hold
-- does not keep the task itself out, as it is no new run) and is dropped if a newer task holds it, or a newer
-- task's end left the id's hold: that one runs (or ran, within the window) instead, and two tasks never hold one
-- id. A dropped task's record answers 0 (default-mode records are otherwise never stale).
--
-- A task whose bit is already set (or whose claim list is gone) is stale and changes nothing: this fences a slow
-- owner against a monitor that already recovered its task, and two monitors against each other. Bits are only
-- ever merged in, never overwritten (a bitmap is OR-ed in, and its new bits counted), so that two settles of the
-- same claim cannot undo each other. A claim list whose every task is settled goes, with its bitmap, its progress
-- hash (progress.lua) and its entry in the claim set. Default-mode records have no token and are never stale.
-- Returns {number of stale plain acknowledgements, then one integer per record: 1 applied, 0 stale (or, in
-- default mode, a task not queued again because a newer task holds its unique id: see "Unique ids"), then the
-- owner's journal after this call (0 without an info hash, or when a monitor settles), then, with a claim block
-- (handover.lua), claim.lua's reply for the slots it freed}; {-1, the stored call's number} for a late copy of an
-- older call (see "Calls").
--
-- Older owners. An owner registered by kmqd 0.1 kept its tasks in a hash per level (token ->
-- envelope); a monitor of this version recovers them with records of claim 0 whose token is the hash's field,
-- removed with HDEL, so that a rolling upgrade strands nothing.
--
-- Calls. A caller whose reply was lost sends the same call again (same KEYS[6], same ARGV[6]): the script then
-- returns the first call's result, stored in KEYS[6], without applying anything, so nothing is applied twice (a
-- default-mode retry queued twice, a dead letter recorded twice) and the caller learns what was applied. Each
-- settling party has its own KEYS[6], numbers its calls upwards and makes one call at a time (its next only once
-- this one was answered), so the stored call's number is the party's high-water mark: a call numbered below it
-- is a late copy of a call already answered (sent on a connection the caller gave up on, then delivered after
-- the copy it sent again, and after newer calls: a retransmission of an orphaned socket's data, a buffering
-- proxy). It applies nothing (not even the journal's increment) and returns {-1, the stored call's number}: a
-- reply nobody reads (its connection is closed), which the caller would take as "applied before".
--
-- Atomic: it checks before it writes. Every key it may write is checked for its type, every counter of the stats
-- hash it may increment for being an integer, and every record for its op, claim, position, level and stage,
-- before anything is written ("WRONGTYPE settle.lua: KEY is a string, not a list", "ERR settle.lua: KEY field F
-- is not an integer"); the owner's journal is incremented first, so that if it is not an integer nothing else is
-- written. The shebang makes Redis refuse the whole script up front when it is out of memory. So the script
-- applies all or nothing, and its result is stored in KEYS[6] before the counters are incremented.
local owners, stats, dead, uniq, wake, last_call = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local popped, throttle = KEYS[7], KEYS[8]
local fence, dead_max, levels, channel, owner = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4], ARGV[5]
local call = ARGV[6]
-- The claims this call touches (K, ARGV[7]). Each `tonumber` costs Redis some 1,800 instructions, each number given to
-- `redis.call` some 2,250 (its snprintf): a value is converted once, and a constant is given as a string.
local claims = tonumber(ARGV[7])
-- The claim for the slots this call frees (handover.lua): its trailer is the last, so it comes off first.
local handover, refused_handover = take_handover()
if handover == nil then return refused_handover end
-- The results this call keeps (results.lua): its trailer is taken off ARGV and KEYS before anything reads them.
local kept, refused_kept = take_kept()
if not kept then return refused_kept end
-- The notes to the tasks waiting for the ones this call ends (after.lua): its trailer comes off next.
local notes, refused_notes = take_notes()
if not notes then return refused_notes end
local READY, RETRY, QUARANTINE, PROCESSING = 8, 8 + levels, 8 + 2 * levels, 8 + 5 * levels
-- Safe mode names at least levels + 3 keys past the quarantine lists; default mode none, or two (a limited queue),
-- each before the keys of the types whose throttles the call may set (T, after the claims' arguments).
local THROTTLED_TYPES = 9 + claims * 4
local type_keys = (tonumber(ARGV[THROTTLED_TYPES]) or 0) * (1 + 2 * levels)
local safe = #KEYS - type_keys > PROCESSING + 2
local info, scratch, running, CLAIM_KEYS = false, false, false, PROCESSING + levels + 3
local share = false
-- A grouped queue's call names its rings and sched hash after the running hash: told by the keys' count, which
-- is otherwise fixed by the claims (ARGV[7]) and the throttled scopes.
local rings, sched = {}, false
if safe then
  info, scratch, running = KEYS[PROCESSING + levels + 1], KEYS[PROCESSING + levels + 2], KEYS[PROCESSING + levels + 3]
  local plain = CLAIM_KEYS + 3 * claims + (tonumber(ARGV[THROTTLED_TYPES]) or 0) * (1 + 2 * levels)
  if #KEYS == plain + levels + 1 then
    for level = 1, levels do rings[level] = KEYS[PROCESSING + levels + 3 + level] end
    sched = KEYS[PROCESSING + 2 * levels + 4]
    CLAIM_KEYS = CLAIM_KEYS + levels + 1
  end
elseif #KEYS - type_keys == PROCESSING + 2 then
  running, share = KEYS[PROCESSING + 1], KEYS[PROCESSING + 2]
  CLAIM_KEYS = PROCESSING + 2
else
  CLAIM_KEYS = PROCESSING
end
local OPS = {ack = true, retry = true, retry_isolated = true, recover = true, recover_isolated = true,
  back = true, back_isolated = true, dead = true, throttle = true}

-- The claims touched: level, number, list, bitmap, running scopes; `fresh` counts the bits this call sets.
local claim = {}
for k = 1, claims do
  local at = 8 + (k - 1) * 4
  claim[k] = {level = tonumber(ARGV[at]), number = ARGV[at + 1], acks = ARGV[at + 2], count = tonumber(ARGV[at + 3]),
    list = KEYS[CLAIM_KEYS + 3 * k - 2], bits = KEYS[CLAIM_KEYS + 3 * k - 1], scopes = KEYS[CLAIM_KEYS + 3 * k],
    fresh = 0}
end
local counted_at = 8 + claims * 4
-- The task types whose own throttles this call may set (safe mode, types with limits: see op "throttle"): each
-- its ring member here, and its keys after the claims' (its throttle, its flows, the levels' rings).
local throttled_types = tonumber(ARGV[counted_at + 1]) or 0
-- Default mode: the owner's shares of type counts this call ends (S, then S pairs `t:TYPE` and the tasks of the
-- call pop.lua counted in it; see "Running limits").
local SHARES = counted_at + 2 + throttled_types
local shares = tonumber(ARGV[SHARES]) or 0
local records = SHARES + 1 + 2 * shares
-- A call of acknowledgements alone (the claims' bitmaps) has no record past the shares.
local acks_only = records > #ARGV
local throttle_type = {}
for t = 1, throttled_types do
  local at = CLAIM_KEYS + 3 * claims + 1 + (t - 1) * (1 + 2 * levels)
  throttle_type[t] = {member = ARGV[counted_at + 1 + t], throttle = KEYS[at], flows = {}, rings = {}}
  for level = 1, levels do
    throttle_type[t].flows[level] = KEYS[at + level]
    throttle_type[t].rings[level] = KEYS[at + levels + level]
  end
end

-- Only the keys this call may write (a read of a key of the wrong type fails before anything is written): a
-- call of plain acknowledgements, the hot path, checks a handful.
local expected = {[stats] = 'hash', [last_call] = 'string'}
if fence == 'expired' then expected[owners] = 'zset' end
if not acks_only then
  expected[dead], expected[uniq], expected[wake], expected[popped] = 'list', 'hash', 'list', 'hash'
  expected[throttle] = 'string'
  for _, scope in ipairs(throttle_type) do
    expected[scope.throttle] = 'string'
    for level = 1, levels do
      expected[scope.flows[level]], expected[scope.rings[level]] = 'list', 'zset'
    end
  end
  for level = 1, levels do
    expected[KEYS[READY + level]] = 'list'
    expected[KEYS[RETRY + level]] = 'zset'
    for stage = 0, 2 do
      expected[KEYS[QUARANTINE + stage * levels + level]] = 'list'
    end
  end
end
if info then expected[info], expected[scratch], expected[running] = 'hash', 'string', 'hash' end
if share then expected[running], expected[share] = 'hash', 'hash' end
local function expect(key, kind)
  if expected[key] and expected[key] ~= kind then
    return redis.error_reply('settle.lua: ' .. key .. ' is both a ' .. expected[key] .. ' and a ' .. kind ..
      ' in this call; nothing was applied')
  end
  expected[key] = kind
end
for k = 1, claims do
  if not safe or not claim[k].list or claim[k].level < 1 or claim[k].level > levels then
    return redis.error_reply('settle.lua: claim ' .. k .. ' has no keys; nothing was applied')
  end
  local refused = expect(KEYS[PROCESSING + claim[k].level], 'zset') or expect(claim[k].list, 'list') or
    expect(claim[k].bits, 'string') or expect(claim[k].scopes, 'string')
  if refused then return refused end
end
for j = records, #ARGV, 9 do
  if not OPS[ARGV[j]] then
    return redis.error_reply('settle.lua: unknown op ' .. ARGV[j] .. '; nothing was applied')
  end
  local k, level = tonumber(ARGV[j + 1]), tonumber(ARGV[j + 4])
  if not k or k < 0 or k > claims then
    return redis.error_reply('settle.lua: record of claim ' .. ARGV[j + 1] .. ' of ' .. claims ..
      '; nothing was applied')
  end
  if not level or level < 1 or level > levels or not tonumber(ARGV[j + 5]) then
    return redis.error_reply('settle.lua: record at level ' .. ARGV[j + 4] .. ' of ' .. levels .. ' (delay ' ..
      ARGV[j + 5] .. '); nothing was applied')
  end
  local stage, scope = tonumber(ARGV[j + 5]), tonumber(ARGV[j + 8])
  if not scope or scope < 0 or scope > throttled_types or
      (scope > 0 and ARGV[j] ~= 'throttle' and ARGV[j] ~= 'back') then
    return redis.error_reply('settle.lua: record of throttle scope ' .. tostring(ARGV[j + 8]) .. ' of ' ..
      throttled_types .. '; nothing was applied')
  end
  if ARGV[j] == 'throttle' and stage < 1 then
    return redis.error_reply('settle.lua: throttle of ' .. ARGV[j + 5] .. ' ms; nothing was applied')
  end
  if (ARGV[j] == 'retry_isolated' or ARGV[j] == 'recover_isolated' or ARGV[j] == 'back_isolated') and
      (stage < 1 or stage > 3) then
    return redis.error_reply('settle.lua: quarantine stage ' .. ARGV[j + 5] .. '; nothing was applied')
  end
  if k > 0 and not tonumber(ARGV[j + 2]) then
    return redis.error_reply('settle.lua: position ' .. ARGV[j + 2] .. ' in claim ' .. k .. '; nothing was applied')
  end
  if k == 0 and ARGV[j + 2] ~= '' then
    if not safe then
      return redis.error_reply('settle.lua: a token without an owner; nothing was applied')
    end
    local refused = expect(KEYS[PROCESSING + tonumber(ARGV[j + 4])], 'hash')
    if refused then return refused end
  end
end
-- The last call, the stats hash, and each claim's scopes string and the running fields it names are read before
-- the other keys' types are checked: a read Redis refuses for a key of another type is that key's check (told apart
-- by a TYPE then), one call fewer each (some 7,400 instructions: docs/PERFORMANCE.md, "Where a slot's turnaround
-- goes, stage by stage"); each key read so leaves `expected`, whose other keys the loop below checks. All of it
-- comes before the first write.
local function wrong_read(key, kind, reply)
  if type(reply) == 'table' and reply.err then
    local found = redis.call('TYPE', key).ok
    if found ~= 'none' and found ~= kind then
      return redis.error_reply('WRONGTYPE settle.lua: ' .. key .. ' is a ' .. found .. ', not a ' .. kind ..
        '; nothing was applied')
    end
    return reply
  end
end
local prior = redis.pcall('GET', last_call)
local COUNTERS = {'done', 'retried', 'recovered', 'failed', 'dead_lettered', 'running_underflow', 'throttled'}
local counters = redis.pcall('HMGET', stats, unpack(COUNTERS))
local refused_read = wrong_read(last_call, 'string', prior) or wrong_read(stats, 'hash', counters)
if refused_read then return refused_read end
expected[last_call], expected[stats] = nil, nil
-- The owner's info hash is read by the claim's checks for the freed slots (its HMGET, before any write): that read
-- is its type check for the settle too.
if handover and fence == 'owner' and info and handover.keys[3] == info then expected[info] = nil end
-- The counters it may increment: integers, or absent (HINCRBY fails on anything else).
local function integer(key, field, value)
  local digits = value and string.match(value, '^-?([1-9]%d*)$')
  if value and value ~= '0' and not (digits and #digits <= 18) then
    return redis.error_reply('ERR settle.lua: ' .. key .. ' field ' .. field .. ' is not an integer (' ..
      string.sub(value, 1, 40) .. '); nothing was applied')
  end
end
-- The running scopes of the claims touched (`N SCOPE...`: their lists' tasks count in those fields), and those
-- fields, integers or absent.
local counts, limits = {}, {}
-- Whether a run counted in a group: the rings and the sched hash, which its parked flows return through, are then
-- checked too.
local grouped = false
-- Each claim's length, and its settled bits when it acknowledges some, are read here too, as their keys' type checks
-- (the settle below needs them, and writes neither before it reads them): once for each list and bitmap, should a
-- call name one twice (each claim's settle may write its bitmap, which a second claim must then read afresh).
local lengths_read = {}
for k = 1, claims do
  local c = claim[k]
  if not lengths_read[c.list] and not lengths_read[c.bits] then
    lengths_read[c.list], lengths_read[c.bits] = true, true
    local length = redis.pcall('LLEN', c.list)
    local refused = wrong_read(c.list, 'list', length)
    if refused then return refused end
    expected[c.list], c.length = nil, length
    if c.count > 0 and length > 0 then
      local old = redis.pcall('GET', c.bits)
      refused = wrong_read(c.bits, 'string', old)
      if refused then return refused end
      expected[c.bits], c.old = nil, old
    end
  end
  local scopes = redis.pcall('GET', claim[k].scopes)
  local refused = wrong_read(claim[k].scopes, 'string', scopes)
  if refused then return refused end
  expected[claim[k].scopes] = nil
  if scopes then
    -- One line per run of the list, in position order (a claim of a queue with type limits has several).
    local runs, from = {}, 0
    for line in string.gmatch(scopes, '[^\n]+') do
      local size, named = string.match(line, '^(%d+) ?(.*)$')
      if not size then
        return redis.error_reply('ERR settle.lua: ' .. claim[k].scopes .. ' holds ' .. string.sub(scopes, 1, 40) ..
          ', not "N SCOPE..." lines; nothing was applied')
      end
      size = tonumber(size)
      local run = {from = from, to = from + size - 1, size = size, counted = {}}
      from = run.to + 1
      for scope in string.gmatch(named, '%S+') do
        if not counts[scope] then
          local value = redis.pcall('HMGET', running, scope, scope .. ':limit')
          refused = wrong_read(running, 'hash', value) or integer(running, scope, value[1]) or
            integer(running, scope .. ':limit', value[2])
          if refused then return refused end
          expected[running] = nil
          counts[scope] = tonumber(value[1] or '0')
          limits[scope] = tonumber(value[2] or '0')
        end
        run.counted[#run.counted + 1] = scope
        if not grouped and string.sub(scope, 1, 2) == 'g:' then grouped = true end
      end
      runs[#runs + 1] = run
    end
    if #runs == 1 then
      claim[k].counted = runs[1].counted
    elseif #runs > 1 then
      claim[k].runs = runs
    end
  end
end
-- What they found, for the claim of the freed slots (claim.lua's `given.types`); a settle without one builds no
-- table for it (some 6,000 instructions a call, its growth included).
local found_types = handover and {}
for key, kind in pairs(expected) do
  local found = redis.call('TYPE', key).ok
  if found ~= 'none' and found ~= kind then
    return redis.error_reply('WRONGTYPE settle.lua: ' .. key .. ' is a ' .. found .. ', not a ' .. kind ..
      '; nothing was applied')
  end
  if found_types then found_types[key] = found end
end
-- A call sent again (its reply was lost) answers the first call's result; an older call than the stored one
-- (a late copy) applies nothing (checked after the types, so that a key that went wrong meanwhile is reported,
-- and the call answered once it is fixed).
if prior then
  local bar = string.find(prior, '|', 1, true)
  local stored = bar and string.sub(prior, 1, bar - 1)
  if stored == call then
    local result = {}
    for n in string.gmatch(string.sub(prior, bar + 1), '[^,]+') do
      result[#result + 1] = tonumber(n)
    end
    return result
  end
  if stored and tonumber(stored) and tonumber(call) and tonumber(call) < tonumber(stored) then
    return {-1, tonumber(stored)}
  end
end
-- The counters read above.
for n = 1, #COUNTERS do
  local refused = integer(stats, COUNTERS[n], counters[n])
  if refused then return refused end
end
if grouped and not sched then
  -- A run counted in a group, settled by a daemon whose config has no groups (a rolling change): its parked flows
  -- come back through a grouped claim's look at the longest parked (groups.lua, `groups_due`).
  grouped = false
end
-- The levels' virtual times (the sched hash's `vt:L`), at which a group's flow (re)joins its ring: read once, its
-- type checked first.
local vts = false
local function virtual_times()
  if vts then return vts end
  local found = redis.call('TYPE', sched).ok
  if found ~= 'none' and found ~= 'hash' then
    return nil, redis.error_reply('WRONGTYPE settle.lua: ' .. sched .. ' is a ' .. found .. ', not a hash; ' ..
      'nothing was applied')
  end
  local fields = {}
  for level = 1, levels do fields[level] = 'vt:' .. level end
  local values = redis.call('HMGET', sched, unpack(fields))
  vts = {}
  for level = 1, levels do
    if values[level] and not tonumber(values[level]) then
      return nil, redis.error_reply('ERR settle.lua: ' .. sched .. ' field vt:' .. level .. ' is not a number (' ..
        string.sub(values[level], 1, 40) .. '); nothing was applied')
    end
    vts[level] = tonumber(values[level] or '0')
  end
  return vts
end
if grouped then
  local checks = {}
  for level = 1, levels do checks[level] = {rings[level], 'zset'} end
  -- Each counted group's park index (its parked flows of a limited type: groups.lua), built from the queue's base.
  for scope in pairs(counts) do
    if string.sub(scope, 1, 2) == 'g:' then
      checks[#checks + 1] = {string.sub(sched, 1, -7) .. ':park:' .. scope, 'zset'}
    end
  end
  for _, check in ipairs(checks) do
    local found = redis.call('TYPE', check[1]).ok
    if found ~= 'none' and found ~= check[2] then
      return redis.error_reply('WRONGTYPE settle.lua: ' .. check[1] .. ' is a ' .. found .. ', not a ' ..
        check[2] .. '; nothing was applied')
    end
  end
  local refused
  grouped, refused = virtual_times()
  if refused then return refused end
end
-- A hand-back to a group's flow joins the ring at the level's virtual time: without the sched hash (a call that
-- names no rings) it goes to the ready list, whose intake routes it, at its flow's tail.
local back_to_flows = false
for j = records, #ARGV, 9 do
  if ARGV[j] == 'back' and ARGV[j + 8] ~= '0' and sched then back_to_flows = true end
end
if back_to_flows then
  local _, refused = virtual_times()
  if refused then return refused end
end
-- Default mode: the owner's shares of the types' counts this call ends, and those counts.
local typed = {}
for j = 1, shares do
  local scope, n = ARGV[SHARES + 2 * j - 1], tonumber(ARGV[SHARES + 2 * j])
  if not share or not n or n < 0 or string.sub(scope, 1, 2) ~= 't:' then
    return redis.error_reply('settle.lua: share ' .. tostring(scope) .. ' of ' .. tostring(ARGV[SHARES + 2 * j]) ..
      ' tasks without a popped-running hash, or not of a type; nothing was applied')
  end
  local mine = redis.call('HGET', share, scope)
  local value = redis.call('HMGET', running, scope, scope .. ':limit')
  local refused = integer(share, scope, mine) or integer(running, scope, value[1]) or
    integer(running, scope .. ':limit', value[2])
  if refused then return refused end
  typed[scope] = {mine = tonumber(mine or '0'), ended = (typed[scope] and typed[scope].ended or 0) + n}
  if typed[scope].mine > 0 then
    counts[scope], limits[scope] = tonumber(value[1] or '0'), tonumber(value[2] or '0')
  end
end
-- Default mode: the owner's share of `q`, and `q` itself.
local shared = 0
if share then
  local mine = redis.call('HGET', share, 'q')
  local value = redis.call('HMGET', running, 'q', 'q:limit')
  local refused = integer(share, 'q', mine) or integer(running, 'q', value[1]) or
    integer(running, 'q:limit', value[2])
  if refused then return refused end
  shared = tonumber(mine or '0')
  if shared > 0 then
    counts.q, limits.q = tonumber(value[1] or '0'), tonumber(value[2] or '0')
  end
end
-- A call that may free running slots pushes a wake-up marker: a call of plain acknowledgements has not checked
-- the wake list's type yet.
if next(counts) then
  local found = redis.call('TYPE', wake).ok
  if found ~= 'none' and found ~= 'list' then
    return redis.error_reply('WRONGTYPE settle.lua: ' .. wake .. ' is a ' .. found .. ', not a list; nothing ' ..
      'was applied')
  end
  if found_types then found_types[wake] = found end
end
-- Only a registered owner settling its own tasks adds to its journal: a late settle after the monitors forgot
-- the owner must not bring its info hash back. Its increment is the call's first write, so that a journal that is
-- not an integer fails the call before anything is written.
-- The claim for the freed slots checks its own keys and counters first (handover.lua), but for what the settle's
-- own checks and reads above found already (claim.lua's `given`): the keys' types, the stats hash's counters, the
-- running count.
local parts = handover and handover_parts(handover.keys, handover.args)
local given = handover and {types = found_types, stats = stats, running = running, q = counts.q, limit = limits.q}
if handover and fence == 'owner' then
  local refused = parts.check(given)
  if refused then return refused end
end
local journal = 0
if info and fence == 'owner' and redis.call('EXISTS', info) == 1 then
  journal = redis.pcall('HINCRBY', info, 'journal', '1')
  if type(journal) == 'table' then
    return redis.error_reply('ERR settle.lua: ' .. info .. ' field journal is not an integer; nothing was applied')
  end
end

local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local done, retried, recovered, failed, dead_lettered, throttled = 0, 0, 0, 0, 0, 0
-- How long each throttle still lasts (ms), by key, read at its first throttle record.
local throttle_left = {}
local wake_fetchers, wake_poller = false, false
local live = true
if fence == 'expired' then
  local lease = redis.call('ZSCORE', owners, owner)
  live = lease ~= false and tonumber(lease) <= now
end

-- Members of a sorted set are unique, and two tasks can have the very same retry envelope (a producer pushed one
-- envelope twice, or many in one batch): trailing spaces, which JSON ignores, keep each a member of its own. The
-- first free number of spaces is found by galloping (n, n + 1, n + 2, n + 4, ...: any free one will do), from 0
-- for an envelope's first copy in this call and from just past the last one taken for the next: k identical
-- envelopes cost O(k log k) ZADDs, not k^2 / 2 as adding one space at a time did (review L6). Returns the member
-- added. `spaced[zset][payload]`: where the next copy starts.
local spaced = {}
local function add_retry(zset, score, payload)
  spaced[zset] = spaced[zset] or {}
  local from = spaced[zset][payload] or 0
  local n, step = from, 1
  local member = payload
  if n > 0 then member = payload .. string.rep(' ', n) end
  while redis.call('ZADD', zset, 'NX', score, member) == 0 do
    n, step = from + step, step * 2
    member = payload .. string.rep(' ', n)
  end
  spaced[zset][payload] = n + 1
  return member
end

local stale = 0
local used_scratch = false
-- Hand-backs to their group's flow (op "back" with a scope), pushed once every record is applied.
local flow_backs = {}
for k = 1, claims do
  local c = claim[k]
  c.length = c.length or redis.call('LLEN', c.list)
  if c.runs and c.length > 0 then
    -- Settled bits per run before this call: what it sets anew in each is subtracted from that run's scopes.
    local old = redis.call('EXISTS', c.bits) == 1
    for _, run in ipairs(c.runs) do
      run.before = 0
      if old then run.before = redis.call('BITCOUNT', c.bits, run.from, run.to, 'BIT') end
    end
  end
  if c.count > 0 then
    if c.length == 0 then
      -- The claim is gone: a monitor recovered all of it.
      stale = stale + c.count
    else
      local old = c.old
      if old == nil then old = redis.call('GET', c.bits) end
      keep_claim(kept, k, c.bits, old, now)
      note_claim(notes, k, old)
      if not old and c.count == c.length then
        -- The whole claim at once, the common case: nothing to merge.
        done = done + c.count
        c.fresh = c.count
        c.finished = true
      elseif not old then
        redis.call('SET', c.bits, c.acks)
        done = done + c.count
        c.fresh = c.count
      else
        -- Merged natively: OR-ing the bytes in Lua costs more than ten times as much.
        redis.call('SET', scratch, c.acks)
        local before = redis.call('BITCOUNT', c.bits)
        redis.call('BITOP', 'OR', c.bits, c.bits, scratch)
        used_scratch = true
        local fresh = redis.call('BITCOUNT', c.bits) - before
        done = done + fresh
        c.fresh = fresh
        stale = stale + c.count - fresh
      end
    end
  end
end
-- Default mode: the tasks this call ends (every record applies), for the owner's share.
local ended = tonumber(ARGV[counted_at])
done = done + ended
local result = {stale}
local i = records
while i <= #ARGV do
  local op, k, token, uid = ARGV[i], tonumber(ARGV[i + 1]), ARGV[i + 2], ARGV[i + 3]
  local level, delay, payload = tonumber(ARGV[i + 4]), tonumber(ARGV[i + 5]), ARGV[i + 6]
  local ok = 1
  if k > 0 then
    local c = claim[k]
    local position = tonumber(token)
    ok = 0
    if live and not c.finished and position < c.length and redis.call('GETBIT', c.bits, position) == 0 then
      redis.call('SETBIT', c.bits, position, '1')
      c.fresh = c.fresh + 1
      ok = 1
    end
  elseif token ~= '' then
    if live then
      ok = redis.call('HDEL', KEYS[PROCESSING + level], token)
    else
      ok = 0
    end
  end
  if ok == 1 then
    ended = ended + 1
    if op == 'ack' or op == 'dead' then
      keep(kept, (i - records) / 9 + 1, now)
      note(notes, (i - records) / 9 + 1)
    end
    if ARGV[i + 7] == '1' then
      failed = failed + 1
    end
    -- Whether the task holds its unique id (see "Unique ids"), and whether a task to be queued again is.
    local holds, queued = true, true
    if uid ~= '' then
      if not safe then
        holds = owner ~= '' and redis.call('HGET', popped, uid) == owner
      end
      if holds then
        redis.call('HDEL', popped, uid)
      elseif op ~= 'ack' and op ~= 'dead' then
        -- With its window, if it had one: its owner's loss left the hold (release_unique.lua), which says so; a
        -- hold another task's end left means that task ran instead, within the window: this one is dropped.
        local window, ended = held_window(uniq, uid)
        queued = not ended and take_unique_id(uniq, uid, now, window)
        if not queued then ok = 0 end
      end
    end
    if op == 'ack' then
      done = done + 1
      if uid ~= '' and holds then
        free_unique_id(uniq, uid, now)
      end
    elseif op == 'throttle' then
      throttled = throttled + 1
      local key = throttle
      local scope = throttle_type[tonumber(ARGV[i + 8])]
      if scope then
        -- A type with its own limits: back to the head of its flow, which claims (and pops) take from first.
        key = scope.throttle
        if queued then
          redis.call('LPUSH', scope.flows[level], payload)
          redis.call('ZADD', scope.rings[level], 1e15 + now + delay, scope.member)
        end
      elseif queued then
        redis.call('LPUSH', KEYS[READY + level], payload)
        wake_fetchers = true
      end
      if not throttle_left[key] then
        -- -2: none; -1: one set by hand without an expiry, which this one replaces.
        throttle_left[key] = math.max(0, redis.call('PTTL', key))
      end
      if delay > throttle_left[key] then
        redis.call('SET', key, string.format('%d', now + delay), 'PX', delay)
        throttle_left[key] = delay
      end
    elseif not queued then
      -- A newer task holds its unique id: this one is dropped.
    elseif op == 'retry_isolated' or op == 'recover_isolated' or op == 'back_isolated' then
      if op == 'retry_isolated' then
        retried = retried + 1
      elseif op == 'recover_isolated' then
        recovered = recovered + 1
      end
      redis.call('LPUSH', KEYS[QUARANTINE + (delay - 1) * levels + level], payload)
      wake_fetchers = true
    elseif op == 'retry' or op == 'back' or op == 'recover' then
      if op == 'retry' then
        retried = retried + 1
      elseif op == 'recover' then
        recovered = recovered + 1
      end
      local scope = op == 'back' and back_to_flows and throttle_type[tonumber(ARGV[i + 8])]
      if scope then
        -- Its group's flow, after the loop: a call's hand-backs in their claims' order.
        local position = tonumber(token) or 0
        local number = k > 0 and tonumber(claim[k].number) or 0
        flow_backs[#flow_backs + 1] = {scope = scope, level = level, payload = payload, number = number,
          position = position, record = i}
        wake_fetchers = true
      elseif delay <= 0 then
        redis.call('LPUSH', KEYS[READY + level], payload)
        wake_fetchers = true
      else
        local zset = KEYS[RETRY + level]
        payload = add_retry(zset, now + delay, payload)
        local head = redis.call('ZRANGE', zset, 0, 0)
        if head[1] == payload then
          wake_poller = true
        end
      end
    else
      dead_lettered = dead_lettered + 1
      -- A unique_for task's record carries its window, which `dead requeue` takes the id again with.
      local window = nil
      if uid ~= '' and holds then
        window = free_unique_id(uniq, uid, now)
      elseif uid ~= '' then
        window = (held_window(uniq, uid))
      end
      local stamp = '{"dead_at":' .. string.format('%d', now) .. ','
      if window then stamp = stamp .. '"unique_for":' .. window .. ',' end
      redis.call('LPUSH', dead, stamp .. string.sub(payload, 2))
    end
  end
  result[#result + 1] = ok
  i = i + 9
end
if used_scratch then redis.call('DEL', scratch) end
-- Each to its flow's head, the latest taken first, so that the flow holds them in the order they were claimed,
-- ahead of the tasks that waited behind them; the flow joins its ring unless it is there (perhaps parked or timed:
-- it stays so).
table.sort(flow_backs, function(a, b)
  if a.number ~= b.number then return a.number > b.number end
  if a.position ~= b.position then return a.position > b.position end
  return a.record > b.record
end)
for _, back in ipairs(flow_backs) do
  redis.call('LPUSH', back.scope.flows[back.level], back.payload)
  redis.call('ZADD', back.scope.rings[back.level], 'NX', vts[back.level], back.scope.member)
end
-- A claim whose every task is settled goes; the others' scores count what they still hold. What a counted claim
-- settled now leaves the running counts.
local freed, underflow = {}, 0
for k = 1, claims do
  local c = claim[k]
  local set = KEYS[PROCESSING + c.level]
  if c.length == 0 then
    redis.call('ZREM', set, c.number)
    redis.call('DEL', c.scopes, c.list .. ':progress')
  else
    local settled = c.length
    if not c.finished then settled = redis.call('BITCOUNT', c.bits) end
    if c.runs and c.fresh > 0 then
      for _, run in ipairs(c.runs) do
        local after = run.size
        if not c.finished then after = redis.call('BITCOUNT', c.bits, run.from, run.to, 'BIT') end
        for _, scope in ipairs(run.counted) do
          freed[scope] = (freed[scope] or 0) + after - run.before
        end
      end
    end
    if settled >= c.length then
      -- With its progress hash (progress.lua; its name is the list's, as keys.rs builds it, in the list's slot),
      -- which no report recreates once the list is gone.
      redis.call('DEL', c.list, c.bits, c.scopes, c.list .. ':progress')
      redis.call('ZREM', set, c.number)
    else
      redis.call('ZADD', set, 'XX', c.length - settled, c.number)
    end
    if c.counted and c.fresh > 0 then
      for _, scope in ipairs(c.counted) do
        freed[scope] = (freed[scope] or 0) + c.fresh
      end
    end
  end
end
if shared > 0 and ended > 0 then
  local n = math.min(ended, shared)
  freed.q = n
  if n == shared then
    redis.call('HDEL', share, 'q')
  else
    redis.call('HSET', share, 'q', shared - n)
  end
end
for scope, mine in pairs(typed) do
  local n = math.min(mine.ended, mine.mine)
  if n > 0 then
    freed[scope] = n
    if n == mine.mine then
      redis.call('HDEL', share, scope)
    else
      redis.call('HSET', share, scope, mine.mine - n)
    end
  end
end
for scope, n in pairs(freed) do
  local left = counts[scope] - n
  if left < 0 then underflow, left = underflow - left, 0 end
  if left == 0 then
    redis.call('HDEL', running, scope)
  else
    redis.call('HSET', running, scope, left)
  end
  -- Only a count that was at its limit may have held a claim back (the limit the last claim counted under).
  local group = string.sub(scope, 1, 2) == 'g:'
  if counts[scope] >= limits[scope] and not group then wake_fetchers = true end
  if grouped and group then
    -- The group's parked flows (groups.lua's PARKED band) go back to their levels' virtual time.
    local parked = {}
    for level = 1, levels do parked[#parked + 1] = {level, string.sub(scope, 3) .. ':'} end
    -- Its flows of a limited type, from its park index (beside type limits: groups.lua), all of them.
    local park = string.sub(sched, 1, -7) .. ':park:' .. scope
    for _, entry in ipairs(redis.call('ZRANGE', park, 0, -1)) do
      local level, member = string.match(entry, '^(%d+)|(.*)$')
      if tonumber(level) and rings[tonumber(level)] then parked[#parked + 1] = {tonumber(level), member} end
    end
    redis.call('DEL', park)
    for _, p in ipairs(parked) do
      local score = redis.call('ZSCORE', rings[p[1]], p[2])
      if score and tonumber(score) >= 2e15 then
        redis.call('ZADD', rings[p[1]], 'XX', grouped[p[1]], p[2])
        wake_fetchers = true
      end
    end
  end
end
result[#result + 1] = journal
-- The next tasks for the slots it freed, claimed in this step (handover.lua): claim.lua's reply follows the
-- journal, and is stored with the call's result. A claim that filled every slot freed leaves no marker for them.
if handover then
  local reply, filled
  if fence == 'owner' then
    -- The running count as the subtraction above left it, and the time: the claim reads neither again. The types
    -- found before the writes are not for after them (a key found absent may have been written since).
    if freed.q then given.q = math.max(counts.q - freed.q, 0) end
    given.types, given.now = nil, now
    reply, filled = parts.run(handover, freed, levels, acks_only, given)
  else
    reply, filled = parts.none(levels), false
  end
  for _, n in ipairs(reply) do result[#result + 1] = n end
  if filled then wake_fetchers = false end
end
-- Kept a day: long enough for any retry (a caller retries until Redis answers), then it cleans itself up
-- after a daemon that died. Stored before the counters: whatever follows, a call that applied is known as such.
-- The results this call keeps (results.lua), in a few commands once everything applied.
write_kept(kept, now)
write_notes(notes)
redis.call('SET', last_call, call .. '|' .. table.concat(result, ','), 'PX', '86400000')
if dead_lettered > 0 then
  redis.call('LTRIM', dead, 0, dead_max - 1)
  redis.call('HINCRBY', stats, 'dead_lettered', dead_lettered)
end
if done > 0 then redis.call('HINCRBY', stats, 'done', done) end
if retried > 0 then redis.call('HINCRBY', stats, 'retried', retried) end
if recovered > 0 then redis.call('HINCRBY', stats, 'recovered', recovered) end
if failed > 0 then redis.call('HINCRBY', stats, 'failed', failed) end
if throttled > 0 then redis.call('HINCRBY', stats, 'throttled', throttled) end
if underflow > 0 then redis.call('HINCRBY', stats, 'running_underflow', underflow) end
if wake_fetchers then
  redis.call('LPUSH', wake, '1')
  redis.call('LTRIM', wake, '0', '0')
end
if wake_poller then
  redis.call('PUBLISH', channel, now)
end
notes_written(notes, channel, now)
return result
