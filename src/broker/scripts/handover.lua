-- handover.lua, before settle.lua (src/broker/mod.rs, `sources`): the slot handed over in the settle
-- (docs/design/flow-control.md, "The slot handed over in the settle"). Its trailer is read here; the claim's parts
-- (claim.lua with its preludes, and handover_run.lua) are inside `handover_parts(KEYS, ARGV)`, which only a settle
-- that carries the trailer calls: every other settle creates one closure for them, not one for each of their top
-- level's `local function`s (Lua creates one for each as the script's top level runs, on every call). Its
-- parameters, the claim's own KEYS and ARGV (the trailer's), shadow the globals for every line of those parts, so
-- that they read the claim's tables as claim.lua reads its own, with nothing copied into the globals and back (a
-- copy cost some 67,000 instructions a call).
--
-- At `max_running`, a slot's cycle is its task's run plus the turnaround from the settle that frees it to the claim
-- that fills it: a wake-up marker, the fetcher's BLPOP served, a claim, its reply. A settle by the owner of a queue
-- with `max_running` or type limits may carry a claim block, its last trailer:
--   ARGV: ..., claim.lua's ARGV (its ARGV[2]: how many tasks the settling daemon has workers free for; its ARGV[7]
--         the claim's number, reserved from the owner's claim numbers), their count A, the count K of its keys,
--         'handover'
--   KEYS: ..., claim.lua's KEYS (after results.lua's, the last)
-- The settle takes it off ARGV and KEYS before anything reads them (so settle.lua reads its arguments as it always
-- has), runs claim.lua's checks of its keys' types and counters before its own first write (claim.lua's `dry` run:
-- a call that fails writes nothing), and once it has subtracted the tasks it ends, runs claim.lua itself for as
-- many tasks as the call freed slots of a limit (the queue's, else the largest of its types'), at most the daemon's
-- number: the slot passes from the ended task to the next in one step, under the limit read after the subtraction,
-- with no marker (settle.lua pushes its marker only when the claim did not fill what the call freed). The claim is
-- claim.lua's own (turns, groups, type and rate limits, lease, floor, quarantine), and its reply (6 + L integers)
-- follows the settle's in the reply and in the stored call: a call sent again after a lost reply answers the
-- same claim and claims nothing more; the caller reads the claim's lists in the same transaction, as a claim's.
-- A claim refused after the checks (LEASELOST: an owner whose lease ran out; FENCED) writes nothing: the settle
-- stands, and the reply's claim says state -1, nothing taken (the fetcher's own claim then reports the refusal).

-- Takes the claim block off ARGV and KEYS: false without one, nil and an error for a block that does not parse.
local function take_handover()
  if ARGV[#ARGV] ~= 'handover' then return false end
  local nargs, nkeys = tonumber(ARGV[#ARGV - 2]), tonumber(ARGV[#ARGV - 1])
  if not nargs or not nkeys or nargs < 10 or nkeys < 9 or #ARGV < nargs + 3 or #KEYS < nkeys then
    return nil, redis.error_reply('settle.lua: handover trailer of ' .. tostring(ARGV[#ARGV - 2]) ..
      ' arguments and ' .. tostring(ARGV[#ARGV - 1]) .. ' keys; nothing was applied')
  end
  local first_arg, first_key = #ARGV - 2 - nargs, #KEYS - nkeys + 1
  -- Copied with `unpack` into table constructors (in C, not one Lua step an element: Redis's Lua runs a step in
  -- some 50-100 machine instructions, docs/PERFORMANCE.md, "Where a slot's turnaround goes, stage by stage").
  local h = {keys = {unpack(KEYS, first_key, first_key + nkeys - 1)},
    args = {unpack(ARGV, first_arg, first_arg + nargs - 1)}}
  for i = #ARGV, first_arg, -1 do ARGV[i] = nil end
  for i = #KEYS, first_key, -1 do KEYS[i] = nil end
  h.want = tonumber(h.args[2])
  if not h.want or h.want < 1 or h.want ~= math.floor(h.want) then
    return nil, redis.error_reply('settle.lua: handover of ' .. h.args[2] .. ' tasks, not a whole number above ' ..
      '0; nothing was applied')
  end
  return h
end

