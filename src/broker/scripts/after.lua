-- after.lua: the notes a settle writes for the tasks that wait for the ones it ends (docs/design/flows.md),
-- prepended to settle.lua (src/broker/mod.rs, `sources`) beside results.lua, so that settle.lua itself changes by
-- a few lines.
--
-- A call that ends tasks with waiters (their envelope's `waiters`, written by `kmqd flow push`) carries a trailer
-- between settle.lua's own arguments and results.lua's trailer: ARGV has N triples (the task's place in the call,
-- in results.lua's two numbers: 0 and N for the call's Nth record, K and P for the plain acknowledgement of
-- position P of the call's Kth claim; the note, a JSON object `{"to": [...], "outcome": {...}}` the daemon
-- built), then N and the word "notes"; KEYS has
-- the queue's outbox (`P:{Q}:deps-outbox`, in the queue's slot) last, before the result keys. A call without
-- notes has no trailer and pays one comparison.
--
-- `take_notes` takes the trailer off ARGV and KEYS once `take_kept` took results.lua's, and checks the outbox's
-- type before anything is written. `note` (a record) and `note_claim` (a claim's acknowledgements) write a note
-- only when its task's settlement applies, on the very condition results.lua's `keep` and `keep_claim` write a
-- result: so a task's end is noted exactly once, in the step that ends it, and never by a daemon that no longer
-- holds the task (a stale settle) nor by a settle sent again after a lost reply (settle.lua, "Calls": the stored
-- answer is returned before anything is applied). The notes are appended (RPUSH: the movers read the oldest
-- first), in the call's order, by `write_notes` once every record applied (as results.lua's write_kept: an RPUSH
-- a thousand notes, not one a note), and the queue's delay poller, which moves them, is woken once a call.
local function take_notes()
  local notes = {records = {}, claims = {}, outbox = false, written = 0, pending = {}}
  if ARGV[#ARGV] ~= 'notes' then return notes end
  local count = tonumber(ARGV[#ARGV - 1])
  if not count or count < 0 or #ARGV < 2 + 3 * count or #KEYS < 1 then
    return nil, redis.error_reply('settle.lua: notes trailer of ' .. tostring(ARGV[#ARGV - 1]) ..
      '; nothing was applied')
  end
  local first_arg = #ARGV - 2 - 3 * count
  notes.outbox = KEYS[#KEYS]
  local found = redis.call('TYPE', notes.outbox).ok
  if found ~= 'none' and found ~= 'list' then
    return nil, redis.error_reply('WRONGTYPE settle.lua: ' .. notes.outbox .. ' is a ' .. found .. ', not a list; ' ..
      'nothing was applied')
  end
  for n = 1, count do
    local at = first_arg + 3 * (n - 1)
    local claim, place, value = tonumber(ARGV[at + 1]), tonumber(ARGV[at + 2]), ARGV[at + 3]
    if not claim or not place or string.sub(value, 1, 1) ~= '{' then
      return nil, redis.error_reply('settle.lua: note ' .. n .. ' (' .. ARGV[at + 1] .. ', ' .. ARGV[at + 2] ..
        ') is not a place and a JSON object; nothing was applied')
    end
    if claim == 0 then
      notes.records[place] = value
    else
      -- Flat (a position, then its note), not a table a note: a fan-in's settle takes a thousand.
      local list = notes.claims[claim]
      if not list then
        list = {}
        notes.claims[claim] = list
      end
      list[#list + 1] = place
      list[#list + 1] = value
    end
  end
  for n = #ARGV, first_arg + 1, -1 do ARGV[n] = nil end
  KEYS[#KEYS] = nil
  return notes
end

-- The note of the call's record number `record`, if any: called once the record applied and ended its task.
local function note(notes, record)
  local value = notes.records[record]
  if value then
    notes.written = notes.written + 1
    notes.pending[notes.written] = value
  end
end

-- The notes of the plain acknowledgements of the call's claim `k`, before its bitmap is merged (its value before
-- this call is `old`, false for none, as settle.lua fetched it): each position whose bit this call sets, read from
-- `old` as results.lua's keep_claim reads it (bit p is bit 7 - p % 8 of byte p / 8, GETBIT's order), not asked of
-- Redis a command each.
local function note_claim(notes, k, old)
  local list = notes.claims[k]
  if not list then return end
  for n = 1, #list, 2 do
    local position = list[n]
    local byte = old and string.byte(old, math.floor(position / 8) + 1)
    if not byte or bit.band(byte, bit.rshift(128, position % 8)) == 0 then
      notes.written = notes.written + 1
      notes.pending[notes.written] = list[n + 1]
    end
  end
end

-- Appends the notes `note` and `note_claim` took, in their order, a thousand an RPUSH (under Lua's limit of
-- arguments to unpack). Called once every record of the call applied and before the call is stored (settle.lua),
-- as write_kept is: a call that applied has written its notes.
local function write_notes(notes)
  for first = 1, notes.written, 1000 do
    redis.call('RPUSH', notes.outbox, unpack(notes.pending, first, math.min(first + 999, notes.written)))
  end
end

-- Wakes the queue's delay poller, which moves the notes, once for the call.
local function notes_written(notes, channel, now)
  if notes.written > 0 then redis.call('PUBLISH', channel, now) end
end
