-- (The broker prepends `#!lua` and checks.lua: src/broker/mod.rs, `sources`.)
-- register.lua: a new owner (a daemon's claim identity on a queue), with a lease and a description of itself.
--
-- KEYS[1] owners zset, KEYS[2] the owner's info hash
-- ARGV[1] owner id (made by the daemon: unique without Redis's help); ARGV[2] lease length in ms;
-- ARGV[3 ..] field, value pairs for the info hash: mode, levels (comma-separated, highest first), host, pid,
-- version, started_at (ms)
-- Returns {registered, now, left}: registered 1 (also when this very owner is already registered with a live
-- lease: a retry after a lost reply, which renews the lease from now, since the daemon counts its lease from when
-- it sent the retry), 0 refused: the id is known and its lease ran out (the daemon must pick another id); now,
-- Redis's clock when it ran (ms); left, the lease's deadline minus now (0 when refused). The daemon believes in
-- its lease for `left` from when it sent the call, and watches Redis's clock against its own through `now`, as it
-- does with every renewal and claim (src/daemon/lane/ownership.rs: a step of Redis's clock stops its task starts
-- until a renewal confirms the lease).
-- The monitors read the info hash to recover an expired owner's tasks from the levels it had, whatever their own
-- config says (a rolling config change).
-- Checks before it writes: the keys' types; a call that fails writes nothing.
local wrong_type = type_check('register.lua')
local refused = wrong_type(KEYS[1], 'zset') or wrong_type(KEYS[2], 'hash')
if refused then return refused end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local left = tonumber(ARGV[2])
local lease = redis.call('ZSCORE', KEYS[1], ARGV[1])
if lease then
  if tonumber(lease) > now then
    redis.call('ZADD', KEYS[1], now + left, ARGV[1])
    return {1, now, left}
  end
  return {0, now, 0}
end
if redis.call('EXISTS', KEYS[2]) == 1 then
  return {0, now, 0}
end
redis.call('ZADD', KEYS[1], now + left, ARGV[1])
local fields = {'registered_at', string.format('%d', now)}
for i = 3, #ARGV do
  fields[#fields + 1] = ARGV[i]
end
redis.call('HSET', KEYS[2], unpack(fields))
return {1, now, left}
