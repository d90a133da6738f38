-- renew.lua: extend the leases of the tasks a daemon holds, in one call per queue (the heartbeat).
--
-- KEYS[1] leases zset; ARGV[1] lease length in ms; ARGV[2..] tokens
-- Only tokens that still have a lease are renewed (ZADD XX): a token the monitor already recovered stays gone.
-- Returns the tokens that had no lease any more.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local deadline = now + tonumber(ARGV[1])
local lost, args = {}, {}
local scores = redis.call('ZMSCORE', KEYS[1], unpack(ARGV, 2))
for i = 2, #ARGV do
  if scores[i - 1] then
    args[#args + 1] = deadline
    args[#args + 1] = ARGV[i]
  else
    lost[#lost + 1] = ARGV[i]
  end
end
if #args > 0 then
  redis.call('ZADD', KEYS[1], 'XX', unpack(args))
end
return lost
