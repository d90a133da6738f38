-- (The broker prepends checks.lua and deps.lua: src/broker/mod.rs, `sources`.)
-- flow_apply.lua: apply one dependency's outcome to one task that waits for it (docs/design/flows.md), in the
-- waiting task's slot. Called by the movers of the dependency's queue's outbox, at least once per note and
-- waiter: so it is idempotent, and a call that finds the outcome already recorded changes nothing.
--
-- KEYS[1] the waiting task's hash   P:{Q}:deps:ID
-- KEYS[2] its ended hash            P:{Q}:deps-ended:ID 
-- KEYS[3] the queue's waiting hash  P:{Q}:deps-waiting
-- KEYS[4] its ready list, as its hash's `ready` names it (the mover reads it first)
-- KEYS[5] wake list, KEYS[6] dead list, KEYS[7] stats hash, KEYS[8] the queue's outbox (P:{Q}:deps-outbox)
-- ARGV[1] the dependency (`QUEUE\nID`), ARGV[2] its outcome (a JSON object), ARGV[3] its state ("done" or
-- "dead"), ARGV[4] its name for a reason (`QUEUE/ID`), ARGV[5] its reason ("" for none)
-- Returns 'duplicate' (already recorded: nothing written), 'moved' (KEYS[4] is not the hash's ready list:
-- nothing written; read it again), or after recording it: 'recorded' (the task no longer waits, or is not
-- written yet: `flow push` applies what it finds), 'waiting', 'released' or 'failed'.
local k = waiter_keys(KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8])
local refused = check_waiter_keys('flow_apply.lua', k)
if refused then return refused end
local ready = redis.call('HGET', k.meta, 'ready')
if ready and ready ~= k.ready then return 'moved' end
if ARGV[3] ~= 'done' and ARGV[3] ~= 'dead' then
  return redis.error_reply('ERR flow_apply.lua: state ' .. ARGV[3] .. ' is neither done nor dead; nothing was written')
end
if redis.call('HSETNX', k.ended, ARGV[1], ARGV[2]) == 0 then return 'duplicate' end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local dead = false
if ARGV[3] == 'dead' then dead = {name = ARGV[4], reason = ARGV[5]} end
return step_waiter(k, now, dead)
