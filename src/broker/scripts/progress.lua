-- (The broker prepends `#!lua` and checks.lua: src/broker/mod.rs, `sources`.)
-- progress.lua: the latest progress of running tasks, as their handlers reported it (docs/PROTOCOL.md,
-- "Progress"), written only while the reporting owner's lease holds and the task is not settled.
--
-- KEYS[1] owners zset; then for each report, three keys of the task's claim: its list
-- (`processing:OWNER:LEVEL:CLAIM`), its settled bitmap (`...:CLAIM:settled`) and its progress hash
-- (`...:CLAIM:progress`, position -> the report)
-- ARGV[1] owner; ARGV[2] how long a progress hash lasts after its last write (ms): a bound on what a claim's hash
-- could outlive its claim by, were the claim ever deleted by anything but settle.lua (which deletes the hash with
-- the list); then for each report: the task's position in its claim list, and the report, a JSON object whose first
-- member follows its brace (`{"fraction":0.4,"message":"..."}`), stamped here with Redis's clock (`at`, ms)
--
-- Fenced as renew.lua fences a lease: nothing is written unless the owner's lease runs past Redis's clock now, so a
-- daemon that lost its lease (a monitor may have recovered its tasks, which run again elsewhere) writes nothing. A
-- report for a position past the end of its claim list (the claim is gone: settled whole, or recovered) or whose
-- settled bit is set (the task ended) is dropped too: a hash is never written for a task that is no longer running,
-- and never created for a claim whose list is gone, so settle.lua's delete of a finished claim leaves nothing.
-- Returns how many reports were written (0 for a lost lease).
-- Checks before it writes: the keys' types; a call that fails writes nothing.
local wrong_type = type_check('progress.lua')
local reports = (#ARGV - 2) / 2
if reports ~= math.floor(reports) or #KEYS ~= 1 + 3 * reports or not tonumber(ARGV[2]) then
  return redis.error_reply('ERR progress.lua: ' .. #KEYS .. ' keys and ' .. #ARGV ..
    ' arguments are not an owner, an expiry and reports of three keys and two arguments; nothing was written')
end
local refused = wrong_type(KEYS[1], 'zset')
for r = 1, reports do
  local at = 3 * r - 1
  refused = refused or wrong_type(KEYS[at], 'list') or wrong_type(KEYS[at + 1], 'string') or
    wrong_type(KEYS[at + 2], 'hash')
  local position, report = tonumber(ARGV[1 + 2 * r]), ARGV[2 + 2 * r]
  if not refused and (not position or position < 0 or string.sub(report, 1, 2) ~= '{"') then
    refused = redis.error_reply('ERR progress.lua: report ' .. r .. ' (' .. ARGV[1 + 2 * r] ..
      ') is not a position and a JSON object; nothing was written')
  end
end
if refused then return refused end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lease = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not lease or tonumber(lease) <= now then
  return 0
end
local stamp = '{"at":' .. string.format('%d', now) .. ','
local written, lengths, touched = 0, {}, {}
for r = 1, reports do
  local at = 3 * r - 1
  local list, bits, hash = KEYS[at], KEYS[at + 1], KEYS[at + 2]
  local position = tonumber(ARGV[1 + 2 * r])
  if not lengths[list] then lengths[list] = redis.call('LLEN', list) end
  if position < lengths[list] and redis.call('GETBIT', bits, position) == 0 then
    redis.call('HSET', hash, position, stamp .. string.sub(ARGV[2 + 2 * r], 2))
    touched[hash] = true
    written = written + 1
  end
end
for hash in pairs(touched) do
  redis.call('PEXPIRE', hash, ARGV[2])
end
return written
