-- (The broker prepends `#!lua` and checks.lua: src/broker/mod.rs, `sources`.)
-- renew.lua: the heartbeat of one owner (a daemon's identity on a queue): push its lease deadline forward.
--
-- KEYS[1] owners zset, KEYS[2] the owner's info hash; ARGV[1] owner; ARGV[2] lease length in ms; ARGV[3] how
-- many bumps of the owner's journal Redis acknowledged to its daemon (see "The journal"); ARGV[4] (optional) how
-- many of its workers are stuck in a handler that ignored its cancel, written into the info hash (`stuck`) for
-- `kmqd workers` and the dashboard
-- Only a live lease is renewed: once an owner's lease has run out it never comes back, so a monitor that sees it
-- expired may recover its tasks without racing the owner. Returns {result, now, left}: result 1 renewed, 0 lost,
-- -1 lost because Redis went back in time; now, Redis's clock when it ran (ms); left, the new deadline minus now
-- (0 when lost), for the daemon's belief in its lease and its watch on Redis's clock (see register.lua).
--
-- The journal. Every claim that took tasks (claim.lua: it stored a claim list) and every settle call of the owner
-- (settle.lua, fence "owner", its info hash there) adds one to the `journal` field of its info hash; adopt.lua
-- and renew.lua add nothing. ARGV[3] is a count the daemon keeps of those bumps that Redis acknowledged: +1 per
-- claim answered with tasks, per adoption that found the lost claim's tasks (that claim's bump), per settle call
-- answered with a journal (a call sent again after a lost reply is answered once, from its stored result, and
-- counted once). Nothing is counted for a call whose reply was lost until it is resolved (the claim adopted, the
-- settle call answered): so the count is never above Redis's journal unless Redis lost acknowledged writes, and
-- the fetcher's and the acker's bumps, counted concurrently, add up in any order. A journal here below the count
-- means Redis lost writes it had acknowledged: a failover to a replica that lagged, a restart that lost the last
-- second of an `appendfsync everysec` file, a restored backup. A count, not the highest journal acknowledged: the
-- claims and settles made after such a loss, before this renewal, lift Redis's journal back over an old highest
-- value, but it stays as many below the count as bumps were lost, whatever follows. The owner's claims then hold
-- what they held back then, tasks the daemon has long settled and will never settle again, which would stay
-- there under a live lease forever. So the owner is expired on the spot: the monitors recover those tasks (they
-- run again: at least once), and the daemon, told it lost the lease, claims under a new owner. How soon: at any
-- instant, Redis's journal is the count plus the bumps whose answers are not counted yet, minus the bumps lost.
-- An owner has at most two calls unresolved at a time (its fetcher's claim: a lost one is adopted before the
-- next claim; its acker's settle call, sent again until answered), so a loss of three bumps or more is seen at
-- the next renewal, and one of one or two at the first renewal that finds fewer calls unresolved (at the latest
-- once the lane is idle). Bumps whose replies were lost and never resolved (a settle given up at shutdown) keep
-- the count behind Redis's journal for good: never a false alarm, only a loss of that many more unseen.
-- An owner whose registration is there but whose lease entry is gone (removed by hand, or lost by Redis while
-- the rest survived) is put back as expired, so that the monitors find it and recover what it holds.
-- Checks before it writes: the keys' types and the info hash's `journal` (an integer); a call that fails writes
-- nothing.
local wrong_type = type_check('renew.lua')
local integer = integer_check('renew.lua')
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
  return {0, now, 0}
end
if tonumber(lease) <= now then
  return {0, now, 0}
end
if tonumber(journal or '0') < tonumber(ARGV[3]) then
  redis.call('ZADD', KEYS[1], 0, ARGV[1])
  return {-1, now, 0}
end
local left = tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], now + left, ARGV[1])
if ARGV[4] and redis.call('EXISTS', KEYS[2]) == 1 then
  redis.call('HSET', KEYS[2], 'stuck', ARGV[4])
end
return {1, now, left}
