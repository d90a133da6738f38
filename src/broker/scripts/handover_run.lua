-- handover_run.lua, inside `handover_parts` after claim.lua and its preludes (src/broker/mod.rs, `sources`): the
-- claim of the slot handed over in the settle (handover.lua says how), returned to settle.lua as a table.

-- What claim.lua's checks found (`claim_run`'s `checked`), for a plain claim: the claim after the settle's writes
-- uses it, when those were only acknowledgements, rather than looking again (some 50,000 instructions).
local checked = false

-- claim.lua's checks, before the settle's first write: nil when they pass, else the error (which the settle
-- returns, having written nothing). `given`: what the settle's checks found (claim.lua's `given`).
local function handover_check(given)
  local refused
  refused, checked = claim_run(true, nil, given)
  if refused then
    -- Named for the script the caller ran as well as for the claim whose check refused it.
    return redis.error_reply((string.gsub(refused.err, 'claim%.lua: ', 'settle.lua (its claim.lua): ', 1)))
  end
end

-- The claim's reply when it took nothing for the slot: it freed none, or the claim was refused (state -1).
local function handover_none(levels)
  local reply = {0, -1, 0}
  for i = 1, levels do reply[3 + i] = 0 end
  reply[#reply + 1], reply[#reply + 2], reply[#reply + 3] = 0, 0, 0
  return reply
end

-- Claims the next tasks for the slots this call freed (`freed`: scope -> tasks subtracted). Returns claim.lua's
-- reply, and whether it filled every slot freed (then no marker is pushed for them). `acks_only`: the settle wrote
-- nothing but acknowledgements (no record: nothing queued again, quarantined, dead-lettered or throttled), so what
-- the checks found still holds for the claim's keys but the claim sets and the running hash. `given`: what the
-- settle knows of the running count after its writes, and its time (claim.lua's `given`).
local function handover_run(h, freed, levels, acks_only, given)
  local slots = freed.q or 0
  if slots == 0 then
    for scope, n in pairs(freed) do
      if string.sub(scope, 1, 2) == 't:' and n > slots then slots = n end
    end
  end
  if slots == 0 then return handover_none(levels), false end
  -- ARGV here is the claim's own, h.args (`handover_parts`' parameter): its number of tasks, cut to the slots.
  h.args[2] = tostring(math.min(h.want, slots))
  local reply = claim_run(false, acks_only and checked or nil, given)
  if reply.err then return handover_none(levels), false end
  local took = 0
  for i = 1, levels do took = took + reply[3 + i] end
  return reply, took >= slots
end
return {check = handover_check, run = handover_run, none = handover_none}
