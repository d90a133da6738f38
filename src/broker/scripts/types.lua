-- types.lua: a queue's limits per task type (`[[queues.limits]]`), prepended to claim.lua and pop.lua after
-- rate.lua and turns.lua (src/broker/mod.rs, `sources`).
--
-- Flows. A task of a limited type that a claim meets while its type's limits hold it back is moved out of the
-- ready list into its type's *flow* at that level (`flow:LEVEL::TYPE`, a list, oldest first), so that it never
-- blocks the tasks behind it; the claims take from the flows that their types admit before they take from the
-- ready list. Each level's *ring* (`ring:LEVEL`, a zset) names the flows that may hold tasks (member `:TYPE`,
-- the type percent-encoded as keys.rs does; score: the ms it was added), for the claims of daemons whose config
-- no longer limits that type (they drain such a flow as unlimited) and for the readers (stats, task lookup).
-- Every other task stays in the ready list, where a queue without type limits keeps all of them: the readers and
-- the plain claim see no difference.
--
-- Routing is exact and cheap: a payload is decoded (cjson) only when its bytes contain a limited type's name, or a
-- backslash (an escape could spell it); its type is the envelope's `type`, or, for a foreign payload (no `type`),
-- the queue's `foreign_type_field`, as the daemon reads it (task.rs). Anything else, a payload that does not
-- decode included, is of no limited type: the daemon then does with it what it does today.
--
-- The block, after claim.lua's own arguments: ARGV[at] F, the flows (0: none, and no keys), ARGV[at+1] the
-- foreign type field ("" for none), then per flow: its type (as the envelope spells it), its ring member, its
-- running scope (`t:TYPE`), its max_running (0: none), R, then R pairs (window ms, most starts); a flow with no
-- limit is an *orphan*, a flow another config made, drained unlimited and never routed to. KEYS from `first`:
-- the rings (one per level), then per flow its lists (one per level), its throttle (`throttle:t:TYPE`, set by
-- settle.lua when a handler throttles a task of the type: none of its tasks is taken while it lives), then its R
-- windows' logs and sums.

-- The size of the block at ARGV[at]: its flows' count, the keys it adds besides the rings and the flows' lists (a
-- throttle and two keys a window per flow), and the index of the argument that follows it.
local function types_size(at)
  -- (No flows, the common case, read without `tonumber`, whose call costs Redis six times the comparison.)
  local flows, keys, next_at = ARGV[at] ~= '0' and tonumber(ARGV[at]) or 0, 0, at + 2
  for _ = 1, flows do
    local r = tonumber(ARGV[next_at + 4]) or 0
    keys, next_at = keys + 1 + 2 * r, next_at + 5 + 2 * r
  end
  return flows, keys, next_at
end

-- Defined by `types_parts` (with rate.lua's, which they use), which a caller runs before its first use of them (type
-- limits, groups), as the fields of `types` (`types.read` is `types_read`); a second run returns at once: a call
-- with neither creates one closure for these, not nine, and names one upvalue (rate.lua says why). `types_size`
-- stays outside: every call reads its arguments' layout with it.
local types
local function types_parts()
  if types then return end
  local types_read, types_admit, types_write, types_route, types_again, scopes_spend, types_admit_one, types_take,
    types_held
  rate_parts()
  local rate_read, rate_scan, rate_drop, throttle_until, rate_spend =
    rate.read, rate.scan, rate.drop, rate.throttle_until, rate.spend
  -- Reads the block at ARGV[at] for `levels` levels (KEYS from `first`), checking every key's type and every value
  -- it will rely on (running counts, rate logs) before any write. Returns the flows (possibly none), or nil and the
  -- error reply of `script`.
  function types_read(script, at, first, levels, running, integer)
    local count = tonumber(ARGV[at]) or 0
    local block = {flows = {}, kinds = {}, rings = {}, foreign = ARGV[at + 1] or ''}
    if count == 0 then return block end
    local wrong = type_check(script)
    for level = 1, levels do
      block.rings[level] = KEYS[first + level - 1]
      local refused = wrong(block.rings[level], 'zset')
      if refused then return nil, refused end
    end
    local arg, key = at + 2, first + levels
    for f = 1, count do
      local flow = {kind = ARGV[arg], member = ARGV[arg + 1], scope = ARGV[arg + 2],
        max_running = tonumber(ARGV[arg + 3]), rates = tonumber(ARGV[arg + 4]), lists = {}, running = 0, taken = 0}
      for level = 1, levels do
        flow.lists[level] = KEYS[key + level - 1]
        local refused = wrong(flow.lists[level], 'list')
        if refused then return nil, refused end
      end
      key = key + levels
      flow.throttle = KEYS[key]
      local refused = wrong(flow.throttle, 'string')
      if refused then return nil, refused end
      key = key + 1
      for r = 0, flow.rates - 1 do
        local refused = wrong(KEYS[key + 2 * r], 'list') or wrong(KEYS[key + 2 * r + 1], 'string')
        if refused then return nil, refused end
      end
      local windows, refused = rate_read(script, flow.rates, key, arg + 5, integer)
      if refused then return nil, refused end
      flow.windows = windows
      key = key + 2 * flow.rates
      arg = arg + 5 + 2 * flow.rates
      if flow.max_running > 0 then
        local value = redis.call('HMGET', running, flow.scope, flow.scope .. ':limit')
        refused = integer(running, flow.scope, value[1]) or integer(running, flow.scope .. ':limit', value[2])
        if refused then return nil, refused end
        flow.running, flow.known_limit = tonumber(value[1] or '0'), tonumber(value[2] or '0')
      end
      flow.limited = flow.max_running > 0 or flow.rates > 0
      if flow.limited then block.kinds[flow.kind] = flow end
      block.flows[f] = flow
    end
    return block
  end

  -- How many more tasks each flow's limits admit now (`flow.room`; nil: no bound), trimming its rate logs first;
  -- records when a full flow may go on (`flow.due`: ms, or 0 for "when a running slot frees") and writes each
  -- counted flow's `SCOPE:limit`. A throttled type admits nothing until its throttle's time to live runs out (a
  -- throttle set by hand without an expiry: looked at again in a second, as the queue's). Returns nil, or the error
  -- reply of a rate log that does not parse. With `defer`, it writes nothing: `types_write` does, once the caller's
  -- other checks are done (claim.lua's groups' come after it).
  function types_admit(script, block, running, now, defer)
    for _, flow in ipairs(block.flows) do
      flow.room, flow.due = nil, nil
      local ends = flow.limited and throttle_until(flow.throttle, now)
      if ends then flow.room, flow.due = 0, ends end
      if flow.max_running > 0 then
        flow.note = flow.known_limit ~= flow.max_running
        if flow.note and not defer then
          redis.call('HSET', running, flow.scope .. ':limit', flow.max_running)
          flow.note = false
        end
        if flow.room ~= 0 then
          flow.room = math.max(0, flow.max_running - flow.running)
          if flow.room == 0 then flow.due = 0 end
        end
      end
      if flow.rates > 0 and flow.room ~= 0 then
        local free, due, bad = rate_scan(script, flow.windows, now)
        if bad then return bad end
        if not defer then rate_drop(flow.windows) end
        if due > 0 then
          flow.room, flow.due = 0, due
        elseif free and (not flow.room or free < flow.room) then
          flow.room = free
        end
      end
    end
  end

  -- What a deferred `types_admit` did not write: each counted flow's `SCOPE:limit`, and its rate logs' aged-out
  -- entries taken off.
  function types_write(block, running)
    for _, flow in ipairs(block.flows) do
      if flow.note then
        redis.call('HSET', running, flow.scope .. ':limit', flow.max_running)
        flow.note = false
      end
      if flow.windows then rate_drop(flow.windows) end
    end
  end

  -- The flow a payload belongs to, or nil (no limited type).
  function types_route(block, payload)
    local hit = string.find(payload, '\\', 1, true)
    if not hit then
      for kind in pairs(block.kinds) do
        if string.find(payload, kind, 1, true) then
          hit = true
          break
        end
      end
    end
    if not hit then return nil end
    local ok, task = pcall(cjson.decode, payload)
    if not ok or type(task) ~= 'table' then return nil end
    local kind = task.type
    if kind == nil and block.foreign ~= '' then kind = task[block.foreign] end
    if type(kind) ~= 'string' then return nil end
    return block.kinds[kind], task
  end

  -- Whether a task (decoded) came back to the ready list's head, a retry or a recovery, and so goes to the head of
  -- its flow, as due retries go to the front of the ready list.
  function types_again(task)
    return (tonumber(task.attempt) or 0) > 0 or (tonumber(task.recovered) or 0) > 0
  end

  -- Adds what each of `scopes` (a type's flow, or a group: groups.lua) took this claim (`taken`) to its counts: its
  -- running scope and its rate logs.
  function scopes_spend(scopes, running, now)
    for _, scope in ipairs(scopes) do
      if scope.taken > 0 then
        if scope.max_running > 0 then redis.call('HINCRBY', running, scope.scope, scope.taken) end
        if scope.rates > 0 then rate_spend(scope.windows, scope.taken, now) end
      end
    end
  end

  -- Whether a flow's limits admit one more task (no flow: a task of no limited type), then counts it as admitted.
  function types_admit_one(flow)
    if not flow or flow.room == nil then return true end
    if flow.room <= 0 then return false end
    flow.room = flow.room - 1
    return true
  end

  -- A level's take with type limits (claim.lua's and pop.lua's), up to `take` tasks, each given to `add(flow,
  -- payload)` (flow nil: of no limited type): first from the flows their limits admit (they hold their types' oldest
  -- tasks), then from the head of each of `lists` in order, where a task of a type its limits hold back is moved to
  -- its type's flow at `level` (a retry or a recovery to the flow's head, as due retries go to the front of the ready
  -- list; the others to its tail), looking at no more than `scan` tasks of the lists, so that a take's work is
  -- bounded whatever they hold. A flow that emptied leaves the level's ring; one that took tasks enters it. Returns
  -- how many it took.
  function types_take(block, level, lists, take, scan, add)
    local got = 0
    for _, flow in ipairs(block.flows) do
      local m = take - got
      if flow.room and flow.room < m then m = flow.room end
      if m > 0 then
        local items = redis.call('LPOP', flow.lists[level], m) or {}
        for _, payload in ipairs(items) do add(flow, payload) end
        got = got + #items
        if flow.room then flow.room = flow.room - #items end
        if #items < m then redis.call('ZREM', block.rings[level], flow.member) end
      elseif flow.room == 0 and redis.call('LLEN', flow.lists[level]) > 0 then
        flow.held = true
      end
    end
    local heads, tails, scanned = {}, {}, 0
    for _, list in ipairs(lists) do
      while got < take and scanned < scan do
        local items = redis.call('LPOP', list, math.min(take - got, scan - scanned))
        if not items then break end
        scanned = scanned + #items
        for _, payload in ipairs(items) do
          local flow, task = types_route(block, payload)
          if types_admit_one(flow) then
            add(flow, payload)
            got = got + 1
          else
            flow.held = true
            local to = tails
            if types_again(task) then to = heads end
            to[flow] = to[flow] or {}
            table.insert(to[flow], payload)
          end
        end
      end
    end
    for _, flow in ipairs(block.flows) do
      local moved = false
      if heads[flow] then
        local list = heads[flow]
        for k = #list, 1, -1 do redis.call('LPUSH', flow.lists[level], list[k]) end
        moved = true
      end
      if tails[flow] then
        local list = tails[flow]
        for k = 1, #list, 1000 do
          redis.call('RPUSH', flow.lists[level], unpack(list, k, math.min(k + 999, #list)))
        end
        moved = true
      end
      -- Scored 0: a grouped claim's ring (groups.lua) then serves it at its next turn, a type's ring ignores it.
      if moved then redis.call('ZADD', block.rings[level], 'NX', 0, flow.member) end
    end
    return got
  end

  -- When nothing was taken though tasks wait, because their types' limits hold them back (claim.lua's and pop.lua's
  -- state 7): whether any flow was held back, and when the earliest of their limits lets one go (0: only a running
  -- slot, which a settle's wake-up marker announces).
  function types_held(block)
    local any, at = false, 0
    for _, flow in ipairs(block.flows) do
      if flow.held then
        local due = flow.due or 0
        any = true
        if due > 0 and (at == 0 or due < at) then at = due end
      end
    end
    return any, at
  end
  types = {read = types_read, admit = types_admit, write = types_write, route = types_route, again = types_again,
    scopes_spend = scopes_spend, admit_one = types_admit_one, take = types_take, held = types_held}
end
