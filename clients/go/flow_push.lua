-- (The broker prepends checks.lua and deps.lua: src/broker/mod.rs, `sources`.)
-- flow_push.lua: write the waiting tasks of one queue that a flow holds (`kmqd flow push`: docs/design/flows.md),
-- all or nothing, before any task they wait for is pushed. A waiting task is in no list a claim reads: it is its
-- hash, until flow_apply.lua releases it.
--
-- KEYS[1] the queue's waiting hash P:{Q}:deps-waiting, KEYS[2] wake list, KEYS[3] dead list, KEYS[4] stats hash,
-- KEYS[5] the queue's outbox (P:{Q}:deps-outbox); then for each task 3 keys: its hash P:{Q}:deps:ID, its ended hash, its ready list
-- ARGV[1] the queue's name, ARGV[2] its dead_max, ARGV[3] how long a finished task's hashes are kept (ms)
-- then for each task 7: id, type, envelope (a JSON object), if_failed ("fail" or "continue"), how many tasks
-- it waits for, its dependencies (JSON [[queue, id], ...], for `flow show`), its waiters (JSON [{"queue","id"}])
-- A task whose hash exists is left as it is (a file pushed again after a failure): 'exists'. A new one is
-- written as waiting, then stepped on what its ended hash may already hold (never, when the flow's tasks are
-- pushed after their waiters, as `kmqd flow push` does). Returns, per task, 'exists', 'waiting', 'released' or
-- 'failed'.
local tasks = (#KEYS - 5) / 3
if tasks ~= math.floor(tasks) or #ARGV ~= 3 + 7 * tasks then
  return redis.error_reply('ERR flow_push.lua: ' .. #KEYS .. ' keys and ' .. #ARGV .. ' arguments do not make ' ..
    'whole tasks; nothing was written')
end
if not tonumber(ARGV[2]) or not tonumber(ARGV[3]) then
  return redis.error_reply('ERR flow_push.lua: dead_max ' .. ARGV[2] .. ' or expiry ' .. ARGV[3] .. ' is not a ' ..
    'number; nothing was written')
end
local checks = {}
for n = 1, tasks do
  local k = waiter_keys(KEYS[3 + 3 * n], KEYS[4 + 3 * n], KEYS[1], KEYS[5 + 3 * n], KEYS[2], KEYS[3], KEYS[4], KEYS[5])
  local refused = check_waiter_keys('flow_push.lua', k)
  if refused then return refused end
  local at = 3 + 7 * (n - 1)
  if string.sub(ARGV[at + 3], 1, 1) ~= '{' or not tonumber(ARGV[at + 5]) or
      (ARGV[at + 4] ~= 'fail' and ARGV[at + 4] ~= 'continue') then
    return redis.error_reply('ERR flow_push.lua: task ' .. ARGV[at + 1] .. ' is not an envelope, a count and ' ..
      'fail or continue; nothing was written')
  end
  checks[n] = k
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local result = {}
for n = 1, tasks do
  local k, at = checks[n], 3 + 7 * (n - 1)
  if redis.call('EXISTS', k.meta) == 1 then
    result[n] = 'exists'
  else
    local id = ARGV[at + 1]
    redis.call('HSET', k.meta, 'queue', ARGV[1], 'id', id, 'type', ARGV[at + 2], 'envelope', ARGV[at + 3],
      'ready', k.ready, 'if_failed', ARGV[at + 4], 'need', ARGV[at + 5], 'deps', ARGV[at + 6], 'up', ARGV[at + 7],
      'dead_max', ARGV[2], 'keep_ms', ARGV[3], 'state', 'waiting')
    redis.call('HSET', k.waiting, id, now)
    -- What already ended (a push again after a failure): its first dead outcome under `fail` fails it.
    local dead = false
    local all = redis.call('HGETALL', k.ended)
    for e = 1, #all, 2 do
      if not dead and string.find(all[e + 1], '"state":"dead"', 1, true) then
        dead = {name = string.gsub(all[e], '\n', '/', 1), reason = ''}
      end
    end
    result[n] = step_waiter(k, now, dead)
  end
end
return result
