-- (The broker prepends checks.lua and deps.lua: src/broker/mod.rs, `sources`.)
-- flow_apply.lua: apply dependencies' outcomes to one task that waits for them (docs/design/flows.md), in the
-- waiting task's slot. Called by the movers of the dependencies' queues' outboxes, at least once per note and
-- waiter: so it is idempotent, and an outcome found already recorded changes nothing. One call applies every
-- note a mover read for this waiter (a fan-in's notes come in runs), so a dependency costs a few commands, not
-- a round trip of its own.
--
-- KEYS[1] the waiting task's hash   P:{Q}:deps:ID
-- KEYS[2] its ended hash            P:{Q}:deps-ended:ID 
-- KEYS[3] the queue's waiting hash  P:{Q}:deps-waiting
-- KEYS[4] its ready list, as its hash's `ready` names it (the mover reads it first)
-- KEYS[5] wake list, KEYS[6] dead list, KEYS[7] stats hash, KEYS[8] the queue's outbox (P:{Q}:deps-outbox)
-- ARGV in groups of 5, one per outcome: the dependency (`QUEUE\nID`), its outcome (a JSON object), its state
-- ("done" or "dead"), its name for a reason (`QUEUE/ID`), its reason ("" for none)
-- Returns 'moved' (KEYS[4] is not the hash's ready list: nothing written; read it again), else what became of
-- the task: 'released' or 'failed' (by this call), 'waiting', or 'recorded' (it no longer waits, or is not
-- written yet: `flow push` applies what it finds), or 'duplicate' when every outcome was recorded already
-- (nothing written).
local k = waiter_keys(KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8])
local refused = check_waiter_keys('flow_apply.lua', k)
if refused then return refused end
local ready = redis.call('HGET', k.meta, 'ready')
if ready and ready ~= k.ready then return 'moved' end
if #ARGV == 0 or #ARGV % 5 ~= 0 then
  return redis.error_reply('ERR flow_apply.lua: ' .. #ARGV .. ' arguments are not outcomes of 5; nothing was written')
end
for at = 1, #ARGV, 5 do
  if ARGV[at + 2] ~= 'done' and ARGV[at + 2] ~= 'dead' then
    return redis.error_reply('ERR flow_apply.lua: state ' .. ARGV[at + 2] .. ' is neither done nor dead; nothing ' ..
      'was written')
  end
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
-- Every outcome recorded first, then one step for the call (a fan-in's turn records hundreds: a step each read
-- the task's hash and the ended hash's length each time). The same as a step after each record: under `fail` the
-- first dead outcome recorded fails the task whichever record it was, and otherwise only the count after the
-- last record can reach `need`.
local recorded, dead = false, false
for at = 1, #ARGV, 5 do
  if redis.call('HSETNX', k.ended, ARGV[at], ARGV[at + 1]) == 1 then
    recorded = true
    if not dead and ARGV[at + 2] == 'dead' then dead = {name = ARGV[at + 3], reason = ARGV[at + 4]} end
  end
end
if not recorded then return 'duplicate' end
return step_waiter(k, now, dead)
