#!lua
-- renew.lua: the heartbeat of one owner (a daemon's identity on a queue): push its lease deadline forward.
--
-- KEYS[1] owners zset, KEYS[2] the owner's info hash; ARGV[1] owner; ARGV[2] lease length in ms; ARGV[3] the
-- owner's journal as its daemon last saw it acknowledged; ARGV[4] (optional) how many of its workers are stuck in
-- a handler that ignored its cancel, written into the info hash (`stuck`) for `kmqd workers` and the dashboard
-- Only a live lease is renewed: once an owner's lease has run out it never comes back, so a monitor that sees it
-- expired may recover its tasks without racing the owner. Returns 1 renewed, 0 lost, -1 lost because Redis went
-- back in time.
--
-- The journal. Every claim that took tasks and every settle of the owner adds one to the `journal` field of its
-- info hash and returns it; the daemon remembers the highest value acknowledged. A journal here below that
-- value means Redis lost writes it had acknowledged: a failover to a replica that lagged, a restart that lost
-- the last second of an `appendfsync everysec` file, a restored backup. The owner's claims then hold
-- what they held back then, tasks the daemon has long settled and will never settle again, which would stay
-- there under a live lease forever. So the owner is expired on the spot: the monitors recover those tasks (they
-- run again: at least once), and the daemon, told it lost the lease, claims under a new owner.
-- An owner whose registration is there but whose lease entry is gone (removed by hand, or lost by Redis while
-- the rest survived) is put back as expired, so that the monitors find it and recover what it holds.
-- Checks before it writes: the keys' types and the info hash's `journal` (an integer); a call that fails writes
-- nothing.
local function wrong_type(key, kind)
  local found = redis.call('TYPE', key).ok
  if found ~= 'none' and found ~= kind then
    return redis.error_reply('WRONGTYPE renew.lua: ' .. key .. ' is a ' .. found .. ', not a ' .. kind ..
      '; nothing was written')
  end
end
local function integer(key, field, value)
  local digits = value and string.match(value, '^-?([1-9]%d*)$')
  if value and value ~= '0' and not (digits and #digits <= 18) then
    return redis.error_reply('ERR renew.lua: ' .. key .. ' field ' .. field .. ' is not an integer (' ..
      string.sub(value, 1, 40) .. '); nothing was written')
  end
end
local journal = false
local refused = wrong_type(KEYS[1], 'zset') or wrong_type(KEYS[2], 'hash')
if not refused then
  journal = redis.call('HGET', KEYS[2], 'journal')
  refused = integer(KEYS[2], 'journal', journal)
end
if refused then return refused end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lease = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not lease then
  if redis.call('EXISTS', KEYS[2]) == 1 then
    redis.call('ZADD', KEYS[1], 0, ARGV[1])
  end
  return 0
end
if tonumber(lease) <= now then
  return 0
end
if tonumber(journal or '0') < tonumber(ARGV[3]) then
  redis.call('ZADD', KEYS[1], 0, ARGV[1])
  return -1
end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
if ARGV[4] and redis.call('EXISTS', KEYS[2]) == 1 then
  redis.call('HSET', KEYS[2], 'stuck', ARGV[4])
end
return 1
