-- (The broker prepends checks.lua and deps.lua: src/broker/mod.rs, `sources`.)
-- flow_apply.lua: apply dependencies' outcomes to one task that waits for them (docs/design/flows.md), in the
-- waiting task's slot. Called by the movers of the dependencies' queues' outboxes, at least once per note and
-- waiter: so it is idempotent, and an outcome found already recorded changes nothing. One call applies every
-- note a mover read for this waiter (a fan-in's notes come in runs), so a dependency costs an HSETNX, not a
-- round trip of its own.
--
-- KEYS[1] the waiting task's hash   P:{Q}:deps:ID
-- KEYS[2] its ended hash            P:{Q}:deps-ended:ID 
-- KEYS[3] the queue's waiting hash  P:{Q}:deps-waiting
-- KEYS[4] its ready list, as its hash's `ready` names it (the mover reads it first)
-- KEYS[5] wake list, KEYS[6] dead list, KEYS[7] stats hash, KEYS[8] the queue's outbox (P:{Q}:deps-outbox)
-- KEYS[9] its run hash             P:{Q}:deps-run:ID
-- ARGV in groups of 4, one per note: the dependency (`QUEUE\nID`), its outcome (a JSON object; "" for a
-- withdrawal), its state ("done", "dead", or "withdraw": the dependency was requeued from its dead letters), its
-- run (0 until it is first requeued). A dead dependency's name (`QUEUE/ID`) and reason (its outcome's `reason`),
-- which a failed task's reason quotes, are made here only for the note that fails it: four arguments a note,
-- not six, are most of what a fan-in's note costs this script.
--
-- Runs (docs/design/flows.md, "A requeued dependency"): the run hash keeps the highest run of each
-- dependency heard of. A note of an older run than that is stale and changes nothing (a dead run's note
-- delivered again after the requeue withdrew it). A withdrawal of a newer run, while the task waits, records the
-- run and deletes the dependency's recorded outcome, so that the task waits for the new run; a task released or
-- failed ignores it. An outcome of a newer run replaces the recorded one; of
-- the same run, it is recorded only if none is (HSETNX: a duplicate delivery). The count is still the ended
-- hash's length: which dependencies ended, never how many notes came.
-- Returns 'moved' (KEYS[4] is not the hash's ready list: nothing written; read it again), else what became of
-- the task: 'released' or 'failed' (by this call), 'waiting', or 'recorded' (it no longer waits, or is not
-- written yet: `flow push` applies what it finds), or 'duplicate' when every note was recorded already or stale
-- (nothing written).
local k = waiter_keys(KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8], KEYS[9])
local refused = check_waiter_keys('flow_apply.lua', k)
if refused then return refused end
local ready = redis.call('HGET', k.meta, 'ready')
if ready and ready ~= k.ready then return 'moved' end
if #ARGV == 0 or #ARGV % 4 ~= 0 then
  return redis.error_reply('ERR flow_apply.lua: ' .. #ARGV .. ' arguments are not notes of 4; nothing was written')
end
local integer = integer_check('flow_apply.lua')
-- The run hash, read once for the call: a field for each dependency ever requeued, usually none.
local heard_of = {}
local flat = redis.call('HGETALL', k.runs)
for n = 1, #flat, 2 do
  refused = integer(k.runs, flat[n], flat[n + 1])
  if refused then return refused end
  heard_of[flat[n]] = tonumber(flat[n + 1])
end
for at = 1, #ARGV, 4 do
  local state = ARGV[at + 2]
  if state ~= 'done' and state ~= 'dead' and state ~= 'withdraw' then
    return redis.error_reply('ERR flow_apply.lua: state ' .. state .. ' is neither done, dead nor withdraw; ' ..
      'nothing was written')
  end
  if not string.match(ARGV[at + 3], '^%d+$') then
    return redis.error_reply('ERR flow_apply.lua: run ' .. ARGV[at + 3] .. ' is not a number; nothing was written')
  end
end
-- A dead dependency as a failed task's reason names it: `QUEUE/ID` (its field's newline, which no queue name
-- holds, made a slash) and its outcome's `reason` ("" when the outcome has none, or is not an object).
local function dead_dependency(dep, outcome)
  local name = string.gsub(dep, '\n', '/', 1)
  local ok, decoded = pcall(cjson.decode, outcome)
  local reason = ok and type(decoded) == 'table' and decoded.reason
  if type(reason) ~= 'string' then reason = '' end
  return {name = name, reason = reason}
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
-- The task's state, read once: the notes are applied one at a time, in order, exactly as if each were a call of
-- its own (docs/design/flows.md, "2. The steps"), but the count of recorded outcomes is kept here (the ended hash's
-- length at first, then what each HSETNX, HSET and HDEL replies) and the task is stepped (step_waiter: an HMGET
-- of ten fields and an HLEN) only when a note may decide it, not after every note: a fan-in's turn of a thousand
-- notes costs an HSETNX each.
local m = redis.call('HMGET', k.meta, 'state', 'need', 'if_failed')
local waiting = m[1] == 'waiting'
local need, fails = tonumber(m[2] or '0'), m[3] ~= 'continue'
local count = 0
if waiting then count = redis.call('HLEN', k.ended) end
local said, ran = 'duplicate', false
for at = 1, #ARGV, 4 do
  local dep, outcome, state, run = ARGV[at], ARGV[at + 1], ARGV[at + 2], tonumber(ARGV[at + 3])
  local heard = heard_of[dep] or 0
  local step = nil
  if state == 'withdraw' then
    -- Only a task that waits forgets: one released or failed keeps the outcome it was released or failed with
    -- until the new run's note replaces it (a newer run than any heard of), for `flow show`.
    if run > heard and waiting then
      redis.call('HSET', k.runs, dep, run)
      heard_of[dep] = run
      count = count - redis.call('HDEL', k.ended, dep)
      step = 'waiting'
    end
  elseif run >= heard then
    local wrote
    if run > heard then
      -- A newer run than any heard of (its withdrawal is not applied yet, or came to a task that no longer
      -- waits): its outcome replaces the older run's.
      redis.call('HSET', k.runs, dep, run)
      heard_of[dep] = run
      count = count + redis.call('HSET', k.ended, dep, outcome)
      ran, wrote = true, true
    else
      wrote = redis.call('HSETNX', k.ended, dep, outcome) == 1
      if wrote then count = count + 1 end
    end
    if wrote then
      if not waiting then
        step = 'recorded'
      elseif (state == 'dead' and fails) or count >= need then
        local dead = false
        if state == 'dead' then dead = dead_dependency(dep, outcome) end
        step = step_waiter(k, now, dead)
        waiting = step == 'waiting'
      else
        step = 'waiting'
      end
    end
  end
  -- What this call did to the task, once decided, is what it says.
  if step and said ~= 'released' and said ~= 'failed' then said = step end
end
if ran then
  -- A run recorded for a task that no longer waits expires with its other hashes (finish_waiter's expiry).
  local m = redis.call('HMGET', k.meta, 'state', 'keep_ms')
  if m[1] and m[1] ~= 'waiting' then
    redis.call('PEXPIRE', k.runs, tonumber(m[2] or '600000'))
    redis.call('PEXPIRE', k.ended, tonumber(m[2] or '600000'))
  end
end
return said
