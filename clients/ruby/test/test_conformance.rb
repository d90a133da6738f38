require_relative "support"

# The conformance suite (clients/conformance/README.md): every case of clients/conformance/cases runs against a
# redis-server this test starts, flushed between cases. KMQ_CONFORMANCE_CASES names another folder of cases.
class ConformanceTest < Minitest::Test
  FOLDER = ENV.fetch("KMQ_CONFORMANCE_CASES", File.join(__dir__, "..", "..", "conformance", "cases"))
  ERRORS = {
    "duplicate" => Kmq::DuplicateError, "invalid_argument" => Kmq::InvalidArgument,
    "unknown_priority" => Kmq::UnknownPriority, "invalid_flow" => Kmq::InvalidFlow, "unreachable" => Kmq::Unreachable, "reply_lost" => Kmq::ReplyLost,
    "pending" => Kmq::Pending, "no_result" => Kmq::NoResult
  }.freeze
  UUID = /\A\h{8}-\h{4}-\h{4}-\h{4}-\h{12}\z/.freeze

  def self.server
    @server ||= Support::RedisServer.new.tap { |server| Minitest.after_run { server.stop } }
  end

  def test_the_cases_are_there
    skip "no folder #{FOLDER}: the conformance suite is not in this checkout" unless File.directory?(FOLDER)
    refute_empty Dir[File.join(FOLDER, "*.json")], "no conformance cases in #{FOLDER}"
  end

  Dir[File.join(FOLDER, "*.json")].sort.each do |file|
    define_method("test_case_#{File.basename(file, '.json')}") { run_case(file) }
  end

  def run_case(file)
    c = JSON.parse(File.read(file))
    skip "skipped for ruby: #{c['skip']['ruby']}" if c.dig("skip", "ruby")
    server = self.class.server
    @redis = server.redis
    @redis.flushall
    @captures = {}
    (c["given"] || []).each { |command| @redis.call(command.map(&:to_s)) }
    client = Kmq::Client.new(server.url, key_prefix: c.dig("client", "key_prefix") || "kmq")
    c["calls"].each_with_index do |call, n|
      where = "#{c['name']}: call #{n} (#{call['call']})"
      expect = call["expect"] || {}
      got = begin
        perform(client, call)
      rescue Kmq::Error => e
        e
      end
      if expect.key?("error")
        assert_kind_of ERRORS.fetch(expect["error"]), got, "#{where}: want the error #{expect['error']}"
        assert_equal expect["at"], got.path, "#{where}: #{got.message}" if expect.key?("at")
        next
      end
      raise got if got.is_a?(Exception)

      expect.each do |field, want|
        if field == "found"
          assert_equal want.size, got["found"].size, "#{where}: found #{got['found']}, want #{want}"
          want.zip(got["found"]).each do |w, g|
            w.each { |k, v| assert matches?(v, g[k]), "#{where}: found #{got['found']}, want #{want}" }
          end
        else
          assert matches?(want, got[field]), "#{where}: #{field} is #{got[field].inspect}, want #{want.to_json}"
        end
      end
    end
    client.close
    check_keys(c["name"], c.dig("then", "keys") || {})
  end

  def perform(client, call)
    queue = call["queue"]
    case call["call"]
    when "push"
      { "id" => client.push(queue, call["type"], call["data"], **options(call["options"])) }
    when "push_batch"
      tasks = call["tasks"].map { |task| [task["type"], task["data"], options(task["options"])] }
      { "ids" => client.push_batch(queue, tasks) }
    when "push_flow"
      { "tasks" => client.push_flow(call["flow"]).map { |task| { "queue" => task.queue, "id" => task.id } } }
    when "cancel" then { "removed" => client.cancel(queue, call["id"]) }
    when "show" then { "found" => client.show(queue, call["id"]) }
    when "result"
      { "result" => client.result(queue, call["id"], wait: (call["wait_ms"] || 0) / 1000.0) }
    else flunk "unknown call #{call['call']}"
    end
  end

  # The files' snake_case options, in this client's keywords (delays in seconds, times as Time).
  def options(given)
    (given || {}).to_h do |name, value|
      case name
      when "delay_ms" then [:delay, value / 1000.0]
      when "at_ms" then [:at, Time.at(Rational(value, 1000))]
      when "expires_in_ms" then [:expires_in, value / 1000.0]
      when "expires_at_ms" then [:expires_at, value]
      when "debounce_ms" then [:debounce, value / 1000.0]
      when "unique_for_ms" then [:unique_for, value / 1000.0]
      else [name.to_sym, value]
      end
    end
  end

  def redis_now
    seconds, micros = @redis.time
    seconds * 1000 + micros / 1000
  end

  def matches?(expected, actual)
    case expected
    when Hash
      if expected.size == 1 && expected.key?("json")
        decoded = JSON.parse(actual.to_s) rescue (return false)
        return matches?(expected["json"], decoded)
      end
      return UUID.match?(actual.to_s) if expected.key?("$uuid")
      if expected.key?("$ms_near_now")
        near = redis_now + expected["$ms_near_now"]
        value = Float(actual.to_s) rescue (return false)
        return value > near - 5000 && value <= near + 1000
      end
      return (@captures[expected["$capture"]] = actual.to_s) && true if expected.key?("$capture")
      return @captures[expected["$same_as"]] == actual.to_s if expected.key?("$same_as")

      actual.is_a?(Hash) && actual.size == expected.size &&
        expected.all? { |k, v| actual.key?(k) && matches?(v, actual[k]) }
    when Array
      actual.is_a?(Array) && actual.size == expected.size && expected.zip(actual).all? { |e, a| matches?(e, a) }
    when Numeric then (Float(actual.to_s) rescue nil) == expected
    when nil then actual.nil?
    else expected.to_s == actual.to_s
    end
  end

  # Redis holds exactly the keys the case names, each with its type and contents.
  def check_keys(name, expected)
    assert_equal expected.keys.sort, @redis.keys("*").sort, "#{name}: the keys Redis holds"
    expected.each do |key, shape|
      shape.each do |kind, contents|
        where = "#{name}: key #{key}"
        case kind
        when "list" then actual = @redis.lrange(key, 0, -1)
        when "hash" then actual = @redis.hgetall(key)
        when "string" then actual = @redis.get(key)
        when "zset", "set"
          pairs = kind == "zset" ? @redis.call(["ZRANGE", key, 0, -1, "WITHSCORES"]).each_slice(2).to_a
                                 : @redis.smembers(key).map { |m| [m] }
          assert unordered?(contents, pairs), "#{where}: got #{pairs}, want #{contents.to_json}"
          next
        else flunk "#{where}: unknown key type #{kind}"
        end
        assert matches?(contents, actual), "#{where}: got #{actual.inspect}, want #{contents.to_json}"
      end
    end
  end

  # A zset's (member, score) pairs or a set's members, in any order.
  def unordered?(expected, pairs)
    return false unless expected.size == pairs.size

    left = pairs.dup
    expected.all? do |each|
      parts = each.is_a?(Array) ? each : [each]
      index = left.index { |pair| pair.size == parts.size && parts.zip(pair).all? { |e, a| matches?(e, a) } }
      index && left.delete_at(index)
    end
  end
end
