-- (The broker prepends `#!lua` and checks.lua: src/broker/mod.rs, `sources`.)
-- drain.lua: mark an owner's registration as draining: its daemon began a graceful stop and takes no more tasks
-- (`kmqd workers` shows it). Only an existing registration is marked, so that a registration a monitor already
-- removed is not brought back as a hash without an owner.
--
-- KEYS[1] the owner's info hash
-- ARGV[1] when the stop began, ms since the epoch (the daemon's clock; informational)
-- Returns 1 marked, 0 no such registration.
-- Checks before it writes: the key's type; a call that fails writes nothing.
local refused = type_check('drain.lua')(KEYS[1], 'hash')
if refused then return refused end
if redis.call('EXISTS', KEYS[1]) == 0 then
  return 0
end
redis.call('HSET', KEYS[1], 'draining', ARGV[1])
return 1
