-- results.lua: the results a settle keeps (a queue's `keep_results`), prepended to settle.lua (src/broker/mod.rs,
-- `sources`), so that settle.lua itself changes by a line or two.
--
-- A call that keeps results ends with a trailer, past everything settle.lua reads: ARGV ends with R triples
-- (the record's number, 1 for the call's first record; the expiry in ms; the kept value, a JSON object) and then R and
-- the word "results"; KEYS ends with the R result keys (`PREFIX:{QUEUE}:result:ID`, in the queue's slot), in the
-- triples' order. A call without results has no trailer: nothing else is read or written, and a queue without
-- `keep_results` pays one comparison. The last argument of a call without a trailer is never "results" (a
-- number, or a flow's ring member, which holds a colon).
--
-- `take_kept` takes the trailer off ARGV and KEYS (they are the script's own tables), so settle.lua reads its
-- arguments as it always has, and checks the result keys' types before anything is written (a result key that
-- is not a string fails the call whole, as every other key of a settle does). `keep` writes one, in the record's
-- step, only when the record applied: a stale record (the task was recovered from an expired lease, so its
-- daemon no longer holds it) writes nothing, which is what fences a result to the owner of the task's lease.
local function take_kept()
  local kept = {}
  if ARGV[#ARGV] ~= 'results' then return kept end
  local count = tonumber(ARGV[#ARGV - 1])
  if not count or count < 0 or #ARGV < 2 + 3 * count or #KEYS < count then
    return nil, redis.error_reply('settle.lua: results trailer of ' .. tostring(ARGV[#ARGV - 1]) ..
      '; nothing was applied')
  end
  local first_arg, first_key = #ARGV - 2 - 3 * count, #KEYS - count
  for n = 1, count do
    local at = first_arg + 3 * (n - 1)
    local record, ttl, key = tonumber(ARGV[at + 1]), tonumber(ARGV[at + 2]), KEYS[first_key + n]
    if not record or not ttl or ttl < 1 or string.sub(ARGV[at + 3], 1, 1) ~= '{' then
      return nil, redis.error_reply('settle.lua: kept result ' .. n .. ' (record ' .. tostring(ARGV[at + 1]) ..
        ', ' .. tostring(ARGV[at + 2]) .. ' ms) is not a record, an expiry and a JSON object; nothing was applied')
    end
    local found = redis.call('TYPE', key).ok
    if found ~= 'none' and found ~= 'string' then
      return nil, redis.error_reply('WRONGTYPE settle.lua: ' .. key .. ' is a ' .. found .. ', not a string; ' ..
        'nothing was applied')
    end
    kept[record] = {key = key, ttl = ttl, value = ARGV[at + 3]}
  end
  for n = #ARGV, first_arg + 1, -1 do ARGV[n] = nil end
  for n = #KEYS, first_key + 1, -1 do KEYS[n] = nil end
  return kept
end

-- Writes the result kept for the call's record number `record`, if any, stamped with when the task ended (`ended_at`,
-- ms on Redis's clock), to expire `ttl` ms from now.
local function keep(kept, record, now)
  local result = kept[record]
  if result then
    local rest = string.sub(result.value, 2)
    if string.match(rest, '^%s*}') == nil then rest = ',' .. rest end
    redis.call('SET', result.key, '{"ended_at":' .. string.format('%d', now) .. rest, 'PX', result.ttl)
  end
end
