-- rate.lua: a rate limit's windows (and a throttle's end), shared by claim.lua and pop.lua: the broker prepends this
-- file to both, after checks.lua, whose `integer_check` and `type_check` the takes use (src/broker/mod.rs,
-- `sources`), so that the two takes count starts the same way.
--
-- Each window's log holds the starts as `MS COUNT` entries (COUNT tasks taken at MS, Redis's clock), oldest
-- first, and its sum (a string). A take first drops the entries that aged out (MS <= now - window), takes at
-- most what every window leaves (its limit minus its sum), then adds what it took as one entry: merged into the
-- newest one when that is within a thousandth of the window of now (so a log holds about a thousand entries a
-- window, whatever the rate), at the later of the two times. A merged start is counted as late as it can be,
-- never early, so no window ever holds more starts than its limit; and one taken at a clock that stepped back is
-- stamped no earlier than the newest entry, so the log stays in order. Both keys expire a second after the
-- window, with the last start. It counts starts: a task handed back or retried does not give its start back.

-- Lua creates a closure for each `local function` of a script's top level on every call, used or not
-- (docs/PERFORMANCE.md, "A claim that pays only for the script code it uses"): this file's functions are defined
-- by `rate_parts`, which a caller runs before its first use of them (a rate limit, a throttle that exists, type
-- limits, groups), and a second run returns at once. A call with none of these creates one closure for this file,
-- not seven. The functions are the fields of one table, `rate` (`rate.read` is `rate_read`; nil until
-- `rate_parts` ran), not locals of the script's top level: every function that names such a local holds it as an
-- upvalue, which Lua finds or makes each time it creates that function, on every call (claim.lua's `claim_run`
-- named 38): one table a prelude took 21,000 instructions off an idle claim (docs/PERFORMANCE.md, "The idle
-- take's Lua, line by line").
local rate
local function rate_parts()
  if rate then return end
  local rate_entry, rate_read, rate_scan, rate_drop, rate_trim, throttle_until, rate_spend
  -- The entry of `log` at `at` (nil when there is none), or false and the error reply of `script` for an entry
  -- that does not parse.
  function rate_entry(script, log, at)
    local text = redis.call('LINDEX', log, at)
    if not text then return nil end
    local ms, count = string.match(text, '^(%d+) (%d+)$')
    if not ms then
      return false, redis.error_reply('ERR ' .. script .. ': ' .. log .. ' holds ' .. string.sub(text, 1, 40) ..
        ', not an entry "MS COUNT"; nothing was written')
    end
    return {ms = tonumber(ms), count = tonumber(count)}
  end

  -- Reads the `rates` windows, each its log KEYS[first_key + 2(r-1)] and sum KEYS[first_key + 2r - 1], its length
  -- ARGV[first_arg + 2(r-1)] and limit ARGV[first_arg + 2r - 1]; `integer` checks a counter. Parses every value
  -- it will rely on before any write: returns the windows, or nil and the error reply.
  function rate_read(script, rates, first_key, first_arg, integer)
    local windows = {}
    for r = 1, rates do
      local log, sum = KEYS[first_key + 2 * r - 2], KEYS[first_key + 2 * r - 1]
      local value = redis.call('GET', sum)
      local refused = integer(sum, 'value', value)
      if refused then return nil, refused end
      local newest, bad = rate_entry(script, log, -1)
      if bad then return nil, bad end
      windows[r] = {log = log, sum = sum, window = tonumber(ARGV[first_arg + 2 * r - 2]),
        limit = tonumber(ARGV[first_arg + 2 * r - 1]), total = tonumber(value or '0'), newest = newest}
    end
    return windows
  end

  -- Reads each window's entries that aged out at `now` (every one read and parsed, in every window) and counts them
  -- as gone, writing nothing: `rate_drop` takes them off the logs, once the caller's checks are all done (a claim
  -- reads several scopes' logs, and a later one may refuse it). Returns the most starts every window leaves (nil: no
  -- window), and, when one is full, when its oldest start ages out (the latest such time of the full windows; 0 when
  -- none is full); or nil, nil and the error reply.
  function rate_scan(script, windows, now)
    for _, w in ipairs(windows) do
      w.old, w.dropped = 0, 0
      while true do
        local e, bad = rate_entry(script, w.log, w.old)
        if bad then return nil, nil, bad end
        if not e or e.ms > now - w.window then
          w.oldest = e
          break
        end
        w.old, w.dropped = w.old + 1, w.dropped + e.count
      end
    end
    local free, retry_at = nil, 0
    for _, w in ipairs(windows) do
      if w.old > 0 then
        if w.oldest then
          w.total = math.max(0, w.total - w.dropped)
        else
          w.total, w.newest = 0, nil
        end
      end
      local left = w.limit - w.total
      if left <= 0 then
        -- When the oldest start in the window ages out (the window's whole length, if its log lost its entries).
        local due = now + w.window
        if w.oldest then due = w.oldest.ms + w.window end
        retry_at = math.max(retry_at, due)
      end
      if not free or left < free then free = left end
    end
    return free, retry_at
  end

  -- Takes off the logs what `rate_scan` counted as gone (once: a second call writes nothing), and writes each sum.
  function rate_drop(windows)
    for _, w in ipairs(windows) do
      if w.old and w.old > 0 then
        redis.call('LTRIM', w.log, w.old, -1)
        if w.oldest then
          redis.call('SET', w.sum, w.total, 'KEEPTTL')
        else
          redis.call('DEL', w.sum)
        end
        w.old = 0
      end
    end
  end

  -- `rate_scan`, then `rate_drop`: for a take whose checks are done.
  function rate_trim(script, windows, now)
    local free, retry_at, bad = rate_scan(script, windows, now)
    if bad then return nil, nil, bad end
    rate_drop(windows)
    return free, retry_at
  end

  -- When the throttle `key` (a handler's back-pressure, set by settle.lua with PX) ends, or nil when there is none:
  -- by its time to live rather than its value, so that a clock that stepped since it was set cannot stretch it; one
  -- set by hand without an expiry is looked at again every second. Shared by the queue's throttle (claim.lua,
  -- pop.lua) and a type's (types.lua).
  function throttle_until(key, now)
    local left = redis.call('PTTL', key)
    if left == -2 then return nil end
    if left < 0 then left = 1000 end
    return now + math.max(1, left)
  end

  -- Adds `k` starts at `now` to every window's log.
  function rate_spend(windows, k, now)
    for _, w in ipairs(windows) do
      local at, width = now, math.max(1, math.floor(w.window / 1000))
      if w.newest and w.newest.ms > at then at = w.newest.ms end
      if w.newest and w.newest.ms >= now - width then
        redis.call('LSET', w.log, -1, string.format('%d %d', at, w.newest.count + k))
      else
        redis.call('RPUSH', w.log, string.format('%d %d', at, k))
      end
      redis.call('SET', w.sum, w.total + k, 'PX', w.window + 1000)
      redis.call('PEXPIRE', w.log, w.window + 1000)
    end
  end
  rate = {entry = rate_entry, read = rate_read, scan = rate_scan, drop = rate_drop, trim = rate_trim,
    throttle_until = throttle_until, spend = rate_spend}
end
