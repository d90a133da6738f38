-- results.lua: the results a settle keeps (a queue's `keep_results`), prepended to settle.lua (src/broker/mod.rs,
-- `sources`), so that settle.lua itself changes by a line or two.
--
-- Where they are kept (docs/PROTOCOL.md, "Results"): in a hash per queue and time bucket, `PREFIX:{QUEUE}:results:
-- START` (field: the task's id; value: the kept JSON object), listed in the queue's index of buckets, the sorted set
-- `PREFIX:{QUEUE}:results` (member: START; score: when the bucket expires, ms on Redis's clock). A key per result,
-- each with its own expiry, cost a drain 6x its time (docs/PERFORMANCE.md, "Results"); a hash that exists takes a
-- field for the price of a part of one HSET a call, and the expiry and the index are set once a call. START is the caller's clock
-- cut down to a bucket length (`broker::results::bucket_length`: a power of two seconds, a 32nd to a 16th of
-- keep_results), so a bucket takes the results of one stretch of time. A bucket expires `keep_results` after the last result written into it (never sooner:
-- its expiry is only pushed back), so each of its results is readable for at least `keep_results` after its
-- task ended, and gone about a bucket length later.
--
-- A call that keeps results ends with a trailer, past everything settle.lua reads: ARGV ends with R quadruples (the
-- task's place in the call: K and P, the plain acknowledgement of position P of the call's Kth claim, or 0 and N,
-- the call's Nth record; the task's id; the kept value, a JSON object whose first member follows its brace: `{"`),
-- then START, the expiry in ms (`keep_results`), R and the word "results"; KEYS ends with the index and the bucket
-- (both in the queue's slot). A call without results has no trailer: nothing else is read or written, and a queue
-- without `keep_results` pays one comparison. The last argument of a call without a trailer is never "results" (a
-- number, or a flow's ring member, which holds a colon). A done task's result rides with its plain
-- acknowledgement, in its claim's bitmap.
--
-- `take_kept` takes the trailer off ARGV and KEYS (they are the script's own tables), so settle.lua reads its
-- arguments as it always has, and checks the two keys' types before anything is written (a key of the wrong type
-- fails the call whole, as every other key of a settle does). `keep` (a record) and `keep_claim` (a claim's
-- acknowledgements) keep one only when its task's settlement applies: a record that applied, or a position whose
-- bit this call sets. A stale one (the task was recovered from an expired lease, so its daemon no longer holds it)
-- keeps nothing, which is what fences a result to the owner of the task's lease. What they keep is written by
-- `write_kept`, at the end of the call, in as few HSETs as Lua's stack allows: the drain's cost was per command.
local function take_kept()
  local kept = {records = {}, claims = {}, ids = {}, values = {}, positions = {}, fields = {}}
  if ARGV[#ARGV] ~= 'results' then return kept end
  local count = tonumber(ARGV[#ARGV - 1])
  if not count or count < 0 or #ARGV < 4 + 4 * count or #KEYS < 2 then
    return nil, redis.error_reply('settle.lua: results trailer of ' .. tostring(ARGV[#ARGV - 1]) ..
      '; nothing was applied')
  end
  local ttl, start = tonumber(ARGV[#ARGV - 2]), ARGV[#ARGV - 3]
  if not ttl or ttl < 1 or not string.match(start, '^%d+$') then
    return nil, redis.error_reply('settle.lua: results trailer with bucket ' .. start .. ' and expiry ' ..
      tostring(ARGV[#ARGV - 2]) .. ' ms, not two whole numbers; nothing was applied')
  end
  kept.index, kept.bucket, kept.start, kept.ttl = KEYS[#KEYS - 1], KEYS[#KEYS], start, ttl
  for key, wanted in pairs({[kept.index] = 'zset', [kept.bucket] = 'hash'}) do
    local found = redis.call('TYPE', key).ok
    if found ~= 'none' and found ~= wanted then
      return nil, redis.error_reply('WRONGTYPE settle.lua: ' .. key .. ' is a ' .. found .. ', not a ' ..
        wanted .. '; nothing was applied')
    end
  end
  local first_arg = #ARGV - 4 - 4 * count
  local records, claims, ids, values, positions = kept.records, kept.claims, kept.ids, kept.values, kept.positions
  for n = 1, count do
    local at = first_arg + 4 * n - 3
    local claim, place, value = tonumber(ARGV[at]), tonumber(ARGV[at + 1]), ARGV[at + 3]
    if not claim or not place or string.sub(value, 1, 2) ~= '{"' then
      return nil, redis.error_reply('settle.lua: kept result ' .. n .. ' (' .. ARGV[at] .. ', ' ..
        ARGV[at + 1] .. ') is not a place, an id and a JSON object; nothing was applied')
    end
    ids[n], values[n] = ARGV[at + 2], value
    if claim == 0 then
      records[place] = n
    else
      positions[n] = place
      local listed = claims[claim]
      if not listed then
        listed = {}
        claims[claim] = listed
      end
      listed[#listed + 1] = n
    end
  end
  for n = #ARGV, first_arg + 1, -1 do ARGV[n] = nil end
  KEYS[#KEYS], KEYS[#KEYS - 1] = nil, nil
  return kept
end

-- Kept result `n`, stamped with when the task ended (`ended_at`, ms on Redis's clock), to be written at the end.
local function add_kept(kept, n, now)
  local fields = kept.fields
  if not kept.stamp then kept.stamp = '{"ended_at":' .. string.format('%d', now) .. ',' end
  fields[#fields + 1] = kept.ids[n]
  fields[#fields + 1] = kept.stamp .. string.sub(kept.values[n], 2)
end

-- The result kept for the call's record number `record`, if any: called once the record applied.
local function keep(kept, record, now)
  local n = kept.records[record]
  if n then add_kept(kept, n, now) end
end

-- The results kept for the plain acknowledgements of the call's claim `k`, before its bitmap (whose value before
-- this call is `old`, false for none) is merged: each position whose bit this call sets, read from `old` (bit p
-- is bit 7 - p % 8 of byte p / 8, GETBIT's order) rather than asked of Redis a command each. Called only for a
-- claim list that still holds tasks (a claim gone was recovered whole: every acknowledgement of it is stale).
local function keep_claim(kept, k, bits, old, now)
  local listed = kept.claims[k]
  if not listed then return end
  for _, n in ipairs(listed) do
    local position = kept.positions[n]
    local byte = old and string.byte(old, math.floor(position / 8) + 1)
    if not byte or bit.band(byte, bit.rshift(128, position % 8)) == 0 then add_kept(kept, n, now) end
  end
end

-- Writes what the call keeps, once everything else applied: the fields in HSETs of at most 2,000 arguments (Lua's
-- `unpack` has a bounded stack); the bucket made to expire `ttl` from now unless it already lasts longer (a key
-- that does not exist takes none until its first field is in), listed in the index with that expiry; the index
-- lasts as long as its last bucket and forgets the buckets that expired (a few a call at most: one a bucket
-- length).
local function write_kept(kept, now)
  local fields = kept.fields
  if #fields == 0 then return end
  for from = 1, #fields, 2000 do
    redis.call('HSET', kept.bucket, unpack(fields, from, math.min(from + 1999, #fields)))
  end
  if redis.call('PTTL', kept.bucket) < kept.ttl then redis.call('PEXPIRE', kept.bucket, kept.ttl) end
  redis.call('ZADD', kept.index, 'GT', now + kept.ttl, kept.start)
  local gone = redis.call('ZRANGE', kept.index, '-inf', now, 'BYSCORE', 'LIMIT', 0, 16)
  if #gone > 0 then redis.call('ZREM', kept.index, unpack(gone)) end
  if redis.call('PTTL', kept.index) < kept.ttl then redis.call('PEXPIRE', kept.index, kept.ttl) end
end
