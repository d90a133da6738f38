-- deps.lua: what becomes of a waiting task once its dependencies' outcomes are recorded (docs/design/flows.md),
-- one copy for flow_push.lua and flow_apply.lua, which the broker prepends it to (src/broker/mod.rs, `sources`).
--
-- A waiting task is the hash `P:{Q}:deps:ID` (fields: queue, id, type, envelope, ready, if_failed, need, up,
-- dead_max, keep_ms, state, reason, deps); the outcomes of its dependencies that ended are the hash
-- `P:{Q}:deps-ended:ID` (`QUEUE\nID` -> the outcome object the dependency's daemon built); `P:{Q}:deps-waiting`
-- holds the ids of the queue's waiting tasks; `P:{Q}:deps-run:ID` the highest run of each dependency heard of
-- (flow_apply.lua only: a run rises with each `dead requeue` of the dependency). Nothing here counts: the ended
-- hash's length is compared with `need`, and only a task in state `waiting` changes, so each waiting task is
-- released or failed once.

-- The keys a waiting task's step may write, by name, for the type checks and the step itself. `runs` (the
-- run hash) is flow_apply.lua's only: nil for flow_push.lua, which records no outcome.
local function waiter_keys(meta, ended, waiting, ready, wake, dead, stats, outbox, runs)
  return {meta = meta, ended = ended, waiting = waiting, ready = ready, wake = wake, dead = dead, stats = stats,
    outbox = outbox, runs = runs}
end

-- nil when every key is absent or of its type and the counters are integers, else the error reply (nothing was
-- written yet).
local function check_waiter_keys(script, k)
  local checked = type_check(script)
  for _, check in ipairs({{k.meta, 'hash'}, {k.ended, 'hash'}, {k.waiting, 'hash'}, {k.ready, 'list'},
      {k.wake, 'list'}, {k.dead, 'list'}, {k.stats, 'hash'}, {k.outbox, 'list'}, {k.runs or k.meta, 'hash'}}) do
    local refused = checked(check[1], check[2])
    if refused then return refused end
  end
  local integer = integer_check(script)
  for _, field in ipairs({'dead_lettered', 'released'}) do
    local refused = integer(k.stats, field, redis.call('HGET', k.stats, field))
    if refused then return refused end
  end
  -- The numbers the step reads from the task's hash (its bound of dead letters, how long it is kept, how many
  -- it waits for), which LTRIM, PEXPIRE and the comparison need as integers.
  local values = redis.call('HMGET', k.meta, 'dead_max', 'keep_ms', 'need')
  for n, field in ipairs({'dead_max', 'keep_ms', 'need'}) do
    local refused = integer(k.meta, field, values[n])
    if refused then return refused end
  end
end

-- The end of a waiting task's wait (`state` "released" or "dead", with `reason`): its hash keeps what `flow show`
-- reads, it leaves the waiting hash, and both its hashes expire after `keep_ms`.
local function finish_waiter(k, id, state, reason, keep_ms)
  redis.call('HSET', k.meta, 'state', state)
  if reason then redis.call('HSET', k.meta, 'reason', reason) end
  redis.call('HDEL', k.meta, 'envelope')
  redis.call('HDEL', k.waiting, id)
  redis.call('PEXPIRE', k.meta, keep_ms)
  redis.call('PEXPIRE', k.ended, keep_ms)
  if k.runs then redis.call('PEXPIRE', k.runs, keep_ms) end
end

-- Releases or fails the waiting task of `k` if its recorded outcomes say so; `dead` names a dependency whose
-- outcome just recorded (or found) is dead, with its reason. Returns 'released', 'failed' or 'waiting', or
-- 'recorded' for a task that no longer waits (released, failed, or not written yet).
local function step_waiter(k, now, dead)
  local m = redis.call('HMGET', k.meta, 'state', 'need', 'if_failed', 'envelope', 'up', 'queue', 'id', 'type',
    'dead_max', 'keep_ms')
  if m[1] ~= 'waiting' then return 'recorded' end
  -- Integers, or absent (checked: check_waiter_keys).
  local need, keep_ms = tonumber(m[2] or '0'), tonumber(m[10] or '600000')
  local queue, id = m[6], m[7]
  if dead and m[3] ~= 'continue' then
    local reason = 'dependency ' .. dead.name .. ' ended dead'
    if dead.reason and dead.reason ~= '' then reason = reason .. ': ' .. dead.reason end
    redis.call('LPUSH', k.dead, '{"dead_at":' .. string.format('%d', now) .. ',"queue":' .. cjson.encode(queue) ..
      ',"id":' .. cjson.encode(id) .. ',"type":' .. cjson.encode(m[8]) .. ',"attempt":0,"reason":' ..
      cjson.encode(reason) .. ',"task":' .. cjson.encode(m[4]) .. '}')
    redis.call('LTRIM', k.dead, 0, tonumber(m[9] or '10000') - 1)
    redis.call('HINCRBY', k.stats, 'dead_lettered', 1)
    if m[5] and m[5] ~= '[]' then
      -- Up the graph: its own waiters learn it ended dead, through its queue's outbox (moved as a settle's notes).
      redis.call('RPUSH', k.outbox, '{"to":' .. m[5] .. ',"outcome":{"queue":' .. cjson.encode(queue) .. ',"id":' ..
        cjson.encode(id) .. ',"state":"dead","reason":' .. cjson.encode(reason) .. '}}')
    end
    finish_waiter(k, id, 'dead', reason, keep_ms)
    return 'failed'
  end
  if redis.call('HLEN', k.ended) < need then return 'waiting' end
  -- Every dependency ended: the task joins the back of its ready list with their outcomes as its `after`.
  local all = redis.call('HGETALL', k.ended)
  local outcomes = {}
  for n = 2, #all, 2 do outcomes[#outcomes + 1] = all[n] end
  redis.call('RPUSH', k.ready, '{"after":[' .. table.concat(outcomes, ',') .. '],' .. string.sub(m[4], 2))
  redis.call('LPUSH', k.wake, 1)
  redis.call('LTRIM', k.wake, 0, 0)
  redis.call('HINCRBY', k.stats, 'released', 1)
  finish_waiter(k, id, 'released', nil, keep_ms)
  return 'released'
end
