-- (The broker prepends `#!lua`, checks.lua and unique_hold.lua: src/broker/mod.rs, `sources`.)
-- dead_requeue.lua: move dead-letter records' tasks back to a ready list, each record atomically (kmqd dead
-- requeue).
--
-- KEYS[1] dead list, KEYS[2] unique hash, KEYS[3] wake list, KEYS[4] stats hash, KEYS[5] the queue's flow
-- outbox (P:{Q}:deps-outbox), KEYS[6 .. 5+L] ready lists
-- ARGV quintuples: the record (its exact bytes, as LRANGE read it), the level to queue the task at (1-based),
-- the task's unique id (or ""), the envelope to queue (the record's task, its attempt reset if asked; a task
-- of a flow with waiters as its next run), the withdrawal note for its waiters ("" for a task without waiters)
-- Returns one integer per record: 1 requeued, 0 not found (the record left the dead list since it was read: a
-- concurrent requeue or purge, or dead_max trimmed it), 2 held (its unique id is held by a live task; the record
-- stays where it is).
--
-- Daemons LPUSH records onto the dead list all the while, so records are addressed by their bytes, never by
-- their index: LREM of the exact value, count -1 (two identical records are two records, removed one per call).
-- Count -1 scans from the tail, where `kmqd dead requeue` reads its pages (src/broker/dead.rs): the record is a
-- few elements from where the scan starts, not a whole list away (count 1 scanned from the head: O(dead_max) per
-- record, seconds of a blocked Redis on a list of millions).
-- The removal and the push are one step: a record is never both requeued and kept, and never lost.
-- The task joins the back of its level, as a new push does; the unique id is taken as push.lua takes it: refused
-- (2) while a task holds it or a unique_for task's window after its end does (UNIQUE_HASH:held:ID), and taken with
-- the window the record carries (`"unique_for": MS`, right after `dead_at`, as settle.lua writes it), so that the
-- requeued run's end holds the id as the first run's did (unique_hold.lua).
-- A task others wait for (a flow's) has its withdrawal pushed onto the HEAD of its queue's outbox in the same
-- step (docs/design/flows.md, "A requeued dependency"): movers read the head first, so a waiter
-- hears of the new run before the dead run's note if that is still in the outbox, and waits for the new run.
-- Checks before it writes: every key's type, the stats hash's `requeued` and every record's level, so that a
-- call that fails ("WRONGTYPE dead_requeue.lua: KEY is a string, not a list") writes nothing.
local dead, uniq, wake, stats, outbox = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local wrong_type = type_check('dead_requeue.lua')
local integer = integer_check('dead_requeue.lua')
local refused = wrong_type(dead, 'list') or wrong_type(uniq, 'hash') or wrong_type(wake, 'list') or
  wrong_type(stats, 'hash') or wrong_type(outbox, 'list')
for i = 6, #KEYS do
  refused = refused or wrong_type(KEYS[i], 'list')
end
refused = refused or integer(stats, 'requeued', redis.call('HGET', stats, 'requeued'))
if refused then return refused end
if #ARGV % 5 ~= 0 then
  return redis.error_reply('dead_requeue.lua: ' .. #ARGV .. ' arguments are not records of 5; nothing was written')
end
for i = 1, #ARGV, 5 do
  local level = tonumber(ARGV[i + 1])
  if level == nil or KEYS[5 + level] == nil or level < 1 then
    return redis.error_reply('dead_requeue.lua: no ready list for level ' .. tostring(ARGV[i + 1]) ..
      '; nothing was written')
  end
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local result, requeued = {}, 0
for i = 1, #ARGV, 5 do
  local record, level, uid, envelope = ARGV[i], tonumber(ARGV[i + 1]), ARGV[i + 2], ARGV[i + 3]
  local ready = KEYS[5 + level]
  local ok = 1
  -- A unique_for task's record carries its window (settle.lua); an id held after a task ended stays held.
  local window = string.match(record, '^{"dead_at":%d+,"unique_for":([1-9]%d*),')
  if window and #window > 12 then window = nil end
  if uid ~= '' and (redis.call('EXISTS', uniq .. ':held:' .. uid) == 1 or
      not take_unique_id(uniq, uid, now, window)) then
    ok = 2
  end
  if ok == 1 and redis.call('LREM', dead, -1, record) == 0 then
    ok = 0
    if uid ~= '' then
      -- Taken above for a record that is gone: give it back.
      redis.call('HDEL', uniq, uid)
    end
  end
  if ok == 1 then
    redis.call('RPUSH', ready, envelope)
    if ARGV[i + 4] ~= '' then redis.call('LPUSH', outbox, ARGV[i + 4]) end
    requeued = requeued + 1
  end
  result[#result + 1] = ok
end
if requeued > 0 then
  redis.call('HINCRBY', stats, 'requeued', requeued)
  -- One marker wakes one idle fetcher, as push.lua's does.
  redis.call('LPUSH', wake, 1)
  redis.call('LTRIM', wake, 0, 0)
end
return result
