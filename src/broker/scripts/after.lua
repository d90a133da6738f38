-- after.lua: the notes a settle writes for the tasks that wait for the ones it ends (docs/design/flows.md),
-- prepended to settle.lua (src/broker/mod.rs, `sources`) beside results.lua, so that settle.lua itself changes by
-- a few lines.
--
-- A call that ends tasks with waiters (their envelope's `waiters`, written by `kmqd flow push`) carries a trailer
-- between settle.lua's own arguments and results.lua's trailer: ARGV has groups of the call's tasks with the same
-- waiters and run, each its waiters (the JSON array, as the envelopes have it), its run, its count C, then C
-- triples (the task's place in the call, in results.lua's two numbers: 0 and N for the call's Nth record, K and
-- P for the plain acknowledgement of position P of the call's Kth claim; its outcome, a JSON object
-- `{"queue", "id", "state", ...}` the daemon built); then how many arguments the groups take and the word
-- "notes". KEYS has the queue's outbox (`P:{Q}:deps-outbox`, in the queue's slot) last, before the result keys.
-- A call without notes has no trailer and pays one comparison.
--
-- A group's outcomes that applied make one note, `{"to": WAITERS, "run": RUN, "outcomes": [OUTCOME, ...]}`
-- (`run` left out while it is 0): a fan-in's settle of a thousand parts writes one list element, which a mover
-- reads, parses and removes as one, and applies as it would a note an outcome (flow_apply.lua records which
-- dependencies ended, each by its own field, so a note of many is as exact as many notes).
--
-- `take_notes` takes the trailer off ARGV and KEYS once `take_kept` took results.lua's, and checks the outbox's
-- type before anything is written. `note` (a record) and `note_claim` (a claim's acknowledgements) write a note
-- only when its task's settlement applies, on the very condition results.lua's `keep` and `keep_claim` write a
-- result: so a task's end is noted exactly once, in the step that ends it, and never by a daemon that no longer
-- holds the task (a stale settle) nor by a settle sent again after a lost reply (settle.lua, "Calls": the stored
-- answer is returned before anything is applied). The notes are appended (RPUSH: the movers read the oldest
-- first), a group's in the order of the call, by `write_notes` once every record applied (as results.lua's
-- write_kept), and the queue's delay poller, which moves them, is woken once a call.
local function take_notes()
  local notes = {records = {}, claims = {}, outbox = false, groups = {}, written = 0}
  if ARGV[#ARGV] ~= 'notes' then return notes end
  local args = tonumber(ARGV[#ARGV - 1])
  if not args or args < 0 or #ARGV < 2 + args or #KEYS < 1 then
    return nil, redis.error_reply('settle.lua: notes trailer of ' .. tostring(ARGV[#ARGV - 1]) ..
      ' arguments; nothing was applied')
  end
  local first_arg = #ARGV - 2 - args
  notes.outbox = KEYS[#KEYS]
  local found = redis.call('TYPE', notes.outbox).ok
  if found ~= 'none' and found ~= 'list' then
    return nil, redis.error_reply('WRONGTYPE settle.lua: ' .. notes.outbox .. ' is a ' .. found .. ', not a list; ' ..
      'nothing was applied')
  end
  local at, last = first_arg + 1, #ARGV - 2
  while at <= last do
    local to, run, count = ARGV[at], ARGV[at + 1], tonumber(ARGV[at + 2])
    if string.sub(to, 1, 1) ~= '[' or not string.match(run, '^%d+$') or not count or count < 1 or
        at + 2 + 3 * count > last then
      return nil, redis.error_reply('settle.lua: notes group ' .. (#notes.groups + 1) .. ' (' .. to .. ', ' ..
        run .. ', ' .. ARGV[at + 2] .. ') is not waiters, a run and a count within the trailer; nothing was applied')
    end
    -- A group's outcomes that applied, in `out`; its note's JSON around them is made once, by write_notes.
    local group = {to = to, run = run, out = {}}
    notes.groups[#notes.groups + 1] = group
    for n = at + 3, at + 3 * count, 3 do
      local claim, place, value = tonumber(ARGV[n]), tonumber(ARGV[n + 1]), ARGV[n + 2]
      if not claim or not place or string.sub(value, 1, 1) ~= '{' then
        return nil, redis.error_reply('settle.lua: note (' .. ARGV[n] .. ', ' .. ARGV[n + 1] ..
          ') is not a place and a JSON object; nothing was applied')
      end
      if claim == 0 then
        notes.records[place] = value
        notes.records[-place] = group
      else
        -- Flat (a position, its outcome, its group), not a table a note: a fan-in's settle takes a thousand.
        local list = notes.claims[claim]
        if not list then
          list = {}
          notes.claims[claim] = list
        end
        list[#list + 1] = place
        list[#list + 1] = value
        list[#list + 1] = group
      end
    end
    at = at + 3 + 3 * count
  end
  for n = #ARGV, first_arg + 1, -1 do ARGV[n] = nil end
  KEYS[#KEYS] = nil
  return notes
end

-- The outcome of the call's record number `record`, if any, into its group's note: called once the record
-- applied and ended its task. (A record's group is at `-record`: records are numbered from 1.)
local function note(notes, record)
  local value = notes.records[record]
  if value then
    local out = notes.records[-record].out
    out[#out + 1] = value
  end
end

-- The outcomes of the plain acknowledgements of the call's claim `k`, before its bitmap is merged (its value before
-- this call is `old`, false for none, as settle.lua fetched it), into their groups' notes: each position whose
-- bit this call sets, read from `old` as results.lua's keep_claim reads it (bit p is bit 7 - p % 8 of byte p / 8,
-- GETBIT's order), not asked of Redis a command each.
local function note_claim(notes, k, old)
  local list = notes.claims[k]
  if not list then return end
  for n = 1, #list, 3 do
    local position = list[n]
    local byte = old and string.byte(old, math.floor(position / 8) + 1)
    if not byte or bit.band(byte, bit.rshift(128, position % 8)) == 0 then
      local out = list[n + 2].out
      out[#out + 1] = list[n + 1]
    end
  end
end

-- Appends a note a group whose outcomes applied, in the groups' order, with one RPUSH a thousand notes (under
-- Lua's limit of arguments to unpack). Called once every record of the call applied and before the call is
-- stored (settle.lua), as write_kept is: a call that applied has written its notes.
local function write_notes(notes)
  local pending = {}
  for _, group in ipairs(notes.groups) do
    if #group.out > 0 then
      local run = ''
      if group.run ~= '0' then run = ',"run":' .. group.run end
      pending[#pending + 1] = '{"to":' .. group.to .. run .. ',"outcomes":[' .. table.concat(group.out, ',') .. ']}'
    end
  end
  notes.written = #pending
  for first = 1, #pending, 1000 do
    redis.call('RPUSH', notes.outbox, unpack(pending, first, math.min(first + 999, #pending)))
  end
end

-- Wakes the queue's delay poller, which moves the notes, once for the call.
local function notes_written(notes, channel, now)
  if notes.written > 0 then redis.call('PUBLISH', channel, now) end
end
