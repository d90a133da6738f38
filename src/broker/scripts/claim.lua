-- (The broker prepends `#!lua`, rate.lua, turns.lua and types.lua: src/broker/mod.rs, `sources`.)
-- claim.lua: safe mode. Atomically move up to ARGV[2] tasks into the owner's claim lists, under the owner's
-- lease (one per daemon, renewed by its heartbeat).
--
-- KEYS[1] owners zset (owner -> lease deadline ms), KEYS[2] wake list, KEYS[3] the owner's info hash,
-- KEYS[4] dead list, KEYS[5] stats hash, KEYS[6] the queue's paused key (claims take nothing while it exists),
-- KEYS[7] the queue's throttle (likewise, until it expires: a handler's back-pressure, set by settle.lua),
-- KEYS[8 .. 7+L] ready lists, KEYS[8+L .. 7+4L] quarantine lists (group sizes 1, 8, 64, each over the levels),
-- KEYS[8+4L .. 7+5L] the owner's claim sets (`processing:OWNER:LEVEL`, zset claim -> tasks not yet settled),
-- KEYS[8+5L .. 7+6L] this claim's lists (`processing:OWNER:LEVEL:CLAIM`), KEYS[8+6L .. 7+7L] their running
-- scopes (`...:CLAIM:scopes`), levels in order; KEYS[8+7L] the running hash (scope -> tasks taken and not yet
-- settled); then for each of the R windows of the queue's rate limit, its log (a list of `MS COUNT` entries,
-- oldest first) and the log's sum (a string): KEYS[9+7L+2(r-1)], KEYS[10+7L+2(r-1)]; last, with priority
-- weights, the queue's sched hash (turns.lua's credits); last, with type limits, types.lua's keys
-- ARGV[1] owner; ARGV[2] the most tasks to take; ARGV[3] max_task_bytes; ARGV[4] dead list bound;
-- ARGV[5] queue name; ARGV[6] daemon (host:pid, for dead records); ARGV[7] the claim: a number unique within the
-- owner and increasing from call to call (the caller reserves ARGV[2] numbers from it on; see adopt.lua);
-- ARGV[8] the queue's max_running (0: none); ARGV[9] R, the windows of its rate limit (0: none), then R pairs:
-- the window in ms, the most starts in any such window; then W, the levels' priority weights (0: strict order),
-- then W weights, one per level in order; then types.lua's block (its first value 0: no type limits); then
-- groups.lua's block (its first value 0: no groups); last, the most bytes of ready tasks to take (see "Bytes")
-- Returns {now_ms, state, group level, tasks taken at level 1, ..., at level L, retry at (states 5, 6), the owner's
-- journal (see renew.lua), the time left of the owner's lease (its deadline minus now_ms, by which the daemon sees
-- Redis's clock step: see register.lua)}: the tasks themselves are in this claim's lists, which the caller reads
-- in the same transaction
-- (`MULTI`, this script, `LRANGE` of each list, `EXEC`: src/broker/tasks.rs), position p of a list being the
-- task with token (claim, p):
--   state 0: ready tasks were claimed, highest level first;
--   state 1: a quarantined group was claimed, alone (all of `group level`);
--   state 2: nothing was claimed, because this owner must hold nothing while it runs a quarantined group, and
--            it still holds tasks (the caller waits for them to be settled, then claims again);
--   state 3: nothing was claimed, because the queue is paused (`kmqd queue pause`): the caller waits idle_poll
--            and claims again. Checked here, in the claim itself, so that no claim that runs after the pause
--            takes anything, whatever the daemon last saw;
--   state 4: nothing was claimed, because max_running of the queue's tasks are taken and not yet settled, by
--            any daemon: the caller waits for a wake-up marker, which a settle that frees some pushes (a claim
--            that ends at its own limit, in this state or in 8, below the higher limit another daemon noted
--            passes a marker on to it);
--   state 5: nothing was claimed, because a window of the rate limit is full: the reply's `retry at` says when
--            its oldest start ages out (Redis's clock, ms; 0 in every other state), and the caller claims again
--            then;
--   state 6: nothing was claimed, because a handler throttled the queue (KEYS[7]): `retry at` is when the
--            throttle ends, and the caller claims again then;
--   state 7: nothing was claimed, though tasks wait, because their types' limits hold them back: the caller
--            waits for a wake-up marker (a settle that frees a type's slot pushes one, as does a push), at most
--            until `retry at` when it is not 0 (the earliest time a type's rate window lets a start go).
--   state 8: ready tasks were claimed, as in state 0, and they filled max_running: the caller waits for a wake-up
--            marker before it claims again (a claim now would take nothing, state 4, for a round trip and a
--            script's run; docs/PERFORMANCE.md, "Limits: `max_running` and `rate_limit`").
-- Fails with "LEASELOST ..." when the owner's lease is gone or past: its tasks then belong to the monitors (an
-- owner registered but missing from the owners zset is put back in it as expired, for them), and the daemon must
-- register a new owner; with "FENCED ..." when ARGV[7] is below the owner's floor, which
-- adopt.lua raised after this call's reply was given up for lost: the call then takes nothing, so it cannot
-- strand tasks.
--
-- Quarantine. A task that came back twice from an expired lease waits in a quarantine list. An owner takes a
-- group from the most suspect non-empty list (alone first, then groups of 8, then of 64) only when it holds
-- nothing, and claims nothing else until that group is settled (the info hash's `group` records its size): if
-- the daemon dies meanwhile, the crash is the group's. Its tasks then come back in smaller groups, and a task
-- that crashes its daemon running alone is charged for it (monitor.rs). While quarantined tasks wait, an owner
-- claims no ready task: it finishes what it holds, then runs a group.
--
-- Running limit. With ARGV[8] > 0 a claim takes at most what leaves the running hash's `q` at or below it (a
-- quarantined group included), adds what it took to `q`, and writes each non-empty list's scopes string `N q`
-- beside it, and the limit as `q:limit` (by which a settle that frees a slot of a full count knows to wake a
-- fetcher); settle.lua subtracts each settled task of a list from the scopes its string names, in the step that
-- settles it, and deletes the string with the list. So `q` counts exactly the tasks of counted lists not yet
-- settled, whatever becomes of their owner (the monitors settle an expired owner's tasks the same way), and a
-- list claimed without a limit (a daemon whose config has none) is never subtracted from it.
--
-- Rate limit. The claim counts its starts in each window's log as rate.lua says: it takes at most what every
-- window leaves, nothing when one is full (state 5).
--
-- Type limits (`[[queues.limits]]`, types.lua). A claim takes a task of a limited type only while every limit of
-- its type admits it, as well as the queue's: from the type's flow first, then from the ready list, where a task
-- its type holds back is moved to the flow instead of blocking the others. Its claim list then holds runs, one
-- per flow in the order first met, and its scopes string a line `N SCOPE...` per run in position order (`N` alone:
-- a run counted nowhere), which settle.lua subtracts from run by run. Its payloads become Lua strings on this path
-- (LPOP, then RPUSH), the price of choosing among several lists in one step; a queue without type limits never
-- takes it.
--
-- Bytes (review M8). A claim of ready tasks takes no more than ARGV[#ARGV] bytes of them, by `MEMORY USAGE` of
-- its lists (a little over the payloads' bytes, never under), and at least one task, however large (up to
-- max_task_bytes): a claim of a thousand tasks of 16 MiB would be gigabytes in one reply, which a daemon holds
-- and Redis buffers. The copy on the claim's list is cut to fit before the ready list is trimmed, so nothing goes
-- back. A quarantined group (at most 64 tasks) and a take with type limits or groups are bounded by their counts
-- only.
--
-- A payload longer than max_task_bytes is never handed to a daemon: it goes straight to the dead list, kept
-- whole with its size in the reason (as a JSON string when it is UTF-8, in base64 when it is not: see
-- `dead_oversized`).
--
-- Checks before it writes: the type of every key it touches (KEYS[6], the paused key, is only tested for
-- existence; KEYS[7], the throttle, for existence and its time to live), and that the counters it increments (the info hash's `journal`, the stats hash's `dead_lettered`)
-- are integers, all before its first write; a call that fails writes nothing ("WRONGTYPE claim.lua: KEY is a
-- string, not a list", "ERR claim.lua: KEY field F is not an integer"). The only exception is LEASELOST's
-- putting back of a lost owner as expired, which a second call repeats harmlessly.
--
-- This is the hot path, and no payload becomes a Lua string on it: `SORT list BY nosort LIMIT 0 N STORE claim`
-- copies the head of a ready list onto the claim's list natively and in order, `LTRIM` takes it off, and
-- `MEMORY USAGE` of the claim's list bounds every payload in it by max_task_bytes at once (only a batch larger
-- than that in all has its payloads checked one by one). A claim costs Redis a fifth of what a hash field per
-- task did (docs/PERFORMANCE.md, "What at-least-once costs Redis"). Its calls' constant arguments are written as
-- strings ('0', not 0): Redis turns a Lua number argument into a string with snprintf("%.17g"), about 2,250
-- instructions each (docs/PERFORMANCE.md, "The idle take's Lua, line by line").
-- The claim is a function of KEYS and ARGV (the script's own tables), so that settle.lua, which has this file and its
-- preludes before it, runs the same claim for the slot a settle frees (handover.lua): the turns, groups, type and
-- rate limits, lease and floor checks and quarantine of one claim, not a copy of them.
-- `dry`: only the checks of the keys' types and of the counters it reads (a handful of calls), returning nil when
-- they pass and the error otherwise, before anything is written; settle.lua makes them before its own first write.
-- `given`: what the settle that runs this claim (handover.lua) has read and checked already, so that the claim does
-- not ask Redis again (each call some 7,400 instructions: docs/PERFORMANCE.md, "Slots in step, settles in
-- parallel, and the claim after a settle"):
--   `types`, key -> the type the settle's checks found it to be ('none' when absent), before its first write;
--   `stats`, the stats hash whose counters the settle read and found integers;
--   `running`, the running hash, and `q`, `limit`: its fields `q` and `q:limit`, integers, as the settle read them
--   (its dry run) or as it left them (the claim's run after its writes); nil when the settle did not read them;
--   `now`: the settle's time, Redis's clock in ms (the claim's run).
-- A given finding counts only for the key it was made of: a call whose claim block names other keys than the
-- settle's (no daemon sends one) is checked as a claim of its own is.
local function claim_run(dry, checked, given)
  -- The counts a plain claim sends as '0' (no rate limit, no weights, no running limit, and types.lua's flows) are
  -- read without `tonumber` then: a call of it costs Redis about 1,800 instructions, the comparison 300.
  local rates = ARGV[9] ~= '0' and tonumber(ARGV[9]) or 0
  local WEIGHTS = 10 + 2 * rates
  local weights = ARGV[WEIGHTS] ~= '0' and tonumber(ARGV[WEIGHTS]) or 0
  local weighted = weights > 0
  -- The type limits' block (types.lua) follows the weights: its flows' count, and the keys it adds.
  local TYPES = WEIGHTS + 1 + weights
  -- The groups' block (groups.lua) follows the types': with groups, the levels' rings and the sched hash end KEYS.
  local type_flows, type_other_keys, GROUPS_AT = types_size(TYPES)
  local grouped = ARGV[GROUPS_AT] == '1'
  local per_level = 7
  if type_flows > 0 then per_level = 8 + type_flows end
  if grouped then per_level = per_level + 1 end
  local levels = (#KEYS - 8 - 2 * rates - (weighted and 1 or 0) - type_other_keys - (grouped and 1 or 0)) / per_level
  local READY, QUARANTINE, CLAIMS, LISTS, SCOPES = 7, 7 + levels, 7 + 4 * levels, 7 + 5 * levels, 7 + 6 * levels
  local RUNNING = 8 + 7 * levels
  local SCHED = weighted and RUNNING + 2 * rates + 1
  local TYPE_KEYS = RUNNING + 2 * rates + (weighted and 1 or 0) + 1
  local owner, max, max_bytes, claim = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[7]
  local max_running = ARGV[8] ~= '0' and tonumber(ARGV[8]) or 0
  -- What is left of the claim's bytes ("Bytes").
  local budget = tonumber(ARGV[#ARGV])
  -- The refusal of KEYS[i], found to be a `found`, not a `kind`.
  local function wrong(i, found, kind)
    return redis.error_reply('WRONGTYPE claim.lua: ' .. KEYS[i] .. ' is a ' .. found .. ', not a ' .. kind ..
      '; nothing was written')
  end
  -- A read of KEYS[i] (`command`, then its arguments after the key) that is also its type check: Redis refuses the
  -- read of a key of another type than the command's (`kind`), and the refusal is then the type check's. A key read
  -- so needs no TYPE before (one call less each: docs/PERFORMANCE.md, "A claim that pays only for the script code
  -- it uses"). Returns the reply, or nil and the refusal (Redis's own error, should it refuse it for another reason).
  local function read(i, kind, command, ...)
    local reply = redis.pcall(command, KEYS[i], ...)
    if type(reply) == 'table' and reply.err then
      local found = redis.call('TYPE', KEYS[i]).ok
      if found == 'none' or found == kind then return nil, reply end
      return nil, wrong(i, found, kind)
    end
    return reply
  end
  -- Keys a claim often finds absent, looked up together: those found absent need no call of their own below (their
  -- type checks, and the other looks at them). Each redis.call costs Redis about 5,000 instructions whatever its
  -- command does (a TYPE 4,900, docs/PERFORMANCE.md, "The idle claim's calls"), and the claim on every idle push's way
  -- to its handler made 16 such calls for these keys (issue 38). `absent`: the paused key and the throttle (KEYS[6],
  -- KEYS[7]), the quarantine lists, this claim's lists and their scopes strings, nearly always absent (the fence's
  -- look at the claim's lists, the pause's and the throttle's, and the quarantine's lengths are answered by it).
  -- `idle`: those and the wake list, the dead list, the owner's claim sets and the running hash, all absent when an
  -- idle fetcher claims a task just pushed (its BLPOP took the marker, it holds nothing, nothing was dead-lettered,
  -- no limit counts): one EXISTS for that claim, two for a busy queue's. Read before any write of this call (a
  -- settle's handover runs it after the settle's writes, and reads them afresh but for what its dry run found:
  -- `checked`, below), and nothing below writes to these keys before it looks at them (the claim's lists and scopes
  -- strings are written after the fence's check, the claim sets after `holds`). Both sets are KEYS[2], [4], [6], [7] and the run from the first quarantine list to the
  -- running hash, taken with `unpack` (a table built of them cost more than the calls it saved). Under max_running
  -- the running hash is left out: its read is its type check (`read`, below), and it exists once a claim noted the
  -- limit, so that every claim of the queue would miss `idle` for it.
  -- `checked`: what the checks of a dry run of this claim found, before the writes of the settle that then runs it
  -- (handover_run.lua): its keys' types and counters, the absent keys, the owner's lease, info and dead count. The
  -- settle between wrote none of it but the claim sets (which only make `idle` and `holds` err on the careful side)
  -- and the running hash, read again below: so the claim looks at none of it a second time.
  local integer = integer_check('claim.lua')
  local idle, absent, holds, info, dead_count, lease, refused
  local found_types = given and given.types
  if checked then
    idle, absent, holds = checked.idle, checked.absent, checked.holds
    info, dead_count, lease = checked.info, checked.dead_count, checked.lease
  else
    -- A settle that found one of the owner's claim sets present knows the owner is not idle (it holds the tasks it
    -- settles): the EXISTS of them all would only say so again.
    local settling = false
    if found_types then
      for i = CLAIMS + 1, LISTS do
        if found_types[KEYS[i]] == 'zset' then settling = true end
      end
    end
    idle = not settling and redis.call('EXISTS', KEYS[2], KEYS[4], KEYS[6], KEYS[7],
      unpack(KEYS, QUARANTINE + 1, max_running > 0 and RUNNING - 1 or RUNNING)) == 0
    absent = idle
    if not idle then
      local rare = {KEYS[6], KEYS[7], unpack(KEYS, QUARANTINE + 1, CLAIMS)}
      for i = LISTS + 1, SCOPES + levels do rare[#rare + 1] = KEYS[i] end
      absent = redis.call('EXISTS', unpack(rare)) == 0
    end
    -- Every key's type first (a handful of calls per claim, none per task); the type limits' keys, types.lua's.
    -- `holds`: whether the owner holds tasks (one of its claim sets exists), which their type checks tell: a busy
    -- queue's claim needs no EXISTS of its own for them (an idle one's knows them absent).
    holds = false
    for i = 1, TYPE_KEYS - 1 do
      -- Whether KEYS[i] needs no type check: known absent, the paused key (only its existence counts), or a key whose
      -- read below is its type check (`read`): the owners zset, the owner's info hash, the stats hash, and the running
      -- hash under max_running. (Worked out here, not by a function of its own: a closure of seven upvalues and a
      -- call a key cost an idle claim 7,600 instructions.)
      local known = i == 1 or i == 3 or i == 5 or i == 6 or (i == RUNNING and max_running > 0)
      if not known and (i == 2 or i == 4 or i == 7 or (i > QUARANTINE and i <= RUNNING)) then
        known = idle or (absent and (i == 7 or (i > QUARANTINE and i <= CLAIMS) or (i > LISTS and i < RUNNING)))
      end
      if not known then
        local kind = 'list'
        if i == 1 or (i > CLAIMS and i <= LISTS) then
          kind = 'zset'
        elseif i == 3 or i == 5 or i == RUNNING or i == SCHED then
          kind = 'hash'
        elseif i == 7 then
          kind = 'string'
        elseif i > RUNNING then
          if (i - RUNNING) % 2 == 0 then kind = 'string' end
        elseif i > SCOPES then
          kind = 'string'
        end
        -- What the settle's own check of this key found, if it made one and found it absent or of this kind.
        local found = found_types and found_types[KEYS[i]]
        if found ~= kind and found ~= 'none' then found = redis.call('TYPE', KEYS[i]).ok end
        if found ~= 'none' and i > CLAIMS and i <= LISTS then holds = true end
        if found ~= 'none' and found ~= kind then return wrong(i, found, kind) end
      end
    end
    -- Then the numbers it reads and the counters it increments: integers, or absent; and the owner's lease.
    info, refused = read(3, 'hash', 'HMGET', 'floor', 'group', 'journal')
    if refused then return refused end
    -- The settle read the stats hash's counters, and checked them, itself.
    if not (given and given.stats == KEYS[5]) then
      dead_count, refused = read(5, 'hash', 'HGET', 'dead_lettered')
      if refused then return refused end
    end
    refused = integer(KEYS[3], 'floor', info[1]) or integer(KEYS[3], 'journal', info[3]) or
      integer(KEYS[5], 'dead_lettered', dead_count)
    if refused then return refused end
    lease, refused = read(1, 'zset', 'ZSCORE', owner)
    if refused then return refused end
  end
  local running, known_limit = 0, 0
  if max_running > 0 and given and given.q and given.running == KEYS[RUNNING] then
    running, known_limit = given.q, given.limit
  elseif max_running > 0 then
    local value
    value, refused = read(RUNNING, 'hash', 'HMGET', 'q', 'q:limit')
    if refused then return refused end
    refused = integer(KEYS[RUNNING], 'q', value[1]) or integer(KEYS[RUNNING], 'q:limit', value[2])
    if refused then return refused end
    running = tonumber(value[1] or '0')
    known_limit = tonumber(value[2] or '0')
  end
  -- The rate limit's logs: their sums and newest entries parsed before any write (rate.lua). Each prelude's
  -- functions are defined only for a call that uses them (`rate_parts` and the others: rate.lua says why).
  local windows
  if rates > 0 then
    rate_parts()
    windows, refused = rate.read('claim.lua', rates, RUNNING + 1, 10, integer)
    if refused then return refused end
  end
  -- With priority weights, the levels' credits (turns.lua), read and checked before any write.
  local credits
  if weighted then
    turns_parts()
    credits, refused = turns.read('claim.lua', KEYS[SCHED], levels, integer)
    if refused then return refused end
  end
  -- The type limits' flows, their keys and counts (types.lua), read and checked before any write.
  local flowing = type_flows > 0
  local block
  if flowing then
    types_parts()
    block, refused = types.read('claim.lua', TYPES, TYPE_KEYS, levels, KEYS[RUNNING], integer)
    if refused then return refused end
  end
  -- The groups' rings, virtual times and limits (groups.lua), read and checked before any write.
  local grp = {on = false}
  if grouped then
    groups_parts()
    grp, refused = groups.read('claim.lua', GROUPS_AT, #KEYS - levels, levels, integer)
    if refused then return refused end
  end
  -- Type limits beside groups: the groups' turns serve the (GROUP, TYPE) flows too (groups.lua).
  if flowing and grp.on then groups.with_types(grp, block, 4 * tonumber(ARGV[2]) + 256) end
  if dry then
    -- A plain claim's findings, for the same claim after the settle's writes (handover_run.lua).
    if rates == 0 and not weighted and not flowing and not grouped then
      return nil, {idle = idle, absent = absent, holds = holds, info = info, dead_count = dead_count, lease = lease}
    end
    return nil
  end
  local now = given and given.now
  if not now then
    local t = redis.call('TIME')
    -- (Lua's arithmetic converts TIME's strings itself, at half a tonumber's cost; the lease is converted once.)
    now = t[1] * 1000 + math.floor(t[2] / 1000)
  end
  lease = lease and tonumber(lease)
  if not lease or lease <= now then
    -- An owner whose lease entry is gone while its registration is there (Redis lost it, or it was removed by hand)
    -- is put back as expired, as renew.lua does, so that the monitors find what it holds: its daemon, told here,
    -- forgets it and never renews it again.
    if not lease and redis.call('EXISTS', KEYS[3]) == 1 then
      redis.call('ZADD', KEYS[1], 0, owner)
    end
    return redis.error_reply('LEASELOST owner ' .. owner .. ' has no live lease')
  end
  if info[1] and tonumber(claim) < tonumber(info[1]) then
    return redis.error_reply('FENCED claim ' .. claim .. ' below the floor ' .. info[1])
  end
  for i = LISTS + 1, LISTS + levels do
    if not absent and redis.call('EXISTS', KEYS[i]) == 1 then
      return redis.error_reply('FENCED claim ' .. claim .. ' was already made')
    end
  end

  -- The dead record of a payload over max_task_bytes keeps its exact bytes as the daemon's own records do
  -- (settlement.rs, DeadRecord; docs/PROTOCOL.md, "Dead letters"): as `task`, a JSON string, when they are UTF-8,
  -- else as `task_base64` (RFC 4648, padded), so that the record is valid UTF-8 and JSON whatever the bytes (review
  -- L13: cjson.encode passed them through, and the record of a payload that is not UTF-8 was neither). Such a
  -- payload is large by definition: it is copied as few times as it can be, and no copy outlives the call. A UTF-8
  -- one is encoded with its record in one cjson.encode (in C; its buffer made private to the call, where Redis
  -- keeps it by default for the next call, as large as the largest string encoded, outside `maxmemory`'s count);
  -- another is encoded in Lua, in base64 pieces concatenated once with the record's other fields.
  local dead_lettered = 0
  local function dead_oversized(payload)
    -- Defined here, so that only a claim that dead-letters a payload creates them (rate.lua says why).
    local function is_utf8(s)
      -- Runs of ASCII are skipped by string.find; from a byte that is not ASCII on, a chunk of up to 4,096 bytes is
      -- read as numbers at once (one string.byte) and each character checked as Rust's str::from_utf8 does: no
      -- overlong form, no surrogate, nothing past U+10FFFF, nothing cut short.
      local n = #s
      local i = string.find(s, '[\128-\255]')
      while i do
        local last = math.min(i + 4095, n)
        local b = {string.byte(s, i, last)}
        local j, m = 1, last - i + 1
        while j <= m do
          local c = b[j]
          if c < 128 then
            j = j + 1
          else
            local need, lo, hi = 1, 128, 191
            if c >= 194 and c <= 223 then need = 1
            elseif c == 224 then need, lo = 2, 160
            elseif (c >= 225 and c <= 236) or c == 238 or c == 239 then need = 2
            elseif c == 237 then need, hi = 2, 159
            elseif c == 240 then need, lo = 3, 144
            elseif c >= 241 and c <= 243 then need = 3
            elseif c == 244 then need, hi = 3, 143
            else return false end
            if j + need > m then
              -- Cut short by the end of the payload, or by the chunk's: the next chunk starts at this character.
              if last == n then return false end
              break
            end
            local b1, b2, b3 = b[j + 1], b[j + 2], b[j + 3]
            if b1 < lo or b1 > hi then return false end
            if need >= 2 and (b2 < 128 or b2 > 191) then return false end
            if need == 3 and (b3 < 128 or b3 > 191) then return false end
            j = j + need + 1
          end
        end
        i = string.find(s, '[\128-\255]', i + j - 1)
      end
      return true
    end
    local B64 = 'ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/'
    -- Appends `s` in base64 to `parts`, in pieces of 8,192 characters: each 3 bytes are two halves of 12 bits, each
    -- two characters of a table of 4,096.
    local function base64_into(parts, s)
      local pair = {}
      for v = 0, 4095 do
        local hi, lo = (v - v % 64) / 64 + 1, v % 64 + 1
        pair[v] = string.sub(B64, hi, hi) .. string.sub(B64, lo, lo)
      end
      local n = #s
      local whole = n - n % 3
      local chunk, k = {}, 0
      for i = 1, whole, 3 do
        local a, b, c = string.byte(s, i, i + 2)
        local v = a * 65536 + b * 256 + c
        local lo = v % 4096
        chunk[k + 1], chunk[k + 2] = pair[(v - lo) / 4096], pair[lo]
        k = k + 2
        if k == 8192 then
          parts[#parts + 1] = table.concat(chunk, '', 1, k)
          k = 0
        end
      end
      if k > 0 then parts[#parts + 1] = table.concat(chunk, '', 1, k) end
      if n > whole then
        local a, b = string.byte(s, whole + 1, n)
        local v = a * 65536 + (b or 0) * 256
        local lo = v % 4096
        local last = pair[(v - lo) / 4096] .. pair[lo]
        if b then last = string.sub(last, 1, 3) .. '=' else last = string.sub(last, 1, 2) .. '==' end
        parts[#parts + 1] = last
      end
    end
    dead_lettered = dead_lettered + 1
    local record = {dead_at = now, queue = ARGV[5], id = '', type = '', attempt = 0,
      reason = 'task is ' .. #payload .. ' bytes, more than max_task_bytes (' .. ARGV[3] .. '); it was not run',
      size = #payload, daemon = ARGV[6]}
    if is_utf8(payload) then
      record.task = payload
      local keep = cjson.encode_keep_buffer and cjson.encode_keep_buffer()
      if keep then cjson.encode_keep_buffer(false) end
      record = cjson.encode(record)
      if keep then cjson.encode_keep_buffer(true) end
    else
      local parts = {string.sub(cjson.encode(record), 1, -2), ',"task_base64":"'}
      base64_into(parts, payload)
      parts[#parts + 1] = '"}'
      record = table.concat(parts)
    end
    redis.call('LPUSH', KEYS[4], record)
  end
  -- `took`: the tasks this claim put in its lists (what its journal bump, running count and rate logs count).
  local took, retry_at = 0, 0
  -- The owner's journal: one more for a claim that took something; its value, then the lease's time left, end the
  -- reply (see renew.lua).
  local function finish(result)
    if took > 0 and max_running > 0 then redis.call('HINCRBY', KEYS[RUNNING], 'q', took) end
    if took > 0 and rates > 0 then rate.spend(windows, took, now) end
    if took > 0 and flowing then types.scopes_spend(block.flows, KEYS[RUNNING], now) end
    if took > 0 and grp.on then groups.spend(grp, KEYS[RUNNING], now) end
    result[#result + 1] = retry_at
    if dead_lettered > 0 then
      redis.call('LTRIM', KEYS[4], 0, tonumber(ARGV[4]) - 1)
      redis.call('HINCRBY', KEYS[5], 'dead_lettered', dead_lettered)
    end
    if took > 0 then
      result[#result + 1] = redis.call('HINCRBY', KEYS[3], 'journal', '1')
    else
      result[#result + 1] = tonumber(info[3] or '0')
    end
    result[#result + 1] = lease - now
    return result
  end
  local function empty(state, level)
    local result = {now, state, level}
    for i = 1, levels do result[3 + i] = 0 end
    return result
  end
  -- Records a non-empty claim list in the owner's claim set: its score counts its tasks not yet settled; under a
  -- running limit, its scopes string says they count in `q` (`lines`, with type limits: the scopes of each run of
  -- the list, see "Type limits").
  local function record(level, n, lines)
    redis.call('ZADD', KEYS[CLAIMS + level], n, claim)
    took = took + n
    if lines then
      redis.call('SET', KEYS[SCOPES + level], lines)
    elseif max_running > 0 then
      redis.call('SET', KEYS[SCOPES + level], n .. ' q')
    end
  end

  -- The helpers of a quarantined group's take and of the takes with type limits or groups, defined only for a claim
  -- that may take one of those paths (a key of the quarantine or the claim's own exists, or the queue has type
  -- limits or groups): Lua creates a closure for each `local function` as the claim runs, whether it is called or
  -- not, about 1,600 instructions of Redis's each with its upvalues (docs/PERFORMANCE.md, "The idle take's Lua,
  -- line by line").
  local GROUPS, push_small, push_runs, new_runs, held_back
  if flowing or grp.on or not absent then
    -- The quarantine's group sizes, from its most suspect list on.
    GROUPS = {1, 8, 64}
    -- Pushes `got` (payloads as Lua strings: a quarantined group, or a batch checked one by one) onto the claim's
    -- list at `level`, in chunks (unpack's stack is bounded), dropping the payloads over max_task_bytes.
    function push_small(level, got)
      local kept, n = {}, 0
      for k = 1, #got do
        if #got[k] > max_bytes then
          dead_oversized(got[k])
        else
          n = n + 1
          kept[#kept + 1] = got[k]
          if #kept == 1000 then
            redis.call('RPUSH', KEYS[LISTS + level], unpack(kept))
            kept = {}
          end
        end
      end
      if #kept > 0 then redis.call('RPUSH', KEYS[LISTS + level], unpack(kept)) end
      return n
    end
    -- With type limits: pushes `runs` (each the payloads of one flow, or of none, as Lua strings) onto the claim's
    -- list at `level`, run after run, dropping the payloads over max_task_bytes, counts each run's tasks as its
    -- flow's, and records the list with a line `N SCOPE...` per run. Returns the tasks pushed.
    function push_runs(level, runs)
      local lines, counted, n = {}, false, 0
      for _, run in ipairs(runs) do
        local k = push_small(level, run.payloads)
        if k > 0 then
          local scopes = {}
          if max_running > 0 then scopes[#scopes + 1] = 'q' end
          -- A run counts in its flow's scope: a type's, a group's, or both (groups.lua's `group_pair`).
          for _, part in ipairs(run.flow and (run.flow.parts or {run.flow}) or {}) do
            if part.max_running > 0 then scopes[#scopes + 1] = part.scope end
            part.taken = part.taken + k
          end
          counted = counted or #scopes > 0
          lines[#lines + 1] = k .. ' ' .. table.concat(scopes, ' ')
          n = n + k
        end
      end
      if n > 0 then
        local text = false
        if counted then text = table.concat(lines, '\n') end
        record(level, n, text)
      end
      return n
    end
    -- With type limits: the runs of a take, grouped by flow in the order first met (false: no limited type).
    function new_runs()
      local runs, by = {}, {}
      return runs, function(flow, payload)
        local at = flow or runs
        local run = by[at]
        if not run then
          run = {flow = flow, payloads = {}}
          by[at] = run
          runs[#runs + 1] = run
        end
        run.payloads[#run.payloads + 1] = payload
      end
    end
    -- When nothing was taken though tasks wait, because their types' limits hold them back (state 7): when the
    -- earliest of those limits lets one go (0: only a running slot, which a settle's wake-up marker announces).
    function held_back()
      local any, at = types.held(block)
      if any then
        retry_at = at
        return finish(empty(7, 0))
      end
    end
  end
  -- After the lease and floor checks, so that a paused or throttled queue still tells a lost lease or a fenced
  -- claim. One EXISTS for both keys: a queue that is neither costs no more than the pause alone did.
  if not absent and redis.call('EXISTS', KEYS[6], KEYS[7]) > 0 then
    if redis.call('EXISTS', KEYS[6]) == 1 then
      return finish(empty(3, 0))
    end
    rate_parts()
    local ends = rate.throttle_until(KEYS[7], now)
    if ends then
      retry_at = ends
      return finish(empty(6, 0))
    end
  end
  -- The tasks a level holds that this claim may take: its ready list, and its flows that their limits admit (before
  -- types_admit: all its flows).
  local function waiting(i)
    local n = redis.call('LLEN', KEYS[READY + i])
    if flowing then
      for _, flow in ipairs(block.flows) do
        if flow.room ~= 0 then n = n + redis.call('LLEN', flow.lists[i]) end
      end
    end
    -- A grouped level has at least one task if a flow is in the lowest band: as many as the claim may take, for
    -- the turns between levels (a level whose groups give fewer leaves the rest to the others, below).
    if grp.on and groups.waiting(grp, i) then n = n + max end
    return n
  end
  -- Passes the wake-up on to another idle fetcher when some level holds a task: one marker at most.
  local function pass_wake_on()
    for i = 1, levels do
      if waiting(i) > 0 then
        redis.call('LPUSH', KEYS[2], '1')
        redis.call('LTRIM', KEYS[2], '0', '0')
        return
      end
    end
  end
  -- Whether the running limit leaves room once this claim took what it may.
  local room = true
  -- The limit this claim counts under, for the settles that free a slot to tell whether to wake a fetcher: written
  -- once nothing after it can fail (a full count or a full window returns at once; otherwise after every check).
  local function note_limit()
    if max_running > 0 and known_limit ~= max_running then
      redis.call('HSET', KEYS[RUNNING], 'q:limit', max_running)
    end
  end
  if max_running > 0 then
    if running >= max_running then
      -- In a rolling change of max_running, the marker this fetcher took may have been pushed for a daemon whose
      -- higher limit (`q:limit`, noted by its claim) leaves a slot: passed on, so that it claims now rather than
      -- after idle_poll (model/README.md, the sixth finding; a claim that fills this limit does the same, below).
      -- Noting this claim's lower limit bounds it to one pass a higher limit noted, so that fetchers at the lower
      -- limit do not hand a marker to and fro.
      if running < known_limit then pass_wake_on() end
      note_limit()
      return finish(empty(4, 0))
    end
    if max >= max_running - running then
      max, room = max_running - running, false
    end
  end
  -- Each window leaves its limit minus what is still in it once the entries that aged out are dropped (read here,
  -- dropped once every check is done, below).
  local free, due, bad = nil, 0, nil
  if rates > 0 then free, due, bad = rate.scan('claim.lua', windows, now) end
  if bad then return bad end
  if due > 0 then
    rate.drop(windows)
    note_limit()
    retry_at = due
    return finish(empty(5, 0))
  end
  if free and max >= free then
    max, room = free, false
  end
  -- The type limits' rooms, once the queue's own limits let the claim go on (types.lua; written below).
  if flowing then
    bad = types.admit('claim.lua', block, KEYS[RUNNING], now, true)
    if bad then return bad end
  end

  -- With groups: the flows whose time came back return to their rings, and the ready lists' tasks go to their
  -- groups' flows (groups.lua), before the quarantine and the turns. Planned and checked first, with every group
  -- the quarantined group and the turns will read (`groups_check`), so that a count or a key of the wrong type
  -- refuses the claim before its first write (a group's running count that is not an integer was found after the
  -- rings moved: script_checks, `a_grouped_claim_refused_for_a_group_count_moves_no_task_to_its_group`).
  local due_plan, intake_plan
  if grp.on then
    local moved, touched
    due_plan, moved, bad = groups.due(grp, levels, KEYS[RUNNING], now)
    if bad then return bad end
    intake_plan, touched, bad = groups.intake(grp, levels, function(level) return KEYS[READY + level] end,
      4 * tonumber(ARGV[2]) + 256)
    if bad then return bad end
    -- The groups of the quarantined group that the claim may take (the first quarantine list that holds tasks,
    -- as below).
    local looked = max == 0
    for stage = 1, 3 do
      for i = 1, levels do
        local list = KEYS[QUARANTINE + (stage - 1) * levels + i]
        if not looked and not absent and redis.call('LLEN', list) > 0 then
          looked = true
          for _, payload in ipairs(redis.call('LRANGE', list, 0, math.min(GROUPS[stage], max) - 1)) do
            local _, refused = groups.state('claim.lua', grp, groups.route(payload), KEYS[RUNNING], now)
            if refused then return refused end
          end
        end
      end
    end
    bad = groups.check('claim.lua', grp, levels, max, moved, touched, KEYS[RUNNING], now)
    if bad then return bad end
  end
  -- Every check is done: the first writes (but for a full count's or a full window's answer, above).
  if rates > 0 then rate.drop(windows) end
  note_limit()
  if flowing then types.write(block, KEYS[RUNNING]) end
  if grp.on then
    groups.write(grp)
    groups.due_apply(grp, levels, due_plan, now)
    groups.intake_apply(grp, levels, intake_plan)
  end

  if info[2] then
    if holds then
      return finish(empty(2, 0))
    end
    redis.call('HDEL', KEYS[3], 'group')
  end
  for stage = 1, 3 do
    for i = 1, levels do
      local list = KEYS[QUARANTINE + (stage - 1) * levels + i]
      if not absent and redis.call('LLEN', list) > 0 then
        if holds then
          return finish(empty(2, 0))
        end
        local got = false
        if max > 0 and grp.on then
          got = redis.call('LRANGE', list, 0, math.min(GROUPS[stage], max) - 1)
        elseif max > 0 then
          got = redis.call('LPOP', list, math.min(GROUPS[stage], max))
        end
        local n
        if grp.on and got then
          -- With groups, the group as far as its tasks' groups admit it, in order (each group's state read before
          -- anything is taken off the list); the rest stays at the list's head.
          local states = {}
          for k = 1, #got do
            local st, refused = groups.state('claim.lua', grp, groups.route(got[k]), KEYS[RUNNING], now)
            if refused then return refused end
            states[k] = st
          end
          local runs, add = new_runs()
          local kept, due = 0, 0
          for k = 1, #got do
            local st = states[k]
            local typ = flowing and types.route(block, got[k]) or nil
            if groups.refused(st, now) then break end
            if typ and typ.room == 0 then
              due = typ.due or 0
              break
            end
            if st.room then st.room = st.room - 1 end
            if typ and typ.room then typ.room = typ.room - 1 end
            add(groups.pair(grp, st, typ), got[k])
            kept = k
          end
          if kept == 0 then
            retry_at = groups.next(grp, levels)
            if due > 0 and (retry_at == 0 or due < retry_at) then retry_at = due end
            return finish(empty(7, 0))
          end
          redis.call('LTRIM', list, kept, -1)
          n = push_runs(i, runs)
        elseif flowing and got then
          -- The group as far as its types' limits admit it, in order; the rest goes back to the list's head.
          local runs, add = new_runs()
          local kept = 0
          for k = 1, #got do
            local flow = types.route(block, got[k])
            if not types.admit_one(flow) then
              flow.held = true
              break
            end
            add(flow, got[k])
            kept = k
          end
          for k = #got, kept + 1, -1 do redis.call('LPUSH', list, got[k]) end
          if kept == 0 then
            return held_back() or finish(empty(0, 0))
          end
          n = push_runs(i, runs)
        else
          n = push_small(i, got or {})
          if n > 0 then record(i, n) end
        end
        if n == 0 then
          return finish(empty(0, 0))
        end
        redis.call('HSET', KEYS[3], 'group', GROUPS[stage])
        local result = empty(1, i)
        result[3 + i] = n
        return finish(result)
      end
    end
  end

  local result = empty(0, 0)
  local taken = 0
  -- Whether the byte budget cut this claim short of what it could take.
  local cut = false
  -- Strict order takes from the highest level first; priority weights split the claim between the levels that have
  -- tasks by their turns (turns.lua).
  local want
  if weighted then
    local available = {}
    for i = 1, levels do available[i] = waiting(i) end
    want = turns.split(KEYS[SCHED], {unpack(ARGV, WEIGHTS + 1, WEIGHTS + levels)}, credits, available, max)
  end
  -- A level's take with type limits (`take_flowing`) or groups (`take_grouped`), defined only for a claim that has
  -- them.
  local take_flowing, take_grouped
  if flowing then
    -- With type limits, a level's take (types.lua's `types_take`): from its flows, then its ready list, looking at
    -- no more than SCAN tasks of it a claim.
    local SCAN = 4 * max + 256
    function take_flowing(i, take)
      local runs, add = new_runs()
      local got = types.take(block, i, {KEYS[READY + i]}, take, SCAN, add)
      local n = push_runs(i, runs)
      taken = taken + got
      return n
    end
  end
  if grp.on then
    -- With groups, every level's candidate flows and their groups' states are read before the first task is taken
    -- (groups.lua), so that a key of the wrong type fails the claim before it holds any payload.
    local cands = {}
    for i = 1, levels do
      cands[i], bad = groups.candidates('claim.lua', grp, i, max, KEYS[RUNNING], now)
      if bad then return bad end
    end
    -- With groups, a level's take: turns over its candidate flows (groups.lua).
    function take_grouped(i, take)
      local runs, add = new_runs()
      local got, held = groups.take(grp, i, cands[i], take, now, add)
      cands[i] = {}
      if held then grp.held = true end
      taken = taken + got
      return push_runs(i, runs)
    end
  end
  for i = 1, levels do
    local ready = KEYS[READY + i]
    local n, bytes = 0, 0
    local take = max - taken
    if want then take = want[i] end
    if grp.on then
      if take > 0 then n = take_grouped(i, take) end
    elseif flowing then
      if take > 0 then n = take_flowing(i, take) end
    elseif take > 0 and (taken == 0 or budget > 0) then
      n = redis.call('SORT', ready, 'BY', 'nosort', 'LIMIT', '0', take, 'STORE', KEYS[LISTS + i])
    end
    if n > 0 and not flowing and not grp.on then
      -- One weighing serves the byte budget and max_task_bytes. Over the budget, the copy is cut to what fits (as
      -- many as fit if the tasks are alike, fewer each time until they do), keeping one task for a claim that has
      -- none yet; the ready list is trimmed by what is kept.
      local list = KEYS[LISTS + i]
      bytes = redis.call('MEMORY', 'USAGE', list, 'SAMPLES', '0')
      local least = taken == 0 and 1 or 0
      while n > least and bytes > budget do
        n = math.max(least, math.min(n - 1, math.floor(n * budget / bytes)))
        cut = true
        if n > 0 then
          redis.call('LTRIM', list, 0, n - 1)
          bytes = redis.call('MEMORY', 'USAGE', list, 'SAMPLES', '0')
        else
          redis.call('DEL', list)
          bytes = 0
        end
      end
      budget = budget - bytes
    end
    if n > 0 and not flowing and not grp.on then
      redis.call('LTRIM', ready, n, '-1')
      taken = taken + n
      if bytes > max_bytes then
        -- Perhaps one payload is too large: check them one by one, each taken from the list's head and put back at
        -- its tail unless it is dead-lettered, so that the script holds one payload at a time, not the batch.
        local list, kept = KEYS[LISTS + i], 0
        for _ = 1, n do
          local payload = redis.call('LPOP', list)
          if #payload > max_bytes then
            dead_oversized(payload)
          else
            redis.call('RPUSH', list, payload)
            kept = kept + 1
          end
        end
        n = kept
      end
      if n > 0 then record(i, n) end
    end
    result[3 + i] = n
  end
  -- With weights and type limits, a level's turns may fall on tasks their types hold back (moved to their flows,
  -- nothing taken): the claim then takes what it still may from the levels that took nothing, in strict order, so
  -- that a task no limit holds back does not wait for the next wake-up (a level that took something keeps its one
  -- claim list; the model's finding, model/README.md).
  if (flowing or grp.on) and want and taken < max then
    for i = 1, levels do
      if result[3 + i] == 0 and taken < max then
        if grp.on then
          result[3 + i] = take_grouped(i, max - taken)
        else
          result[3 + i] = take_flowing(i, max - taken)
        end
      end
    end
  end
  if flowing and took == 0 and taken == 0 then
    local held = held_back()
    if held then return held end
  end
  if grp.on and took == 0 and taken == 0 then
    -- Nothing taken though groups hold tasks that their limits or pauses hold back (state 7): when the earliest
    -- timed flow may go on (0: a settle's or a resume's wake-up marker says when).
    local at, any = groups.next(grp, levels)
    if any or grp.held then
      retry_at = at
      return finish(empty(7, 0))
    end
  end
  if (taken == max or cut) and room then
    -- The queue may hold more than this fetcher can take: pass the wake-up on to another idle fetcher.
    pass_wake_on()
  elseif result[2] == 0 and took > 0 and max_running > 0 and running + took >= max_running and
      running + took < known_limit then
    -- It filled its own limit below the higher one another daemon noted: passed on, as at state 4 (above).
    pass_wake_on()
  end
  if result[2] == 0 and took > 0 and max_running > 0 and running + took >= max_running then result[2] = 8 end
  return finish(result)
end
