-- expired.lua: list tasks whose lease ran out (their daemon stopped heart-beating), for the monitor to decide
-- about. Changes nothing: settle.lua with fence "expired" applies the decisions.
--
-- KEYS[1] leases zset, KEYS[2] processing hash; ARGV[1] the most tokens to return
-- Returns {now_ms, token, envelope, token, envelope, ...}; the envelope is "" for a lease without a task.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local tokens = redis.call('ZRANGE', KEYS[1], '-inf', now, 'BYSCORE', 'LIMIT', 0, tonumber(ARGV[1]))
local result = {now}
for _, token in ipairs(tokens) do
  result[#result + 1] = token
  result[#result + 1] = redis.call('HGET', KEYS[2], token) or ''
end
return result
