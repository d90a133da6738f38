-- Not one of kmqd's scripts: a probe that scripts/settle-instructions --lean counts (docs/PERFORMANCE.md, "Slots in
-- step, settles in parallel, and the claim after a settle"). It asks Redis the least that a settle of one claim's
-- acknowledgements and the claim of the next task for the slot it frees must ask, at max_running on a plain queue
-- (one level; no rate limit, weights, type limits or groups; nothing quarantined, paused or throttled), every key's
-- type and counter checked before the first write, the call stored for a copy sent again. It answers GENERIC
-- where such a script would leave the call to settle.lua. What a script made for that case would cost, against the
-- generic settle.lua's handover.
-- KEYS: 1 owners, 2 stats, 3 last call, 4 running, 5 wake, 6 the owner's info, 7 its claim set, 8 the claim's list,
-- 9 its bits, 10 its scopes, 11 ready, 12 paused, 13 throttle, 14-16 quarantine lists, 17 the next claim's list,
-- 18 its scopes, 19 dead. ARGV: 1 owner, 2 call, 3 claim, 4 acks, 5 their count, 6 the next claim,
-- 7 max_running, 8 max_task_bytes, 9 the claim's bytes.
local function bad(key, kind, reply)
  if type(reply) == 'table' and reply.err then
    local found = redis.call('TYPE', key).ok
    return redis.error_reply('WRONGTYPE ' .. key .. ' is a ' .. found .. ', not a ' .. kind)
  end
end
local function int(v) return not v or string.match(v, '^-?%d+$') end
local prior = redis.pcall('GET', KEYS[3])
local counters = redis.pcall('HMGET', KEYS[2], 'done', 'dead_lettered')
local running = redis.pcall('HMGET', KEYS[4], 'q', 'q:limit')
local scopes = redis.pcall('GET', KEYS[10])
local length = redis.pcall('LLEN', KEYS[8])
local old = redis.pcall('GET', KEYS[9])
local info = redis.pcall('HMGET', KEYS[6], 'floor', 'group', 'journal')
local lease = redis.pcall('ZSCORE', KEYS[1], ARGV[1])
local refused = bad(KEYS[3], 'string', prior) or bad(KEYS[2], 'hash', counters) or bad(KEYS[4], 'hash', running) or
  bad(KEYS[10], 'string', scopes) or bad(KEYS[8], 'list', length) or bad(KEYS[9], 'string', old) or
  bad(KEYS[6], 'hash', info) or bad(KEYS[1], 'zset', lease)
if refused then return refused end
if not (int(counters[1]) and int(counters[2]) and int(running[1]) and int(running[2]) and int(info[1]) and
    int(info[3])) then
  return redis.error_reply('ERR not an integer')
end
for _, k in ipairs({7, 5, 11, 19}) do
  local found = redis.call('TYPE', KEYS[k]).ok
  if found ~= 'none' and found ~= (k == 7 and 'zset' or 'list') then return redis.error_reply('WRONGTYPE') end
end
if prior then
  local bar = string.find(prior, '|', 1, true)
  if string.sub(prior, 1, bar - 1) == ARGV[2] then return string.sub(prior, bar + 1) end
end
local rare = redis.call('EXISTS', KEYS[12], KEYS[13], KEYS[14], KEYS[15], KEYS[16], KEYS[17], KEYS[18])
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
if not lease or tonumber(lease) <= now then return redis.error_reply('LEASELOST') end
if info[1] and tonumber(ARGV[6]) < tonumber(info[1]) then return redis.error_reply('FENCED') end
if rare > 0 or info[2] then return redis.error_reply('GENERIC') end   -- the generic scripts' case
if scopes ~= '1 q' or old or tonumber(ARGV[5]) ~= length then return redis.error_reply('GENERIC') end
-- Writes.
local journal = redis.call('HINCRBY', KEYS[6], 'journal', '1')
redis.call('DEL', KEYS[8], KEYS[9], KEYS[10])
redis.call('ZREM', KEYS[7], ARGV[3])
local q = tonumber(running[1] or '0') - length
local max = tonumber(ARGV[7]) - q
local n = 0
if max > 0 then
  n = redis.call('SORT', KEYS[11], 'BY', 'nosort', 'LIMIT', '0', max, 'STORE', KEYS[17])
end
if n > 0 then
  local bytes = redis.call('MEMORY', 'USAGE', KEYS[17], 'SAMPLES', '0')
  if bytes > tonumber(ARGV[8]) then return redis.error_reply('GENERIC') end
  redis.call('LTRIM', KEYS[11], n, '-1')
  redis.call('ZADD', KEYS[7], n, ARGV[6])
  redis.call('SET', KEYS[18], n .. ' q')
end
if n ~= length then redis.call('HSET', KEYS[4], 'q', q + n) end
if n < length then redis.call('LPUSH', KEYS[5], '1') redis.call('LTRIM', KEYS[5], '0', '0') end
local result = '0,' .. length .. ',' .. journal .. ',' .. now .. ',' .. n
redis.call('SET', KEYS[3], ARGV[2] .. '|' .. result, 'PX', '86400000')
redis.call('HINCRBY', KEYS[2], 'done', length)
return result
