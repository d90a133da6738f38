-- access.lua: may this Redis user run what kmqd needs on one queue? Asked once at start (src/broker/access.rs),
-- so that a missing ACL rule stops kmqd at once, naming the command, instead of failing its first task.
--
-- KEYS[1] a key of the queue: only so that Redis Cluster routes the call to the queue's node; never read.
-- ARGV: checks, each one a count N followed by N strings: a command as kmqd sends it (name, subcommand, the
--       real key and channel names of the queue, realistic other arguments).
-- Returns -1 when this Redis has no redis.acl_check_cmd (older than 7.0): nothing was checked. Otherwise the
-- 1-based numbers of the refused checks, in order ({} when every one is allowed); a check whose command this
-- Redis does not know (renamed or disabled with rename-command) comes back as its number negated.
-- Writes nothing and runs nothing it checks: redis.acl_check_cmd only asks the ACL rules.
if redis.acl_check_cmd == nil then
  return -1
end
local refused = {}
local i, check = 1, 1
while i <= #ARGV do
  local n = tonumber(ARGV[i])
  local ok, allowed = pcall(redis.acl_check_cmd, unpack(ARGV, i + 1, i + n))
  if not ok then
    refused[#refused + 1] = -check
  elseif not allowed then
    refused[#refused + 1] = check
  end
  i = i + n + 1
  check = check + 1
end
return refused
