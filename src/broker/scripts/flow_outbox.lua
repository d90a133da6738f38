-- (The broker prepends checks.lua: src/broker/mod.rs, `sources`.)
-- flow_outbox.lua: remove the notes a mover applied from the head of a queue's outbox (docs/design/flows.md).
-- The mover read them oldest first (LRANGE 0 N), applied each to every waiter, and only then calls this: so a
-- mover killed before it leaves them for the next, which applies them again to no effect. Two movers of one
-- outbox read the same notes and apply them twice, harmlessly; the first to get here pops them, and the second
-- finds the head no longer its first note and pops nothing.
--
-- KEYS[1] the outbox   P:{Q}:deps-outbox
-- ARGV    the notes applied, in the order read
-- Removes the longest run of them that the outbox's head still is, in order: what popping each while it is the
-- head would remove, with one read and one trim for the call rather than an LINDEX and an LPOP a note (a fan-in's
-- mover removes up to 1,024 notes a turn). Returns how many were removed.
local refused = type_check('flow_outbox.lua')(KEYS[1], 'list')
if refused then return refused end
local head = redis.call('LRANGE', KEYS[1], 0, #ARGV - 1)
local popped = 0
while popped < #ARGV and head[popped + 1] == ARGV[popped + 1] do popped = popped + 1 end
if popped > 0 then redis.call('LTRIM', KEYS[1], popped, -1) end
return popped
