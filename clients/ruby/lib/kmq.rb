# The Ruby producer client of kmqd: pushes tasks with kmqd's own enqueue script (push.lua, a byte-identical copy
# shipped in this gem) and shows, cancels and reads the results of tasks, as docs/PROTOCOL.md describes.
#
#   client = Kmq::Client.new("redis://127.0.0.1:6379/0", key_prefix: "kmq")
#   id = client.push("mail", "mail.send", { to: "ada@example.com" }, delay: 30)
require "digest/sha1"
require "json"
require "monitor"
require "openssl"
require "securerandom"
require "redis"
require_relative "kmq/version"

module Kmq
  # Every error this client raises. The subclasses say what happened.
  class Error < StandardError; end

  # push.lua refused tasks (it replied 0): a unique task with the id is live, or a delayed task with the id is
  # already waiting. Nothing was written for them; the batch's other tasks were pushed.
  class DuplicateError < Error
    # The refused ids, and every id of the call in order.
    attr_reader :ids, :all_ids

    def initialize(ids, all_ids)
      @ids = ids
      @all_ids = all_ids
      super("duplicate: #{ids.size} task(s) refused, their ids live: #{ids.join(', ')}")
    end
  end

  # The call was refused before anything was sent (no type, a bad group, a unique task without an id, ...).
  class InvalidArgument < Error; end

  # The queue has no level of that name (read from P:{Q}:meta; a queue no daemon described has "normal" only).
  class UnknownPriority < Error; end

  # push_flow refused the flow before anything was written: path names the node ("the root", "after[1].after[0]"),
  # reason what is wrong with it (a cycle, an id defined twice, a reference to a task the flow does not define...).
  class InvalidFlow < InvalidArgument
    attr_reader :path, :reason

    def initialize(path, reason)
      @path = path
      @reason = reason
      super("#{path}: #{reason}")
    end
  end

  # Redis could not be reached, or the connection failed before the command was written: nothing was pushed.
  class Unreachable < Error; end

  # The connection broke after the command was written, before its reply came: the tasks may have been pushed.
  # Push again with the same ids and unique: true to make a retry safe.
  class ReplyLost < Error; end

  # Redis answered with an error (a key of the wrong type, OOM, a missing ACL rule); push.lua and remove.lua write
  # nothing when they refuse. The message is Redis's.
  class Refused < Error; end

  # result's wait ended while the task was still waiting to run (delayed, retrying or ready) or running (in a
  # daemon's claim list, safe mode).
  class Pending < Error; end

  # result found neither a result nor the task: running in default mode, never pushed, never kept, or expired.
  class NoResult < Error; end

  # A Lua script sent with EVALSHA, and with EVAL when Redis answers NOSCRIPT (a restart, a failover).
  Script = Struct.new(:source, :sha) do
    def self.read(*files)
      source = files.map { |file| File.binread(File.join(__dir__, "kmq", file)) }.join
      new(source, Digest::SHA1.hexdigest(source))
    end
  end

  PUSH = Script.read("push.lua")
  # remove.lua runs with checks.lua and unique_hold.lua before it, as the broker concatenates them
  # (src/broker/mod.rs, `sources`).
  REMOVE = Script.read("checks.lua", "unique_hold.lua", "remove.lua")
  # flow_push.lua runs with checks.lua and deps.lua before it, as the broker sends it (src/broker/mod.rs, FLOW_PUSH).
  FLOW_PUSH = Script.read("checks.lua", "deps.lua", "flow_push.lua").then do |script|
    source = "#!lua\n#{script.source}"
    Script.new(source, Digest::SHA1.hexdigest(source))
  end
  # The fields a flow's node may have (docs/PROTOCOL.md, "Flows"); any other is refused, as `kmqd flow push` does.
  FLOW_FIELDS = %w[queue type id data priority if_failed after].freeze
  # A task of a pushed flow; generated_at: its path in the flow when its id was generated, else nil.
  FlowTask = Struct.new(:queue, :id, :generated_at)

  # push.lua advises under ~1,000 tasks a call (Redis runs nothing else meanwhile): one round trip per 1,000.
  BATCH_SIZE = 1000
  # How long a queue's levels, read from P:{Q}:meta, are trusted before they are read again.
  LEVELS_FOR = 10.0
  TRACEPARENT = /\A[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}\z/.freeze
  PUSH_OPTIONS = %i[id priority delay at unique group traceparent tracestate expires_at expires_in debounce
                    unique_for].freeze
  # The longest unique_for: push.lua takes, in ms: 12 digits (about 31 years).
  MAX_UNIQUE_FOR_MS = 999_999_999_999

  # Pushes to the queues of one Redis, or of a Redis Cluster. Safe to share between threads (calls take turns on
  # one connection).
  class Client
    # url: redis://[user:password@]host:port/db or rediss://, with any of redis-rb's options beside it
    # (ssl_params: { ca_file: ... } for TLS to a private CA; sentinels: [...] and role: :master for a master
    # Sentinels watch, the url then naming it: redis://mymaster); or cluster: the seed nodes' URLs of a Redis
    # Cluster (redis-rb's cluster client: each command goes to the master of its key's slot, following MOVED and
    # ASK); or redis: a Redis object of redis-rb 4.x made by the caller (a unix socket), not a cluster's. Every way
    # the client turns redis-rb's automatic reconnect-and-resend off: a command resent after a lost reply would
    # push its tasks twice.
    def initialize(url = nil, key_prefix: "kmq", redis: nil, cluster: nil, **redis_options)
      raise InvalidArgument, "give one of a url, redis: or cluster:" if [url, redis, cluster].compact.size > 1

      @redis = if cluster
                 connect_cluster(cluster, redis_options)
               else
                 redis || Redis.new(url: url || "redis://127.0.0.1:6379/0", **redis_options, reconnect_attempts: 0)
               end
      if @redis._client.is_a?(Redis::Cluster)
        # Its nodes' connections are made inside it, each with the options it was made with.
        if redis
          raise InvalidArgument, "a Redis Cluster's Redis object: give cluster: [seed URLs] instead, so that the " \
                                 "client makes it with reconnect_attempts: 0 (no command resent after a lost reply)"
        end
      else
        @redis._client.options[:reconnect_attempts] = 0
      end
      @prefix = key_prefix
      @levels = {}
      @lock = Monitor.new
      @last_used = nil
    end

    def close
      @redis.close
    end

    # Pushes one task; returns its id. Options: id:, priority:, delay: (seconds), at: (a Time), unique:, group:,
    # traceparent:, tracestate: (without them, the current OpenTelemetry context's when opentelemetry-api is
    # loaded), expires_at:, expires_in:, debounce: (seconds), unique_for: (seconds: unique, and the id stays held
    # that long after its task ended). Raises DuplicateError when a unique id is live or held.
    def push(queue, type, data = nil, **options)
      push_batch(queue, [[type, data, options]]).first
    rescue DuplicateError => e
      raise DuplicateError.new(e.ids, e.all_ids), "duplicate: queue #{queue.inspect}: task #{e.ids.first.inspect} " \
                                                  "is live (unique) or already delayed"
    end

    # Pushes tasks in order, each [type, data] or [type, data, {options}] (or a Hash with type:, data: and the
    # options), one push.lua call per 1,000 tasks of the same level and delay; returns their ids. Every task is
    # checked before anything is sent. Refused duplicates raise DuplicateError (the others were pushed).
    def push_batch(queue, tasks)
      check_queue(queue)
      @lock.synchronize do
        tasks = tasks.map { |task| normalized(task) }
        levels = levels_of(queue, tasks.map { |task| task[2][:priority] }.compact)
        # An expiry given as a length is a time on Redis's clock (docs/PROTOCOL.md, "Expiry"): TIME on the queue's
        # node, once a batch and only when a task of it needs it.
        now = (redis_now if tasks.any? { |task| task[2][:expires_in] })
        trace = current_trace
        prepared = tasks.each_with_index.map do |task, n|
          prepare(*task, levels, now, trace: trace)
        rescue InvalidArgument, UnknownPriority => e
          raise e.class, (tasks.size > 1 ? "task #{n} of the batch: #{e.message}" : e.message)
        end
        refused = push_prepared(queue, prepared)
        ids = prepared.map { |task| task[:id] }
        raise DuplicateError.new(refused, ids) unless refused.empty?

        ids
      end
    end

    # Pushes a flow (docs/PROTOCOL.md, "Flows"): flow is the flow's JSON (its text, or a Hash), one task with the
    # tasks it waits for nested in "after". It is checked whole before anything is written, as `kmqd flow push`
    # checks it (InvalidFlow names the node); its waiting tasks are then written with flow_push.lua, a queue at a
    # time, 1,000 a call, and last the tasks that wait for nothing are pushed, so that no task can end before the
    # tasks waiting for it exist. dead_max and keep (seconds) are what a daemon takes from the waiting tasks'
    # queue's config (dead_max, keep_results; ten minutes without it). Returns every task (FlowTask), root first.
    def push_flow(flow, dead_max: 10_000, keep: 600)
      flow = begin
        flow.is_a?(String) ? JSON.parse(flow) : JSON.parse(JSON.generate(flow))
      rescue JSON::ParserError, JSON::GeneratorError => e
        raise InvalidFlow.new("the root", "the flow is not JSON: #{e.message}")
      end
      keep_ms = (keep * 1000).round
      unless dead_max.is_a?(Integer) && dead_max >= 0 && keep_ms >= 1
        raise InvalidArgument, "dead_max #{dead_max.inspect} or keep #{keep.inspect}: a count and a positive time"
      end

      @lock.synchronize do
        nodes = []
        references = []
        raise InvalidFlow.new("the root", "a flow's root is a task (queue and type), not a reference") unless
          read_flow_node(flow, "the root", nodes, references)

        plan_flow(nodes, references).then { |plan| write_flow(plan, dead_max, keep_ms) }
        nodes.map { |node| FlowTask.new(node[:queue], node[:id], node[:generated] ? node[:path] : nil) }
      end
    end

    private

    # Checks the read nodes whole (ids defined once, references defined, no cycle, no task waiting for one twice)
    # and plans the writes: the queues in the flow's order, each with its waiting tasks and its other tasks.
    def plan_flow(nodes, references)
      defined = {}
      nodes.each_with_index do |node, at|
        name = [node[:queue], node[:id]]
        if defined.key?(name)
          raise InvalidFlow.new(node[:path], "task #{name.join('/')} is defined twice (first at " \
                                             "#{nodes[defined[name]][:path]}); to wait for one task twice, refer " \
                                             'to it with {"queue": ..., "id": ...} only')
        end
        defined[name] = at
      end
      references.each do |path, name|
        raise InvalidFlow.new(path, "refers to task #{name.join('/')}, which the flow does not define") unless
          defined.key?(name)
      end
      check_acyclic(nodes, defined)
      up = Hash.new { |hash, name| hash[name] = [] }
      nodes.each do |node|
        node[:deps].each do |dep|
          waiter = { "queue" => node[:queue], "id" => node[:id] }
          if up[dep].include?(waiter)
            raise InvalidFlow.new(node[:path], "task #{node[:queue]}/#{node[:id]} waits for #{dep.join('/')} twice")
          end

          up[dep] << waiter
        end
      end
      plan = Hash.new { |hash, queue| hash[queue] = { waiting: [], leaves: [] } }
      nodes.each do |node|
        waiters = up.fetch([node[:queue], node[:id]], [])
        envelope = { "id" => node[:id], "type" => node[:type], "data" => node[:data], "attempt" => 0 }
        envelope["priority"] = node[:priority] if node[:priority]
        envelope["waiters"] = waiters unless waiters.empty?
        payload = JSON.generate(envelope)
        if node[:deps].empty?
          plan[node[:queue]][:leaves] << { id: node[:id], options: "0", payload: payload, call: [node[:level], 0, 0] }
        else
          plan[node[:queue]][:waiting] << [node, payload, JSON.generate(waiters)]
        end
      end
      plan
    end

    # Writes a planned flow: every queue's waiting tasks (flow_push.lua, 1,000 a call), then every queue's tasks
    # that wait for nothing (push.lua, a level at a time).
    def write_flow(plan, dead_max, keep_ms)
      plan.each do |queue, writes|
        writes[:waiting].each_slice(BATCH_SIZE) do |chunk|
          keys = %w[deps-waiting wake dead stats deps-outbox].map { |k| key(queue, k) }
          argv = [queue, dead_max, keep_ms]
          chunk.each do |node, payload, waiters|
            keys.push(key(queue, "deps:#{node[:id]}"), key(queue, "deps-ended:#{node[:id]}"),
                      key(queue, "ready:#{node[:level]}"))
            argv.push(node[:id], node[:type], payload, node[:if_failed], node[:deps].size,
                      JSON.generate(node[:deps]), waiters)
          end
          replies = run(FLOW_PUSH, keys, argv)
          raise Error, "flow_push.lua answered #{replies.inspect} for #{chunk.size} tasks" unless
            replies.is_a?(Array) && replies.size == chunk.size
        end
      end
      plan.each do |queue, writes|
        levels = levels_of(queue, [])[:levels]
        # Stable: a level's tasks keep the flow's order.
        push_prepared(queue, writes[:leaves].each_with_index.sort_by { |task, n| [levels.index(task[:call][0]) || levels.size, n] }
                                            .map(&:first))
      end
    end

    # Reads the node raw at path and, depth first, what it waits for into nodes; a reference goes to references.
    # Returns the task it names as [queue, id] (nil for a reference at the root).
    def read_flow_node(raw, path, nodes, references)
      raise InvalidFlow.new(path, "a node is a JSON object") unless raw.is_a?(Hash)

      unknown = raw.keys - FLOW_FIELDS
      unless unknown.empty?
        raise InvalidFlow.new(path, "unknown field #{unknown.first.inspect}; a node has #{FLOW_FIELDS.join(', ')}")
      end
      %w[queue type id priority if_failed].each do |field|
        raise InvalidFlow.new(path, "#{field.inspect} is not a string") unless raw[field].nil? || raw[field].is_a?(String)
      end
      after = raw["after"] || []
      raise InvalidFlow.new(path, '"after" is not a list of nodes') unless after.is_a?(Array)

      queue = raw["queue"]
      raise InvalidFlow.new(path, 'no "queue"') if queue.nil? || queue.empty?

      if raw["type"].nil?
        # A reference: a queue and an id, nothing else.
        unless raw["id"]
          raise InvalidFlow.new(path, 'no "type" (a task needs one; a reference to a task defined elsewhere needs an "id")')
        end
        if !raw["data"].nil? || raw["priority"] || raw["if_failed"] || !after.empty?
          raise InvalidFlow.new(path, "no \"type\", so this refers to task #{queue}/#{raw['id']}: a reference has " \
                                      'only "queue" and "id"')
        end
        references << [path, [queue, raw["id"]]]
        return path == "the root" ? nil : [queue, raw["id"]]
      end
      raise InvalidFlow.new(path, '"type" is empty') if raw["type"].empty?

      if_failed = raw["if_failed"] || "fail"
      unless %w[fail continue].include?(if_failed)
        raise InvalidFlow.new(path, "if_failed #{if_failed.inspect} is neither \"fail\" (the default) nor \"continue\"")
      end
      begin
        check_queue(queue)
      rescue InvalidArgument => e
        raise InvalidFlow.new(path, e.message)
      end
      shape = levels_of(queue, [raw["priority"]].compact)
      priority = raw["priority"]
      if priority && !shape[:levels].include?(priority)
        raise InvalidFlow.new(path, "queue #{queue.inspect} has no priority #{priority.inspect}; its levels are " \
                                    "#{shape[:levels].join(', ')}")
      end
      raise InvalidFlow.new(path, '"id" is empty') if raw["id"] == ""

      node = { queue: queue, type: raw["type"], id: raw["id"] || SecureRandom.uuid, data: raw["data"],
               level: priority || shape[:fallback], if_failed: if_failed, priority: priority, deps: [], path: path,
               generated: raw["id"].nil? }
      nodes << node
      after.each_with_index do |dep, n|
        node[:deps] << read_flow_node(dep, path == "the root" ? "after[#{n}]" : "#{path}.after[#{n}]", nodes, references)
      end
      [queue, node[:id]]
    end

    # Refuses a cycle through references: a depth-first walk from every node (white, grey, black), in the order
    # `kmqd flow push` walks, so that both name the same node.
    def check_acyclic(nodes, defined)
      state = Array.new(nodes.size, 0)
      nodes.each_index do |start|
        stack = [[start, 0]]
        until stack.empty?
          at, following = stack.pop
          if following.zero?
            next if state[at] == 2

            state[at] = 1
          end
          dep_name = nodes[at][:deps][following]
          if dep_name.nil?
            state[at] = 2
            next
          end
          stack << [at, following + 1]
          dep = defined[dep_name]
          if state[dep] == 1
            d, w = nodes[dep], nodes[at]
            raise InvalidFlow.new(d[:path], "task #{d[:queue]}/#{d[:id]} waits for itself through " \
                                            "#{w[:queue]}/#{w[:id]} (a cycle); a flow must end")
          end
          stack << [dep, 0] if state[dep].zero?
        end
      end
    end

    # push.lua calls for checked tasks, one per 1,000 in a row of the same level and due time; returns the ids
    # push.lua refused.
    def push_prepared(queue, prepared)
      refused = []
      start = 0
      while start < prepared.size
        finish = start + 1
        finish += 1 while finish < prepared.size && finish - start < BATCH_SIZE &&
                          prepared[finish][:call] == prepared[start][:call]
        begin
          replies = push_call(queue, prepared[start...finish])
        rescue Error => e
          raise e.class, "after #{start} of #{prepared.size} tasks were pushed: #{e.message}" if start.positive?

          raise
        end
        replies.each_with_index { |reply, i| refused << prepared[start + i][:id] unless reply == 1 }
        start = finish
      end
      refused
    end

    public

    # Every place the task is in: delayed, retrying, ready (its list, or its group's flow), processing (a daemon's
    # claim lists, safe mode) and dead, each a Hash ("state", "level", "position", "group", "due_in_ms", "owner",
    # "token", "lease_left_ms", "envelope", "record"), as `kmqd task show` finds them.
    def show(queue, id)
      check_queue(queue)
      @lock.synchronize { locate(queue, id, dead: true).map { |place| place.reject { |k, _| k == "holder" } } }
    end

    # Removes every waiting copy (delayed, retrying, ready) of the task, releasing its unique id, with kmqd's
    # remove.lua; returns how many it removed (0: not waiting: unknown, running, done or dead).
    def cancel(queue, id)
      check_queue(queue)
      @lock.synchronize do
        locate(queue, id, dead: false).sum do |place|
          holder, kind, task, expected =
            case place["state"]
            when "delayed" then [key(queue, "delayed:#{place['level']}"), "delayed", id, place["envelope"]]
            when "retrying" then [key(queue, "retry:#{place['level']}"), "retry", place["envelope"], ""]
            else [place["holder"], "list", place["envelope"], ""]
            end
          unique = (JSON.parse(place["envelope"])["unique"] == true rescue false) ? id : ""
          keys = [holder, key(queue, "delayed-tasks"), key(queue, "unique"), key(queue, "stats")]
          run(REMOVE, keys, [kind, task, expected, unique])
        end
      end
    end

    # The task's result (docs/PROTOCOL.md, "Results"), polling up to wait seconds (10 ms doubling to 500 ms): a
    # Hash with "state" ("done" or "dead"), "result", "result_error", "reason", "ended_at". When the wait ends
    # without one: a dead-lettered task gives "state" => "dead" and its record's reason; a waiting or running task
    # raises Pending; a task found nowhere raises NoResult.
    def result(queue, id, wait: 0)
      check_queue(queue)
      deadline = monotonic + wait
      pause = 0.01
      loop do
        kept = @lock.synchronize { kept_result(queue, id) }
        return JSON.parse(kept) if kept

        left = deadline - monotonic
        break if left <= 0

        sleep([pause, left].min)
        pause = [pause * 2, 0.5].min
      end
      found = @lock.synchronize { locate(queue, id, dead: true) }
      waiting = found.find { |place| place["state"] != "dead" }
      raise Pending, "queue #{queue.inspect}: task #{id.inspect} is #{waiting['state']}" if waiting
      raise NoResult, "queue #{queue.inspect}: task #{id.inspect}: no result and no task" if found.empty?

      record = JSON.parse(found.first["record"]) rescue {}
      { "state" => "dead", "reason" => record["reason"], "ended_at" => record["dead_at"] }
    end

    private

    def key(queue, rest)
      "#{@prefix}:{#{queue}}:#{rest}"
    end

    def check_queue(queue)
      return if queue.is_a?(String) && !queue.empty? && !queue.match?(/[{}]/)

      raise InvalidArgument, "queue name #{queue.inspect}: must be a non-empty string without { or }"
    end

    def normalized(task)
      case task
      when Hash
        task = task.transform_keys(&:to_sym)
        [task[:type], task[:data], task.reject { |k, _| %i[type data].include?(k) }]
      when Array
        [task[0], task[1], (task[2] || {}).transform_keys(&:to_sym)]
      else
        raise InvalidArgument, "a task is [type, data, {options}] or a Hash, not #{task.class}"
      end
    end

    # The current OpenTelemetry context's W3C fields, through the application's propagator, when the
    # opentelemetry-api gem is loaded (the gem is not a dependency: a program that traces has it, and its SDK sets
    # the propagator); {} otherwise, or when no span is current.
    def current_trace
      return {} unless defined?(::OpenTelemetry) && ::OpenTelemetry.respond_to?(:propagation)

      carrier = {}
      ::OpenTelemetry.propagation.inject(carrier)
      carrier.slice("traceparent", "tracestate")
    end

    # trace: the current context's fields (current_trace), for a task given no traceparent: of its own.
    def prepare(type, data, options, levels, now = nil, trace: {})
      unknown = options.keys - PUSH_OPTIONS
      raise InvalidArgument, "unknown option(s) #{unknown.join(', ')}" unless unknown.empty?
      raise InvalidArgument, "a task needs a type" unless type.is_a?(String) && !type.empty?

      group = options[:group]
      unless group.nil? || (group.is_a?(String) && group.bytesize.between?(1, 64) && group.valid_encoding?)
        raise InvalidArgument, "group #{group.inspect}: must be 1 to 64 bytes of UTF-8"
      end
      id = options[:id]
      # A hold after the task ended is a kind of uniqueness: the id must be free to be pushed at all.
      unique = options[:unique] || !options[:unique_for].nil?
      raise InvalidArgument, "a unique task needs an id (uniqueness is per id)" if unique && id.nil?

      delay = options[:delay] || 0
      raise InvalidArgument, "delay #{delay.inspect}: seconds, not negative" unless delay.is_a?(Numeric) && delay >= 0

      at = options[:at]
      raise InvalidArgument, "at #{at.inspect}: a Time" unless at.nil? || at.is_a?(Time)

      # push.lua's OPTIONS_n (docs/PROTOCOL.md, "Debounce, and unique for a time"): "1" for unique, as older copies
      # of the script read it, "unique_for=MS" (unique, and the id held MS after its task ended), or "debounce",
      # whose delay is the task's.
      flags = unique ? "1" : "0"
      unless (unique_for = options[:unique_for]).nil?
        hold = unique_for.is_a?(Numeric) ? (unique_for * 1000).round : 0
        raise InvalidArgument, "unique_for #{unique_for.inspect}: seconds, 0.001 to #{MAX_UNIQUE_FOR_MS / 1000}" unless
          hold.between?(1, MAX_UNIQUE_FOR_MS)

        flags = "unique_for=#{hold}"
      end
      if (debounce = options[:debounce])
        if id.nil? || unique || options[:delay] || at
          raise InvalidArgument, "debounce: give an id, and neither unique, unique_for, delay nor at (it is the delay)"
        end
        raise InvalidArgument, "debounce #{debounce.inspect}: seconds, positive" unless
          debounce.is_a?(Numeric) && (debounce * 1000).round.positive?

        delay = debounce
        flags = "debounce"
      end

      traceparent, tracestate = options[:traceparent], options[:tracestate]
      traceparent, tracestate = trace["traceparent"], trace["tracestate"] if traceparent.nil?
      if traceparent && !TRACEPARENT.match?(traceparent)
        raise InvalidArgument, "traceparent #{traceparent.inspect} is not a W3C trace context"
      end
      priority = options[:priority]
      if priority && !levels[:levels].include?(priority)
        raise UnknownPriority, "#{priority.inspect}: the queue's levels are #{levels[:levels].join(', ')}"
      end

      id ||= SecureRandom.uuid
      envelope = { "id" => id, "type" => type, "data" => data, "attempt" => 0 }
      envelope["priority"] = priority if priority
      envelope["unique"] = true if unique
      envelope["group"] = group if group
      expires_at = expiry(options[:expires_at], options[:expires_in], now)
      envelope["expires_at"] = expires_at if expires_at
      envelope["traceparent"] = traceparent if traceparent
      envelope["tracestate"] = tracestate if tracestate
      begin
        payload = JSON.generate(envelope)
      rescue JSON::GeneratorError, Encoding::UndefinedConversionError => e
        raise InvalidArgument, "data of task #{type.inspect}: #{e.message}"
      end
      at_ms = at ? [(at.to_r * 1000).floor, 1].max : 0 # push.lua reads 0 as "no due time"
      { id: id, options: flags, payload: payload,
        call: [priority || levels[:fallback], (delay * 1000).round, at_ms] }
    end

    # The envelope's expires_at (ms since the epoch on Redis's clock): from expires_at (a Time, or ms since the
    # epoch) or expires_in (seconds after Redis's now, in ms); nil for neither.
    def expiry(expires_at, expires_in, now)
      raise InvalidArgument, "give expires_at: or expires_in:, not both" if expires_at && expires_in

      if expires_at
        ms = expires_at.is_a?(Time) ? (expires_at.to_r * 1000).floor : expires_at
        raise InvalidArgument, "expires_at #{expires_at.inspect}: a Time or ms since the epoch" unless
          ms.is_a?(Integer) && ms.positive?

        return ms
      end
      return nil unless expires_in
      raise InvalidArgument, "expires_in #{expires_in.inspect}: seconds, positive" unless
        expires_in.is_a?(Numeric) && expires_in.positive?

      now + (expires_in * 1000).round
    end

    def redis_now
      seconds, micros = command(["TIME"]).map(&:to_i)
      seconds * 1000 + micros / 1000
    end

    def push_call(queue, tasks)
      level, delay_ms, at_ms = tasks.first[:call]
      keys = %W[ready:#{level} delayed:#{level} delayed-tasks wake unique stats routes].map { |k| key(queue, k) }
      argv = [delay_ms, at_ms, key(queue, "delay-wake")]
      tasks.each { |task| argv.push(task[:id], task[:options], task[:payload]) }
      replies = run(PUSH, keys, argv)
      raise Error, "push.lua answered #{replies.inspect} for #{tasks.size} tasks" unless replies.size == tasks.size

      replies
    rescue Refused => e
      raise Refused, "queue #{queue.inspect}: push.lua: #{e.message}"
    end

    # The queue's levels from P:{Q}:meta (`levels`, highest first, `default_priority`), cached for LEVELS_FOR
    # seconds, and read again at once for a priority the cache lacks.
    def levels_of(queue, wanted)
      cached = @levels[queue]
      if cached && monotonic - cached[:read] < LEVELS_FOR && (wanted - cached[:levels]).empty?
        return cached
      end

      listed, default = read_meta(queue)
      levels = listed.to_s.empty? ? ["normal"] : listed.split(",")
      fallback = levels.include?("normal") ? "normal" : levels.first
      fallback = default if default && levels.include?(default)
      @levels[queue] = { levels: levels, fallback: fallback, read: monotonic }
    end

    # The meta hash's `levels` and `default_priority`, with HGET, one field at a time: the producers' ACL rules
    # allow it (docs/OPERATIONS.md, "ACL rules"), not HMGET. A producer user of an older kmqd's rules may not read
    # the meta hash: it pushes as to a queue of the one level normal, as it did before queues described theirs.
    def read_meta(queue)
      %w[levels default_priority].map { |field| command(["HGET", key(queue, "meta"), field]) }
    rescue Refused => e
      raise unless e.message.start_with?("NOPERM")

      [nil, nil]
    end

    # The kept result's JSON text, or nil: the buckets the queue's index lists, newest first, each asked for the
    # id until one holds it (docs/PROTOCOL.md, "Results").
    def kept_result(queue, id)
      command(["ZRANGE", key(queue, "results"), "0", "-1", "REV"]).each do |start|
        kept = command(["HGET", key(queue, "results:#{start}"), id])
        return kept if kept
      end
      nil
    end

    def locate(queue, id, dead:)
      levels = levels_of(queue, [])[:levels]
      now = redis_now
      found = []
      envelope = command(["HGET", key(queue, "delayed-tasks"), id])
      if envelope
        levels.each do |level|
          due = command(["ZSCORE", key(queue, "delayed:#{level}"), id])
          next unless due

          found << { "state" => "delayed", "level" => level, "due_in_ms" => due.to_i - now, "envelope" => envelope }
          break
        end
      end
      needle = JSON.generate(id)[1..-2]
      levels.each do |level|
        cursor = "0"
        loop do
          cursor, items = command(["ZSCAN", key(queue, "retry:#{level}"), cursor, "MATCH",
                                   "*#{needle.gsub(/([*?\[\]\\])/) { "\\#{Regexp.last_match(1)}" }}*", "COUNT", 1000])
          items.each_slice(2) do |item, due|
            next unless envelope_id(item) == id

            found << { "state" => "retrying", "level" => level, "due_in_ms" => due.to_i - now, "envelope" => item }
          end
          break if cursor == "0"
        end
      end
      levels.each do |level|
        ready = key(queue, "ready:#{level}")
        scan_list(ready) do |position, item|
          next unless item.include?(needle) && envelope_id(item) == id

          found << { "state" => "ready", "level" => level, "position" => position, "envelope" => item, "holder" => ready }
        end
        command(["ZRANGE", key(queue, "ring:#{level}"), 0, -1]).each do |member|
          group = member.split(":", 2).first.gsub(/%([0-9A-F]{2})/) { Regexp.last_match(1).hex.chr }
          flow = key(queue, "flow:#{level}:#{member}")
          scan_list(flow) do |position, item|
            next unless item.include?(needle) && envelope_id(item) == id

            found << { "state" => "ready", "level" => level, "position" => position, "group" => group,
                       "envelope" => item, "holder" => flow }
          end
        end
      end
      if dead
        locate_processing(queue, id, levels, now, needle, found)
        scan_list(key(queue, "dead")) do |_, record|
          found << { "state" => "dead", "record" => record } if envelope_id(record) == id
        end
      end
      found
    end

    # The task in the daemons' claim lists (safe mode; docs/PROTOCOL.md, "Key layout", processing:OWNER:L:C), as
    # `kmqd task show` finds it: for each owner of the owners set and each level, each claim's list, leaving out the
    # positions its settled bitmap marks (a hash token => envelope for an owner of kmqd 0.1).
    def locate_processing(queue, id, levels, now, needle, found)
      command(["ZRANGE", key(queue, "owners"), 0, -1, "WITHSCORES"]).each_slice(2) do |owner, deadline|
        place = { "state" => "processing", "owner" => owner, "lease_left_ms" => deadline.to_f.to_i - now }
        levels.each do |level|
          claims = key(queue, "processing:#{owner}:#{level}")
          case command(["TYPE", claims])
          when "hash"
            command(["HGETALL", claims]).each_slice(2) do |token, item|
              found << place.merge("level" => level, "token" => token, "envelope" => item) if envelope_id(item) == id
            end
          when "zset"
            command(["ZRANGE", claims, 0, -1]).each do |claim|
              list = "#{claims}:#{claim}"
              settled = (command(["GET", "#{list}:settled"]) || "").b
              scan_list(list) do |position, item|
                next if (settled.getbyte(position >> 3) || 0)[7 - (position & 7)] == 1
                next unless item.include?(needle) && envelope_id(item) == id

                found << place.merge("level" => level, "token" => "#{claim}.#{position}", "envelope" => item)
              end
            end
          end
        end
      end
    end

    def scan_list(list)
      start = 0
      loop do
        items = command(["LRANGE", list, start, start + 999])
        items.each_with_index { |item, offset| yield start + offset, item }
        return if items.size < 1000

        start += 1000
      end
    end

    def envelope_id(payload)
      parsed = JSON.parse(payload)
      parsed.is_a?(Hash) ? parsed["id"] : nil
    rescue JSON::ParserError
      nil
    end

    def run(script, keys, argv)
      command(["EVALSHA", script.sha, keys.size, *keys, *argv])
    rescue Refused => e
      raise unless e.message.start_with?("NOSCRIPT")

      command(["EVAL", script.source, keys.size, *keys, *argv])
    end

    # Sends one command and reads its reply, telling a failure before the command was written (Unreachable:
    # nothing ran) from one after it (ReplyLost: it may have run). Redis's error replies raise Refused. A connection idle for a while is checked with a PING first, so that one Redis or a
    # proxy closed meanwhile fails before a push is written on it, not as a lost reply.
    def command(args)
      @lock.synchronize do
        client = @redis._client
        client.is_a?(Redis::Cluster) ? cluster_command(client, args) : command_on(client, args)
      end
    end

    # How long a command a cluster answers TRYAGAIN is sent again: while a slot migrates, a script whose keys are
    # partly moved runs on neither side until the migration of the slot's keys ends, which takes moments.
    TRY_AGAIN_FOR = 10.0

    # A command on a Redis Cluster, through redis-rb's cluster client, which sends it to the master of its key's
    # slot (TIME, which names no key, to any master) and follows MOVED and ASK, and never resends after a broken
    # connection (its nodes have reconnect_attempts: 0). It does not say whether a connection broke before or after
    # the command was written, so only a failure to connect is Unreachable and any other ReplyLost. A TRYAGAIN
    # (nothing ran) is sent again, up to TRY_AGAIN_FOR.
    def cluster_command(cluster, args)
      pause = 0.01
      give_up = monotonic + TRY_AGAIN_FOR
      begin
        cluster.call(args)
      rescue Redis::CommandError => e
        if e.message.start_with?("TRYAGAIN") && monotonic + pause < give_up
          sleep pause
          pause = [pause * 2, 0.5].min
          retry
        end
        raise Refused, e.message
      rescue Redis::CannotConnectError => e
        raise Unreachable, "#{args.first}: #{e.message}"
      rescue OpenSSL::SSL::SSLError => e
        # OpenSSL's, not redis-rb's: SSL_connect's is a handshake that failed, before anything was written.
        raise (e.message.include?("SSL_connect") ? Unreachable : ReplyLost), "#{args.first}: #{e.message}"
      rescue Redis::BaseConnectionError => e
        raise ReplyLost, "#{args.first}: #{e.message}"
      end
    end

    # redis-rb's cluster client reads the slot map as it is made: a seed that cannot be reached is Unreachable.
    def connect_cluster(seeds, options)
      Redis.new(cluster: seeds, **options, reconnect_attempts: 0)
    rescue Redis::CannotConnectError, Redis::BaseConnectionError => e
      raise Unreachable, "the cluster's seeds #{seeds.inspect}: #{e.message}"
    end

    def command_on(client, args)
      if client.connected? && @last_used && monotonic - @last_used > 5
        begin
          client.call(["PING"])
        rescue Redis::BaseConnectionError
          client.disconnect
        end
      end
      written = false
      reply = begin
        client.process([args]) do
          written = true
          client.read
        end
      rescue Redis::BaseConnectionError, OpenSSL::SSL::SSLError => e
        # A TLS handshake that fails (a certificate not trusted) is OpenSSL's error, not redis-rb's.
        raise (written ? ReplyLost : Unreachable), "#{args.first}: #{e.message}"
      end
      @last_used = monotonic
      raise Refused, reply.message if reply.is_a?(Redis::CommandError)

      reply
    end

    def monotonic
      Process.clock_gettime(Process::CLOCK_MONOTONIC)
    end
  end
end
