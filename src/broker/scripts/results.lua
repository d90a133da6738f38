-- results.lua: the results a settle keeps (a queue's `keep_results`), prepended to settle.lua (src/broker/mod.rs,
-- `sources`), so that settle.lua itself changes by a line or two.
--
-- A call that keeps results ends with a trailer, past everything settle.lua reads: ARGV ends with R triples (the
-- task's place in the call: `rN` for the call's Nth record, `cK:P` for the plain acknowledgement of position P of
-- the call's Kth claim; the expiry in ms; the kept value, a JSON object) and then R and the word "results"; KEYS
-- ends with the R result keys (`PREFIX:{QUEUE}:result:ID`, in the queue's slot), in the triples' order. A call
-- without results has no trailer: nothing else is read or written, and a queue without `keep_results` pays one
-- comparison. The last argument of a call without a trailer is never "results" (a number, or a flow's ring
-- member, which holds a colon). A done task's result rides with its plain acknowledgement, in its claim's bitmap,
-- so that keeping results adds a TYPE and a SET a task, not a record.
--
-- `take_kept` takes the trailer off ARGV and KEYS (they are the script's own tables), so settle.lua reads its
-- arguments as it always has, and checks the result keys' types before anything is written (a result key that
-- is not a string fails the call whole, as every other key of a settle does). `keep` (a record) and `keep_claim`
-- (a claim's acknowledgements) write one only when its task's settlement applies: a record that applied, or a
-- position whose bit this call sets. A stale one (the task was recovered from an expired lease, so its daemon no
-- longer holds it) writes nothing, which is what fences a result to the owner of the task's lease.
local function take_kept()
  local kept = {records = {}, claims = {}}
  if ARGV[#ARGV] ~= 'results' then return kept end
  local count = tonumber(ARGV[#ARGV - 1])
  if not count or count < 0 or #ARGV < 2 + 3 * count or #KEYS < count then
    return nil, redis.error_reply('settle.lua: results trailer of ' .. tostring(ARGV[#ARGV - 1]) ..
      '; nothing was applied')
  end
  local first_arg, first_key = #ARGV - 2 - 3 * count, #KEYS - count
  for n = 1, count do
    local at = first_arg + 3 * (n - 1)
    local place, ttl, key = ARGV[at + 1], tonumber(ARGV[at + 2]), KEYS[first_key + n]
    local record = tonumber(string.match(place, '^r(%d+)$'))
    local claim, position = string.match(place, '^c(%d+):(%d+)$')
    if (not record and not claim) or not ttl or ttl < 1 or string.sub(ARGV[at + 3], 1, 1) ~= '{' then
      return nil, redis.error_reply('settle.lua: kept result ' .. n .. ' (' .. place .. ', ' ..
        tostring(ARGV[at + 2]) .. ' ms) is not a place, an expiry and a JSON object; nothing was applied')
    end
    local found = redis.call('TYPE', key).ok
    if found ~= 'none' and found ~= 'string' then
      return nil, redis.error_reply('WRONGTYPE settle.lua: ' .. key .. ' is a ' .. found .. ', not a string; ' ..
        'nothing was applied')
    end
    local result = {key = key, ttl = ttl, value = ARGV[at + 3], position = tonumber(position)}
    if record then
      kept.records[record] = result
    else
      claim = tonumber(claim)
      kept.claims[claim] = kept.claims[claim] or {}
      table.insert(kept.claims[claim], result)
    end
  end
  for n = #ARGV, first_arg + 1, -1 do ARGV[n] = nil end
  for n = #KEYS, first_key + 1, -1 do KEYS[n] = nil end
  return kept
end

-- Writes one kept result, stamped with when the task ended (`ended_at`, ms on Redis's clock), to expire `ttl` ms
-- from now.
local function write_kept(result, now)
  local rest = string.sub(result.value, 2)
  if string.match(rest, '^%s*}') == nil then rest = ',' .. rest end
  redis.call('SET', result.key, '{"ended_at":' .. string.format('%d', now) .. rest, 'PX', result.ttl)
end

-- The result kept for the call's record number `record`, if any: called once the record applied.
local function keep(kept, record, now)
  local result = kept.records[record]
  if result then write_kept(result, now) end
end

-- The results kept for the plain acknowledgements of the call's claim `k`, before its bitmap `bits` (whose value
-- before this call is `old`, false for none) is merged: each position whose bit this call sets. Called only for a
-- claim list that still holds tasks (a claim gone was recovered whole: every acknowledgement of it is stale).
local function keep_claim(kept, k, bits, old, now)
  local results = kept.claims[k]
  if not results then return end
  for _, result in ipairs(results) do
    if not old or redis.call('GETBIT', bits, result.position) == 0 then write_kept(result, now) end
  end
end
