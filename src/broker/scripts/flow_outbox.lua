-- (The broker prepends checks.lua: src/broker/mod.rs, `sources`.)
-- flow_outbox.lua: remove the notes a mover applied from the head of a queue's outbox (docs/design/flows.md).
-- The mover read them oldest first (LRANGE 0 N), applied each to every waiter, and only then calls this: so a
-- mover killed before it leaves them for the next, which applies them again to no effect. Two movers of one
-- outbox read the same notes and apply them twice, harmlessly; the first to get here pops them, and the second
-- finds the head no longer its first note and pops nothing.
--
-- KEYS[1] the outbox   P:{Q}:deps-outbox
-- ARGV    the notes applied, in the order read
-- Pops each while it is the head. Returns how many were popped.
local refused = type_check('flow_outbox.lua')(KEYS[1], 'list')
if refused then return refused end
local popped = 0
for n = 1, #ARGV do
  if redis.call('LINDEX', KEYS[1], 0) ~= ARGV[n] then break end
  redis.call('LPOP', KEYS[1])
  popped = popped + 1
end
return popped
