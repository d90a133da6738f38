-- turns.lua: `priority_weights`' turns between a queue's levels, shared by claim.lua and pop.lua: the broker
-- prepends this file to both (src/broker/mod.rs, `sources`).
--
-- Smooth weighted round-robin (nginx's): for each task a take may still take, every level that has a task left
-- adds its weight to its credit, and the level with the most credit (the higher level on a tie) gets the task and
-- pays the sum of those levels' weights. Over a backlog on every level, each run of sum-of-weights tasks holds
-- each level's weight within one task, and exactly once the backlog has lasted a few tasks (6:3:1 is exact over
-- every 10 from its third: a level that had tasks but lost its turns before brings the credit it earned),
-- interleaved, not in blocks; a level with no task takes no turn and earns no credit, so its turns go to the others (the model
-- checks all three: model/README.md, "The turns"). The credits live in the queue's sched hash (`cur:N` for level
-- N, 1-based), so the shares hold across takes and across daemons. They sum to 0 and stay within the sum of the
-- weights by themselves; each is clamped to it all the same, for a change of the weights (a reload, a rolling
-- change), which would otherwise carry a lead or a debt built under the old ones into the new turns.

-- Defined by `turns_parts`, which a caller runs before its first use of them (priority weights), as the fields of
-- `turns` (`turns.read`, `turns.split`); a second run returns at once: a call without weights creates one closure
-- for this file, not two, and names one upvalue (rate.lua says why).
local turns
local function turns_parts()
  if turns then return end
  local turns_read, turns_split
  -- Reads the credits of `levels` levels from `sched` and checks them (integers, or absent) before any write:
  -- returns them, or nil and the error reply of `script`.
  function turns_read(script, sched, levels, integer)
    local fields = {}
    for level = 1, levels do fields[level] = 'cur:' .. level end
    local values = redis.call('HMGET', sched, unpack(fields))
    local credits = {}
    for level = 1, levels do
      local refused = integer(sched, fields[level], values[level])
      if refused then return nil, refused end
      credits[level] = tonumber(values[level] or '0')
    end
    return credits
  end

  -- How many of at most `max` tasks each level gets, by `weights` (ARGV strings), given the tasks each level has
  -- (`available`); moves the credits on and stores them in `sched`.
  function turns_split(sched, weights, credits, available, max)
    local levels, all = #available, 0
    local want = {}
    for level = 1, levels do
      want[level] = 0
      all = all + tonumber(weights[level])
    end
    for _ = 1, max do
      local total, best = 0, nil
      for level = 1, levels do
        if available[level] > want[level] then
          local weight = tonumber(weights[level])
          total = total + weight
          credits[level] = credits[level] + weight
          if not best or credits[level] > credits[best] then best = level end
        end
      end
      if not best then break end
      credits[best] = credits[best] - total
      want[best] = want[best] + 1
    end
    local stored = {}
    for level = 1, levels do
      credits[level] = math.max(-all, math.min(all, credits[level]))
      stored[#stored + 1] = 'cur:' .. level
      stored[#stored + 1] = credits[level]
    end
    redis.call('HSET', sched, unpack(stored))
    return want
  end
  turns = {read = turns_read, split = turns_split}
end
