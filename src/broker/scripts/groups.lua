-- groups.lua: fair groups (`[queues.groups]`), prepended to claim.lua after types.lua (src/broker/mod.rs,
-- `sources`); its first part, the names and the bands, is also settle.lua's and push.lua's (each keeps a copy of
-- what it needs: push.lua is run by producers as a file).
--
-- Flows and the ring. A grouped queue keeps its waiting tasks in *flows*, one list per level and group
-- (`flow:LEVEL:GROUP:`, the group percent-encoded as keys.rs does, `GROUP:` being the flow's *member*; tasks without
-- a group are the group with the empty name, member `:`), oldest first. Each level's ring (`ring:LEVEL`, a zset)
-- names every flow of the level that holds tasks, scored by one of three bands:
--   below TIMED (1e15): the flow's *pass*, its virtual time in stride scheduling: a claim serves the lowest passes
--     first, and a turn of m tasks adds m / weight to it, so that over any backlog each group gets turns in
--     proportion to its weight (`[queues.groups] weights`, default 1), its tasks in FIFO order. A flow that comes
--     (back) into the ring starts at the level's virtual time (`vt:LEVEL` in the sched hash, the pass last
--     served), so a group earns no credit while it has nothing waiting;
--   TIMED + ms: a throttled group's flow, or one whose rate windows are full, until that time (Redis's clock);
--     every claim first moves the flows whose time came back to the level's virtual time;
--   PARKED + ms: a paused group's flow, or one whose group is at its `max_running` (since ms): the settle that
--     frees one of the group's slots, and `kmqd group resume`, move it back.
-- A claim reads only the lowest passes (`ZRANGEBYSCORE ... LIMIT`), so a group held back by its limits costs a
-- claim nothing after the claim that parked it: O(log n) a claim, whatever the number of groups. A group exists
-- in Redis only while it holds tasks, runs some (its `g:GROUP` count), is throttled or rate-limited (keys with a
-- time to live) or paused (`hold:g:GROUP`): an idle group costs nothing.
--
-- Type limits beside groups (`[[queues.limits]]` on a grouped queue). A group's tasks of a limited type wait in a
-- flow of their own, `flow:LEVEL:GROUP:TYPE` (member `GROUP:TYPE`; the group's other tasks stay in `GROUP:`), so
-- that a type its limits hold back never blocks the group's other tasks, nor another group's. The claim's intake
-- routes them there (such a queue's daemons do not set the routes hash: push.lua routes by group only). A task of
-- a limited type found in `GROUP:` all the same (pushed while another config routed, or there before its type was
-- limited) is sorted out by the claim that serves `GROUP:`: one of a type whose limits refuse it now moves to its
-- (GROUP, TYPE) flow (a retry or a recovery to its head), at most SCAN a claim. A (GROUP, TYPE) flow is served
-- only while both its group and its type admit it; refused, it leaves the lowest band as a group's flows do (TIMED
-- for a type's rate window or throttle, PARKED for a full `max_running`), and a PARKED one is also named in its
-- refuser's *park index* (`park:SCOPE`, a zset, member
-- `LEVEL|MEMBER` -> ms parked): `park:g:GROUP` for a paused or full group (the settle that frees the group's slot,
-- and `kmqd group resume`, move them all back: a group has few such flows), `park:t:TYPE` for a full type (every
-- claim moves back as many of the longest-parked as the type has room for, plus 8, the oldest first: a type's
-- flows may be of thousands of groups). An index entry whose flow moved back some other way is dropped when read.
--
-- Names. The group's keys are built here, from the queue's base (`PREFIX:{QUEUE}`, ARGV), which is first checked
-- to be the start of KEYS[1]: every name the script builds starts with it, so hashes to the queue's slot, and no
-- argument can name a key of another queue (keys.rs builds the same names: `QueueKeys::group_*`).
local GROUP_TIMED, GROUP_PARKED = 1e15, 2e15

-- Defined by `groups_parts` (with rate.lua's and types.lua's, which they use), which claim.lua runs before its first
-- use of them (groups), as the fields of `groups` (`groups.read` is `groups_read`, `groups.state` `group_state`); a
-- second run returns at once: a claim without groups creates one closure for this file, not twenty-seven, and
-- names one upvalue (rate.lua says why).
local groups
local function groups_parts()
  if groups then return end
  local group_route, groups_read, group_state, group_refused, groups_with_types, group_pair, groups_due,
    groups_due_apply, groups_intake, groups_intake_apply, groups_candidates, groups_check, groups_write, groups_take,
    groups_waiting, groups_next, groups_spend
  rate_parts()
  types_parts()
  local rate_entry, rate_scan, rate_drop, throttle_until = rate.entry, rate.scan, rate.drop, rate.throttle_until
  local types_route, types_again, scopes_spend = types.route, types.again, types.scopes_spend
  -- A group's name as it is written in keys and scopes: keys.rs's `encode_name`.
  local function group_encode(name)
    return (string.gsub(name, '[%%:{}%z\1-\32\127]', function(c) return string.format('%%%02X', string.byte(c)) end))
  end

  -- The group of a payload: its envelope's `group` when that is a string of 1 to 64 bytes, otherwise (none, or one
  -- the daemon refuses and dead-letters) the group with the empty name. Decoded only when the text holds `"group"`
  -- or an escape that could spell it. Returns the encoded name, and the decoded task (nil when not decoded).
  function group_route(payload)
    if not string.find(payload, '"group"', 1, true) and not string.find(payload, '\\', 1, true) then
      return '', nil
    end
    local ok, task = pcall(cjson.decode, payload)
    if not ok or type(task) ~= 'table' then return '', nil end
    local name = task.group
    if type(name) ~= 'string' or #name == 0 or #name > 64 then return '', task end
    return group_encode(name), task
  end

  -- The block, after types.lua's: ARGV[at] 1 (0: no groups, and nothing else), ARGV[at+1] the queue's base,
  -- ARGV[at+2 ..] the level names (L), then the groups' max_running (0: none), R, R pairs (window ms, most starts),
  -- W, W pairs (encoded group, weight). KEYS from `first`: the rings (one per level), then the sched hash.
  -- Returns the block ({on = false} without groups), or nil and the error reply.
  function groups_read(script, at, first, levels, integer)
    local g = {on = ARGV[at] == '1', states = {}}
    if not g.on then return g end
    g.base = ARGV[at + 1]
    if string.sub(KEYS[1], 1, #g.base + 1) ~= g.base .. ':' then
      return nil, redis.error_reply('ERR ' .. script .. ': the groups\' base ' .. g.base .. ' does not start ' ..
        KEYS[1] .. '; nothing was written')
    end
    g.names, g.rings, g.vt = {}, {}, {}
    for level = 1, levels do
      g.names[level], g.rings[level] = ARGV[at + 1 + level], KEYS[first + level - 1]
    end
    g.sched = KEYS[first + levels]
    local a = at + 2 + levels
    g.max_running, g.rates, g.limits = tonumber(ARGV[a]), tonumber(ARGV[a + 1]), {}
    for r = 1, g.rates do
      g.limits[r] = {window = tonumber(ARGV[a + 2 * r]), limit = tonumber(ARGV[a + 2 * r + 1])}
    end
    a = a + 2 + 2 * g.rates
    g.weights = {}
    for w = 1, tonumber(ARGV[a]) do g.weights[ARGV[a + 2 * w - 1]] = tonumber(ARGV[a + 2 * w]) end
    local wrong = type_check(script)
    g.wrong = wrong
    for level = 1, levels do
      local refused = wrong(g.rings[level], 'zset')
      if refused then return nil, refused end
    end
    local refused = wrong(g.sched, 'hash')
    if refused then return nil, refused end
    for level = 1, levels do
      local value = redis.call('HGET', g.sched, 'vt:' .. level)
      if value and not tonumber(value) then
        return nil, redis.error_reply('ERR ' .. script .. ': ' .. g.sched .. ' field vt:' .. level ..
          ' is not a number (' .. string.sub(value, 1, 40) .. '); nothing was written')
      end
      g.vt[level] = tonumber(value or '0')
    end
    g.integer = integer
    return g
  end

  -- The flow key of `member` at `level`.
  local function group_flow(g, level, member)
    return g.base .. ':flow:' .. g.names[level] .. ':' .. member
  end

  -- A group's state for this claim (read once, cached): paused, throttled or rate-limited until (`due`), its room
  -- under `max_running` and its rate windows (nil: no bound), its weight. Every key is checked for its type and
  -- every count and log entry parsed here, and nothing written (see `groups_check`). Returns the state, or nil and
  -- the error reply.
  function group_state(script, g, enc, running, now)
    local st = g.states[enc]
    if st then return st end
    st = {scope = 'g:' .. enc, max_running = g.max_running, rates = g.rates, taken = 0,
      weight = math.max(1, g.weights[enc] or 1)}
    if redis.call('EXISTS', g.base .. ':hold:' .. st.scope) == 1 then st.paused = true end
    st.due = throttle_until(g.base .. ':throttle:' .. st.scope, now)
    if g.max_running > 0 then
      local value = redis.call('HGET', running, st.scope)
      local refused = g.integer(running, st.scope, value)
      if refused then return nil, refused end
      st.room = math.max(0, g.max_running - tonumber(value or '0'))
    end
    if g.rates > 0 then
      st.windows = {}
      for r, limit in ipairs(g.limits) do
        local log = g.base .. ':rate:' .. st.scope .. ':' .. limit.window
        local sum = log .. ':sum'
        local refused = g.wrong(log, 'list') or g.wrong(sum, 'string')
        if refused then return nil, refused end
        local value = redis.call('GET', sum)
        refused = g.integer(sum, 'value', value)
        if refused then return nil, refused end
        local newest, bad = rate_entry(script, log, -1)
        if bad then return nil, bad end
        st.windows[r] = {log = log, sum = sum, window = limit.window, limit = limit.limit,
          total = tonumber(value or '0'), newest = newest}
      end
      if not st.paused and not st.due and st.room ~= 0 then
        -- Read only: `groups_write` takes the aged-out entries off, once every check of the claim is done (or at
        -- once, for a group first read after that).
        local free, due, bad = rate_scan(script, st.windows, now)
        if bad then return nil, bad end
        if g.written then rate_drop(st.windows) end
        if due > 0 then
          st.due = due
        elseif not st.room or free < st.room then
          st.room = free
        end
      end
    end
    g.states[enc] = st
    return st
  end

  -- Where a refused group's flows go in the ring (nil: admitted): the PARKED band for a pause or a full count, the
  -- TIMED band until a throttle or a rate window lets it go on.
  function group_refused(st, now)
    if st.paused then return GROUP_PARKED + now end
    if st.due then return GROUP_TIMED + st.due end
    if st.room == 0 then return GROUP_PARKED + now end
  end

  -- The member's group (its part before the last `:`; a flow another config made for a type, `:TYPE`, is the
  -- group with the empty name).
  local function group_of_member(member)
    return string.match(member, '^([^:]*):') or ''
  end

  -- With type limits beside groups: the limited type (types.lua's flow, by its encoded name) of a member's flow,
  -- nil for a group's flow of the unlimited types (`GROUP:`) or of a type this config does not limit.
  local function member_type_flow(g, member)
    if not g.types then return nil end
    local kind = string.match(member, '^[^:]*:(.+)$')
    return kind and g.types[kind]
  end

  -- Type limits beside groups: `block` is types.lua's. Its limited flows, by their types' encoded names (the part of
  -- their member after `:`), for the claims that serve the (GROUP, TYPE) flows, and the bound on the tasks a claim
  -- moves out of the groups' flows to their types' (SCAN, as claim.lua's for the ready lists).
  function groups_with_types(g, block, scan)
    for _, flow in ipairs(block.flows) do
      if flow.limited then
        g.types = g.types or {}
        g.types[string.sub(flow.member, 2)] = flow
      end
    end
    g.block, g.scan, g.pairs = block, scan, {}
  end

  -- What a run of tasks taken from a flow counts in: its group's state, and its limited type's flow if any (a pair,
  -- whose `parts` claim.lua's push_runs counts each task in).
  function group_pair(g, st, typ)
    if not typ then return st end
    local by = g.pairs[st] or {}
    g.pairs[st] = by
    local pair = by[typ]
    if not pair then
      pair = {parts = {st, typ}}
      by[typ] = pair
    end
    return pair
  end

  -- Where a refused flow goes in the ring (nil: admitted), and the scope whose park index names it while it is
  -- PARKED (nil: none). Its group refuses first; then its limited type: TIMED until a throttle or a rate window lets
  -- it go on, PARKED while its `max_running` is full.
  local function flow_refused(st, typ, member, now)
    local band = group_refused(st, now)
    if band then
      if band >= GROUP_PARKED and not string.find(member, ':$') then return band, st.scope end
      return band
    end
    if typ and typ.room == 0 then
      if typ.due and typ.due > 0 then return GROUP_TIMED + typ.due end
      return GROUP_PARKED + now, typ.scope
    end
  end

  -- The park index of a running scope (`g:GROUP` or `t:TYPE`): keys.rs's `QueueKeys::park`.
  local function group_park(g, scope)
    return g.base .. ':park:' .. scope
  end

  -- Parks or times a refused flow: its band in the ring (`how`: 'XX' for a flow in the ring, 'NX' for one a task
  -- was just moved to), and its entry in its refuser's park index.
  local function flow_hold(g, level, member, band, scope, now, how)
    redis.call('ZADD', g.rings[level], how, band, member)
    if scope then redis.call('ZADD', group_park(g, scope), 'NX', now, level .. '|' .. member) end
  end

  -- Plans the move of the flows whose TIMED band came due back to each level's virtual time (at most 64 a level a
  -- claim: the rest come at the next claims). Then looks at each level's longest-parked flow: one whose group is
  -- neither paused nor full any more goes back too, one still held to the back of the parked. The settle that frees
  -- a full group's slot moves its flows back; this look is for a slot freed by a settle that did not name the rings
  -- (a daemon whose config has no groups, during a rolling change), so that no group waits for ever. Beside type
  -- limits, a limited type with room moves back the longest parked of its park index (up to its room plus 8).
  -- Reads only: returns the plan for `groups_due_apply` and, by level, the members it may bring into the lowest
  -- band (for `groups_check`); or nil and the error reply of a count that is not an integer.
  function groups_due(g, levels, running, now)
    local plan = {parked = {}, due = {}, unpark = {}}
    local moved = {}
    -- Each level's longest-parked flow and its group's count.
    for level = 1, levels do
      moved[level] = {}
      local head = redis.call('ZRANGE', g.rings[level], GROUP_PARKED, '+inf', 'BYSCORE', 'LIMIT', 0, 1)[1]
      if head then
        local scope = 'g:' .. group_of_member(head)
        local count = redis.call('HGET', running, scope)
        local refused = g.integer(running, scope, count)
        if refused then return nil, nil, refused end
        local full = g.max_running > 0 and tonumber(count or '0') >= g.max_running
        local typ = member_type_flow(g, head)
        full = full or (typ and typ.room == 0)
        plan.parked[level] = {member = head, held = full or redis.call('EXISTS', g.base .. ':hold:' .. scope) == 1}
        if not plan.parked[level].held then table.insert(moved[level], head) end
      end
      plan.due[level] = redis.call('ZRANGE', g.rings[level], GROUP_TIMED, GROUP_TIMED + now, 'BYSCORE', 'LIMIT', 0, 64)
      for _, member in ipairs(plan.due[level]) do table.insert(moved[level], member) end
    end
    -- With type limits: the longest-parked flows of each type that has room now, from its park index.
    for _, typ in pairs(g.types or {}) do
      if typ.max_running > 0 and typ.room and typ.room > 0 then
        local park = group_park(g, typ.scope)
        local refused = g.wrong(park, 'zset')
        if refused then return nil, nil, refused end
        for _, entry in ipairs(redis.call('ZRANGE', park, 0, typ.room + 7)) do
          plan.unpark[#plan.unpark + 1] = {park = park, entry = entry}
          local level, member = string.match(entry, '^(%d+)|(.*)$')
          level = tonumber(level)
          if level and moved[level] then table.insert(moved[level], member) end
        end
      end
    end
    return plan, moved
  end

  -- Carries out `groups_due`'s plan.
  function groups_due_apply(g, levels, plan, now)
    for level = 1, levels do
      for _, member in ipairs(plan.due[level]) do redis.call('ZADD', g.rings[level], 'XX', g.vt[level], member) end
      local head = plan.parked[level]
      if head and not head.held then
        redis.call('ZADD', g.rings[level], 'XX', g.vt[level], head.member)
      elseif head then
        -- Still held: to the back of the parked, so that the next claims look at the others in turn.
        redis.call('ZADD', g.rings[level], 'XX', GROUP_PARKED + now, head.member)
      end
    end
    -- After the look, which may have sent one of them to the back of the parked.
    for _, u in ipairs(plan.unpark) do
      redis.call('ZREM', u.park, u.entry)
      local level, member = string.match(u.entry, '^(%d+)|(.*)$')
      level = tonumber(level)
      if level and g.rings[level] then
        local score = redis.call('ZSCORE', g.rings[level], member)
        if score and tonumber(score) >= GROUP_PARKED then
          redis.call('ZADD', g.rings[level], 'XX', g.vt[level], member)
        end
      end
    end
  end

  -- Plans the intake: tasks that reached a ready list (pushed by a producer that does not route, a retry or a
  -- recovery come due, a dead letter requeued) go to their group's flow, at most `bound` a level a claim; a retry
  -- or a recovery to the flow's head, as due retries go to the ready list's front. Reads, routes and checks every
  -- flow's type, and writes nothing: returns the plan for `groups_intake_apply`, and by level the members it moves
  -- tasks to (for `groups_check`); or nil and the error reply.
  function groups_intake(g, levels, ready_key, bound)
    local plan, touched = {}, {}
    for level = 1, levels do
      local ready = ready_key(level)
      local items = redis.call('LRANGE', ready, 0, bound - 1)
      touched[level] = {}
      if #items > 0 then
        local heads, tails, order = {}, {}, {}
        for _, payload in ipairs(items) do
          local enc, task = group_route(payload)
          if not task and (string.find(payload, '"attempt"', 1, true) or string.find(payload, '"recovered"', 1, true))
          then
            local ok, decoded = pcall(cjson.decode, payload)
            if ok and type(decoded) == 'table' then task = decoded end
          end
          local member = enc .. ':'
          -- Beside type limits, a task of a limited type goes to its group's flow of that type.
          local typ = g.types and types_route(g.block, payload)
          if typ then member = member .. string.sub(typ.member, 2) end
          if not heads[member] then
            heads[member], tails[member] = {}, {}
            order[#order + 1] = member
            touched[level][member] = true
            local refused = g.wrong(group_flow(g, level, member), 'list')
            if refused then return nil, nil, refused end
          end
          local again = task and ((tonumber(task.attempt) or 0) > 0 or (tonumber(task.recovered) or 0) > 0)
          local to = tails[member]
          if again then to = heads[member] end
          to[#to + 1] = payload
        end
        plan[level] = {ready = ready, count = #items, heads = heads, tails = tails, order = order}
      end
    end
    return plan, touched
  end

  -- Carries out `groups_intake`'s plan.
  function groups_intake_apply(g, levels, plan)
    for level = 1, levels do
      local p = plan[level]
      if p then
        redis.call('LTRIM', p.ready, p.count, -1)
        for _, member in ipairs(p.order) do
          local flow = group_flow(g, level, member)
          local list = p.heads[member]
          for k = #list, 1, -1 do redis.call('LPUSH', flow, list[k]) end
          list = p.tails[member]
          for k = 1, #list, 1000 do redis.call('RPUSH', flow, unpack(list, k, math.min(k + 999, #list))) end
          redis.call('ZADD', g.rings[level], 'NX', g.vt[level], member)
        end
      end
    end
  end

  -- Beside type limits: whether a group's flow of the unlimited types (`GROUP:`) holds, among its first
  -- GROUP_PEEK tasks, one its turn would take now (not of a limited type that its limits refuse). A flow whose first
  -- tasks are all refused is read past like a refused group's: its turn only moves them to their (GROUP, TYPE)
  -- flows, and a claim of `want` that stopped at it took nothing though the next flow's group could run (state 7:
  -- its fetcher waited for a wake-up; the model's seventh finding, model/README.md). Reads only.
  local GROUP_PEEK = 8
  local function group_flow_takes(g, flow)
    for _, payload in ipairs(redis.call('LRANGE', flow, 0, GROUP_PEEK - 1)) do
      local typ = types_route(g.block, payload)
      if not (typ and typ.room == 0) then return true end
    end
    return false
  end

  -- A flow the take may serve, scored `pass`: its key, its group's state and its limited type, its key's and the
  -- park indexes' types checked (groups_take may name the flow in them). Reads only, once a flow a claim (the scan
  -- after `groups_check` finds the flows it checked). Returns it, or nil and the error reply.
  local function group_candidate(script, g, level, member, pass, running, now)
    g.seen = g.seen or {}
    local seen = g.seen[level .. '|' .. member]
    if seen then
      seen.pass = pass
      return seen
    end
    local flow = group_flow(g, level, member)
    local refused = g.wrong(flow, 'list')
    if refused then return nil, refused end
    local st, bad = group_state(script, g, group_of_member(member), running, now)
    if bad then return nil, bad end
    local typ = member_type_flow(g, member)
    if not string.find(member, ':$') then refused = g.wrong(group_park(g, st.scope), 'zset') end
    if not refused and typ then refused = g.wrong(group_park(g, typ.scope), 'zset') end
    if refused then return nil, refused end
    local sorts = g.types ~= nil and string.find(member, ':$') ~= nil
    local c = {member = member, pass = pass, flow = flow, st = st, typ = typ, level = level, sorts = sorts}
    g.seen[level .. '|' .. member] = c
    return c
  end

  -- The flows a level's take may serve: the lowest passes, until `want` of them are of groups their limits admit
  -- (a refused group's flow is read past, and groups_take moves it out of the lowest band: without that, a claim
  -- whose lowest passes were all paused or full took nothing though the next flow's group could run, and its
  -- fetcher waited for a wake-up; the model's finding, model/README.md), at most `want` + 256 flows, each with its
  -- group's state (all read before the claim's first write of a payload). The scan stops at the first flow that
  -- reaches either bound, which `groups_check` relies on. A member of `unsure` (a set) whose flow sorts its tasks is
  -- counted as not admitted (the intake has yet to add to its flow). Returns them, or nil and the error reply.
  function groups_candidates(script, g, level, want, running, now, unsure)
    local cands, admitted, offset = {}, 0, 0
    while admitted < want and offset < want + 256 do
      local picks = redis.call('ZRANGE', g.rings[level], '-inf', '(' .. GROUP_TIMED, 'BYSCORE', 'LIMIT', offset,
        math.min(want - admitted, want + 256 - offset), 'WITHSCORES')
      if #picks == 0 then break end
      offset = offset + #picks / 2
      for k = 1, #picks, 2 do
        local c, bad = group_candidate(script, g, level, picks[k], tonumber(picks[k + 1]), running, now)
        if bad then return nil, bad end
        cands[#cands + 1] = c
        local takes = not c.sorts or (not (unsure and unsure[c.member]) and group_flow_takes(g, c.flow))
        if not flow_refused(c.st, c.typ, c.member, now) and takes then
          admitted = admitted + 1
        end
      end
    end
    return cands
  end

  -- Every check a grouped claim makes after `groups_due` and `groups_intake` have moved flows into the lowest band,
  -- made before they write (every script checks before its first write): each flow they may move (`moved`, and
  -- `touched`, by level), and the flows `groups_candidates` reads now. Its scan after the moves reads no other:
  -- the moves only add flows to the lowest band (a flow's admission is the same before and after, but for a
  -- `touched` flow that sorts, counted here as not admitted), so its scan stops no later among the flows that were
  -- there. Then `groups_write`. Returns nil, or the error reply.
  function groups_check(script, g, levels, want, moved, touched, running, now)
    for level = 1, levels do
      for _, member in ipairs(moved[level]) do
        local _, bad = group_candidate(script, g, level, member, 0, running, now)
        if bad then return bad end
      end
      for member in pairs(touched[level]) do
        local _, bad = group_candidate(script, g, level, member, 0, running, now)
        if bad then return bad end
      end
      if want > 0 then
        local _, bad = groups_candidates(script, g, level, want, running, now, touched[level])
        if bad then return bad end
      end
    end
  end

  -- What the checks did not write: the aged-out entries of the groups' rate logs read so far, taken off; a group
  -- read after this (none, when `groups_check` ran) has its own taken off at once.
  function groups_write(g)
    g.written = true
    for _, st in pairs(g.states) do
      if st.windows then rate_drop(st.windows) end
    end
  end

  -- With type limits beside groups, a turn of up to `m` tasks from a group's flow of the unlimited types
  -- (`GROUP:`): each task of a limited type its limits refuse now goes to its (GROUP, TYPE) flow (a retry or a
  -- recovery to its head) instead of being taken, and that flow joins the ring where its type's refusal puts it.
  -- The moved flows' types are checked before the turn writes anything. Returns the tasks taken and looked at, or
  -- nil when a flow to move to is not a list (the group's flow is then left as it is for this claim).
  local function group_sort_turn(g, c, m, now, add)
    local items = redis.call('LRANGE', c.flow, 0, m - 1)
    local moves, order, took = {}, {}, {}
    for _, payload in ipairs(items) do
      local typ, task = types_route(g.block, payload)
      if typ and typ.room == 0 then
        local member = c.member .. string.sub(typ.member, 2)
        local move = moves[member]
        if not move then
          local flow = group_flow(g, c.level, member)
          if g.wrong(flow, 'list') or g.wrong(group_park(g, typ.scope), 'zset') then return nil end
          move = {flow = flow, typ = typ, heads = {}, tails = {}}
          moves[member] = move
          order[#order + 1] = member
        end
        local to = move.tails
        if task and types_again(task) then to = move.heads end
        to[#to + 1] = payload
      else
        if typ and typ.room then typ.room = typ.room - 1 end
        took[#took + 1] = {typ = typ, payload = payload}
      end
    end
    redis.call('LTRIM', c.flow, #items, -1)
    for _, t in ipairs(took) do add(group_pair(g, c.st, t.typ), t.payload) end
    for _, member in ipairs(order) do
      local move = moves[member]
      for k = #move.heads, 1, -1 do redis.call('LPUSH', move.flow, move.heads[k]) end
      if #move.tails > 0 then redis.call('RPUSH', move.flow, unpack(move.tails)) end
      local band, scope = flow_refused(c.st, move.typ, member, now)
      flow_hold(g, c.level, member, band, scope, now, 'NX')
    end
    g.scan = g.scan - #items
    return #took, #items
  end

  -- A level's take over its candidates: refused flows leave the lowest band (a PARKED one enters its refuser's park
  -- index); the others take turns in order of pass, each turn up to its group's weight (and its group's and type's
  -- room), and `add(run, payload)` collects what it took. Each served flow's pass grows by what it took over its
  -- weight; an emptied flow leaves the ring; the level's virtual time becomes the last pass served. Returns the
  -- tasks taken and whether a refused flow holds tasks.
  function groups_take(g, level, cands, take, now, add)
    local ring, got, held = g.rings[level], 0, false
    local active = {}
    for _, c in ipairs(cands) do
      local band, scope = flow_refused(c.st, c.typ, c.member, now)
      if band then
        flow_hold(g, level, c.member, band, scope, now, 'XX')
        held = true
      else
        active[#active + 1] = c
      end
    end
    while got < take and #active > 0 do
      local still = {}
      for _, c in ipairs(active) do
        if got < take then
          local m = math.min(c.st.weight, take - got)
          if c.st.room and c.st.room < m then m = c.st.room end
          if c.typ and c.typ.room and c.typ.room < m then m = c.typ.room end
          if c.sorts and g.scan < m then m = math.max(0, g.scan) end
          if m > 0 then
            local n, looked
            if c.sorts then
              n, looked = group_sort_turn(g, c, m, now, add)
            else
              local items = redis.call('LPOP', c.flow, m) or {}
              for _, payload in ipairs(items) do add(group_pair(g, c.st, c.typ), payload) end
              n, looked = #items, #items
              if c.typ and c.typ.room then c.typ.room = c.typ.room - n end
            end
            if n then
              got = got + n
              if c.st.room then c.st.room = c.st.room - n end
              if n > 0 then
                if c.pass > g.vt[level] then g.vt[level] = c.pass end
                c.pass, c.served = c.pass + n / c.st.weight, true
              end
              if looked > 0 then c.looked = true end
              if looked < m then c.empty = true else still[#still + 1] = c end
            end
          end
        else
          still[#still + 1] = c
        end
      end
      active = still
    end
    for _, c in ipairs(cands) do
      if c.empty or ((c.served or c.looked) and redis.call('EXISTS', c.flow) == 0) then
        redis.call('ZREM', ring, c.member)
      elseif c.served then
        redis.call('ZADD', ring, 'XX', c.pass, c.member)
      end
    end
    redis.call('HSET', g.sched, 'vt:' .. level, g.vt[level])
    return got, held
  end

  -- Whether a level holds tasks a claim may take now (a flow in the lowest band).
  function groups_waiting(g, level)
    return #redis.call('ZRANGE', g.rings[level], '-inf', '(' .. GROUP_TIMED, 'BYSCORE', 'LIMIT', 0, 1) > 0
  end

  -- When the earliest TIMED flow of any level may go on (0: none; the claim then waits for a settle's or a push's
  -- wake-up marker), and whether any flow is parked or timed at all.
  function groups_next(g, levels)
    local at, any = 0, false
    for level = 1, levels do
      local first = redis.call('ZRANGE', g.rings[level], GROUP_TIMED, '+inf', 'BYSCORE', 'LIMIT', 0, 1, 'WITHSCORES')
      if first[2] then
        any = true
        local score = tonumber(first[2])
        if score < GROUP_PARKED and (at == 0 or score - GROUP_TIMED < at) then at = score - GROUP_TIMED end
      end
    end
    return at, any
  end

  -- Adds each group's tasks this claim took to its counts: its running scope and its rate logs (types.lua's).
  function groups_spend(g, running, now)
    local states = {}
    for _, st in pairs(g.states) do states[#states + 1] = st end
    scopes_spend(states, running, now)
  end
  groups = {route = group_route, read = groups_read, state = group_state, refused = group_refused,
    with_types = groups_with_types, pair = group_pair, due = groups_due, due_apply = groups_due_apply,
    intake = groups_intake, intake_apply = groups_intake_apply, candidates = groups_candidates, check = groups_check,
    write = groups_write, take = groups_take, waiting = groups_waiting, next = groups_next, spend = groups_spend}
end
