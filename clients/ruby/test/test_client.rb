require_relative "support"

class ClientTest < Minitest::Test
  def setup
    @server = Support::RedisServer.new
    @client = Kmq::Client.new(@server.url)
  end

  def teardown
    @client.close
    @server.stop
  end

  def redis = @server.redis

  # The scripts this gem ships are the broker's, byte for byte (scripts/test also compares them with cmp).
  def test_shipped_scripts_are_the_brokers_byte_for_byte
    %w[push.lua checks.lua remove.lua unique_hold.lua deps.lua flow_push.lua].each do |name|
      theirs = File.join(__dir__, "..", "..", "..", "src", "broker", "scripts", name)
      skip "not in a kmqd checkout" unless File.exist?(theirs)
      assert_equal File.binread(theirs), File.binread(File.join(__dir__, "..", "lib", "kmq", name)),
                   "clients/ruby/lib/kmq/#{name} differs from src/broker/scripts/#{name}: copy it again"
    end
  end

  def test_push_writes_the_envelope_and_returns_the_given_id
    id = @client.push("mail", "mail.send", { to: "a<b>" }, id: "order-1",
                      traceparent: "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", tracestate: "k=v")
    assert_equal "order-1", id
    envelope = JSON.parse(redis.lindex("kmq:{mail}:ready:normal", 0))
    assert_equal({ "to" => "a<b>" }, envelope["data"])
    assert_equal "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", envelope["traceparent"]
    assert_equal "k=v", envelope["tracestate"]
    assert_kind_of Integer, envelope["created_at"]
  end

  def test_a_unique_push_of_a_live_id_raises_duplicate_error
    @client.push("mail", "mail.send", nil, id: "w-1", unique: true)
    error = assert_raises(Kmq::DuplicateError) { @client.push("mail", "mail.send", nil, id: "w-1", unique: true) }
    assert_equal ["w-1"], error.ids
    error = assert_raises(Kmq::DuplicateError) do
      @client.push_batch("mail", [["a", nil, { id: "w-2", unique: true }], { type: "a", id: "w-1", unique: true }])
    end
    assert_equal ["w-1"], error.ids
    assert_equal %w[w-2 w-1], error.all_ids
    assert_equal 2, redis.llen("kmq:{mail}:ready:normal")
  end

  def test_a_unique_for_push_of_an_id_held_after_its_task_ended_raises_duplicate_error
    # The hold key stands for a task of w-1 that ended less than its window ago (docs/PROTOCOL.md, "Debounce, and
    # unique for a time"): push.lua refuses every unique push of w-1 while it exists.
    redis.set("kmq:{mail}:unique:held:w-1", "1765000000000", px: 600_000)
    assert_raises(Kmq::DuplicateError) { @client.push("mail", "t", nil, id: "w-1", unique_for: 3600) }
    assert_raises(Kmq::DuplicateError) { @client.push("mail", "t", nil, id: "w-1", unique: true) }
    assert_equal 0, redis.llen("kmq:{mail}:ready:normal")
    redis.del("kmq:{mail}:unique:held:w-1")
    assert_equal "w-1", @client.push("mail", "t", nil, id: "w-1", unique_for: 3600)
    assert_equal true, JSON.parse(redis.lindex("kmq:{mail}:ready:normal", 0))["unique"]
    assert_match(/\A\d+:3600000\z/, redis.hget("kmq:{mail}:unique", "w-1"))
  end

  def test_bad_arguments_are_refused_with_nothing_written
    {
      "empty group" => { group: "" },
      "group over 64 bytes" => { group: "g" * 65 },
      "unique without id" => { unique: true },
      "bad traceparent" => { traceparent: "nope" },
      "negative delay" => { delay: -1 },
      "unknown option" => { unique_till: 5 },
      "unique_for without id" => { unique_for: 5 },
      "unique_for 0" => { id: "u", unique_for: 0 },
      "unique_for too long" => { id: "u", unique_for: 1e9 },
      "debounce and unique_for" => { id: "d", debounce: 5, unique_for: 5 },
      "debounce without id" => { debounce: 5 },
      "debounce and delay" => { id: "d", debounce: 5, delay: 1 },
      "expiry both ways" => { expires_at: Time.now + 60, expires_in: 60 },
      "expiry not positive" => { expires_in: 0 },
    }.each do |what, options|
      assert_raises(Kmq::InvalidArgument, what) { @client.push("mail", "mail.send", nil, **options) }
    end
    assert_raises(Kmq::InvalidArgument) { @client.push("mail", "", nil) }
    assert_raises(Kmq::InvalidArgument) { @client.push("mail", "t", { n: Float::NAN }) }
    assert_raises(Kmq::UnknownPriority) { @client.push("mail", "t", nil, priority: "urgent") }
    assert_equal [], redis.keys("*")
  end

  def test_priority_levels_are_read_from_the_queues_meta
    redis.hset("kmq:{mail}:meta", "protocol", "1", "levels", "high,low", "default_priority", "low")
    @client.push("mail", "t", nil, priority: "high")
    @client.push("mail", "t")
    assert_equal [1, 1], [redis.llen("kmq:{mail}:ready:high"), redis.llen("kmq:{mail}:ready:low")]
    # The rule of every client (docs/CLIENTS.md): a priority the kept levels lack reads them again before it is
    # refused, so a level an operator adds is known at the first push that names it.
    redis.hset("kmq:{mail}:meta", "levels", "urgent,high,low")
    @client.push("mail", "t", nil, priority: "urgent")
    assert_equal 1, redis.llen("kmq:{mail}:ready:urgent")
    assert_raises(Kmq::UnknownPriority) { @client.push("mail", "t", nil, priority: "normal") }
  end

  def test_redis_unreachable_raises_unreachable
    client = Kmq::Client.new("redis://127.0.0.1:#{Support.free_port}/0")
    assert_raises(Kmq::Unreachable) { client.push("mail", "mail.send") }
  end

  # A connection that breaks after push.lua was written is "may have been pushed", and the task is in fact there.
  def test_a_reply_lost_after_the_command_was_written_raises_reply_lost
    proxy = Support::ReplyDropper.new(@server.port)
    client = Kmq::Client.new(proxy.url)
    client.push("mail", "warm.up") # loads the levels
    proxy.arm!
    assert_raises(Kmq::ReplyLost) { client.push("mail", "mail.send", nil, id: "lost-1") }
    Support.eventually(10, "the task whose reply was lost is in the ready list") do
      redis.llen("kmq:{mail}:ready:normal") == 2
    end
    assert_equal 1, redis.lrange("kmq:{mail}:ready:normal", 0, -1).count { |e| e.include?("lost-1") }
  ensure
    proxy&.stop
  end

  def test_noscript_falls_back_to_eval
    @client.push("mail", "a")
    redis.script(:flush)
    @client.push("mail", "b")
    assert_equal 2, redis.llen("kmq:{mail}:ready:normal")
  end

  def test_a_batch_makes_one_push_call_per_1000_tasks
    ids = @client.push_batch("mail", (0...2500).map { |n| ["n", n] })
    assert_equal 2500, ids.size
    assert_equal "3", redis.info("commandstats")["evalsha"]["calls"]
    last = redis.lindex("kmq:{mail}:ready:normal", -1)
    assert_equal [ids.last, 2499], JSON.parse(last).values_at("id", "data")
  end

  # 1,001 waiting tasks of one queue take two flow_push.lua calls (each all or nothing, none too long for Redis),
  # and the task they all wait for is pushed last, carrying every one of them as a waiter.
  def test_a_flow_of_more_waiting_tasks_than_a_call_takes_is_written_in_calls_of_1000
    parts = Array.new(1001) do |n|
      { queue: "parts", type: "part.build", id: "p-#{n}", after: [{ queue: "fetch", id: "f" }] }
    end
    parts[0][:after] = [{ queue: "fetch", type: "fetch.csv", id: "f" }]
    tasks = @client.push_flow({ queue: "reports", type: "report.merge", id: "r", after: parts })
    assert_equal 1003, tasks.size
    assert_equal %w[r p-0 f], tasks.first(3).map(&:id)
    # reports: 1 call, parts: 2, fetch's push: 1.
    assert_equal "4", redis.info("commandstats")["evalsha"]["calls"]
    assert_equal 1001, redis.hlen("kmq:{parts}:deps-waiting")
    assert_equal 1001, JSON.parse(redis.lindex("kmq:{fetch}:ready:normal", 0))["waiters"].size
  end

  def test_a_bad_flow_names_the_node_and_writes_nothing
    [[{ queue: "a", type: "t", after: [{ queue: "b", type: "t", colour: 1 }] }, "after[0]", "colour"],
     [{ queue: "a", type: "t", after: [{ queue: "b", type: "t", after: [7] }] }, "after[0].after[0]", "JSON object"],
     [{ queue: "a", id: "x" }, "the root", "not a reference"],
     ['{"queue": "a"', "the root", "not JSON"]].each do |flow, path, reason|
      error = assert_raises(Kmq::InvalidFlow) { @client.push_flow(flow) }
      assert_equal path, error.path
      assert_includes error.message, reason
    end
    assert_empty redis.keys("*")
  end

  def test_show_and_cancel_a_waiting_task
    @client.push("mail", "a", nil, id: "d-1", delay: 60, unique: true)
    found = @client.show("mail", "d-1")
    assert_equal ["delayed"], found.map { |place| place["state"] }
    assert_operator found.first["due_in_ms"], :>, 50_000
    assert_equal 1, @client.cancel("mail", "d-1")
    assert_equal "d-1", @client.push("mail", "a", nil, id: "d-1", unique: true), "the cancelled id is free again"
  end

  def test_result_reads_what_the_settle_kept
    redis.hset("kmq:{r}:results:1000", "t-1", '{"ended_at":5,"state":"done","result":{"rows":3}}')
    redis.zadd("kmq:{r}:results", 4_102_444_800_000, "1000")
    assert_equal({ "rows" => 3 }, @client.result("r", "t-1")["result"])
    assert_raises(Kmq::NoResult) { @client.result("r", "nobody", wait: 0.02) }
    @client.push("r", "a", nil, id: "w-1")
    assert_raises(Kmq::Pending) { @client.result("r", "w-1") }
  end

  def test_a_key_of_the_wrong_type_raises_refused_with_nothing_written
    redis.set("kmq:{mail}:stats", "not a hash")
    error = assert_raises(Kmq::Refused) { @client.push("mail", "mail.send") }
    assert_includes error.message, "WRONGTYPE"
    assert_equal ["kmq:{mail}:stats"], redis.keys("*")
  end

  # The producers' rules of docs/OPERATIONS.md, without and with the read of the meta hash today's rules add.
  PRODUCER_RULES = "+evalsha +eval +script|load +time +info +wait +rpush +lpush +ltrim +hget +hsetnx +hdel " \
                   "+hincrby +zadd +zrange +type +publish ~kmq:{*}:ready:* ~kmq:{*}:delayed:* " \
                   "~kmq:{*}:delayed-tasks ~kmq:{*}:wake ~kmq:{*}:unique ~kmq:{*}:stats ~kmq:{*}:routes " \
                   "~kmq:{*}:flow:* ~kmq:{*}:ring:* ~kmq:{*}:sched &kmq:{*}:delay-wake".split

  def test_a_producer_user_reads_the_levels_with_todays_rules_and_pushes_to_normal_on_older_ones
    redis.hset("kmq:{mail}:meta", "levels", "high,normal", "default_priority", "normal")
    redis.call(["ACL", "SETUSER", "today", "reset", "on", ">pw", *PRODUCER_RULES, "%R~kmq:{*}:meta"])
    redis.call(["ACL", "SETUSER", "older", "reset", "on", ">pw", *PRODUCER_RULES])
    today = Kmq::Client.new("redis://today:pw@127.0.0.1:#{@server.port}/0")
    today.push("mail", "t", nil, priority: "high")
    older = Kmq::Client.new("redis://older:pw@127.0.0.1:#{@server.port}/0")
    older.push("mail", "t")
    assert_raises(Kmq::UnknownPriority) { older.push("mail", "t", nil, priority: "high") }
    assert_equal [1, 1], [redis.llen("kmq:{mail}:ready:high"), redis.llen("kmq:{mail}:ready:normal")]
  ensure
    today&.close
    older&.close
  end
end
