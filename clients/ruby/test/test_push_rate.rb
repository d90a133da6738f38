require_relative "support"

# The push rate of docs/CLIENTS.md ("Ruby", "Push rate"), run by hand: KMQ_BENCH=1 clients/ruby/run-tests -n
# /push_rate/. It measures, on a redis-server it starts, push_batch of 100,000 small tasks against redis-rb's own
# pipeline of RPUSH (1,000 a pipeline, as push_batch makes one call per 1,000), and 10,000 single pushes against
# 10,000 single RPUSHes, each the median of 3 runs.
class PushRateTest < Minitest::Test
  BATCH = 100_000
  SINGLE = 10_000

  def test_push_rate
    skip "a measurement, not a test: KMQ_BENCH=1 runs it" unless ENV["KMQ_BENCH"]
    server = Support::RedisServer.new
    client = Kmq::Client.new(server.url)
    redis = server.redis
    data = { n: 1 }
    envelope = -> { JSON.generate({ "id" => SecureRandom.uuid, "type" => "bench", "data" => data, "attempt" => 0 }) }
    median = lambda do |what, tasks, &run|
      rates = Array.new(3) do
        redis.flushall
        start = Process.clock_gettime(Process::CLOCK_MONOTONIC)
        run.call
        tasks / (Process.clock_gettime(Process::CLOCK_MONOTONIC) - start)
      end.sort
      puts format("%-44s %9.0f tasks/s (runs: %.0f %.0f %.0f)", what, rates[1], *rates)
    end
    tasks = Array.new(BATCH) { ["bench", data] }
    median.call("kmq push_batch, 100,000 tasks", BATCH) { client.push_batch("bench", tasks) }
    median.call("redis-rb pipeline of RPUSH, 100,000 tasks", BATCH) do
      (BATCH / 1000).times do
        redis.pipelined { |pipe| 1000.times { pipe.rpush("kmq:{bench}:ready:normal", envelope.call) } }
      end
    end
    median.call("kmq push, 10,000 single pushes", SINGLE) { SINGLE.times { client.push("bench", "bench", data) } }
    median.call("redis-rb RPUSH, 10,000 single commands", SINGLE) do
      SINGLE.times { redis.rpush("kmq:{bench}:ready:normal", envelope.call) }
    end
  ensure
    client&.close
    server&.stop
  end
end
