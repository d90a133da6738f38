require_relative "support"
require "fileutils"

# End to end: a task pushed with this client is run by a real kmqd daemon (the testkit plugin answers done with
# the task's `result`), and result reads what its settle kept. KMQD_BIN is the daemon (scripts/test sets it to
# the workspace's build) and KMQD_PLUGINS the folder holding libkmq_testkit.so (default: KMQD_BIN's folder).
class DaemonTest < Minitest::Test
  def test_a_pushed_task_is_run_by_the_daemon_and_its_result_read
    bin = ENV["KMQD_BIN"]
    skip "KMQD_BIN is not set: scripts/test sets it to target/debug/kmqd" if bin.to_s.empty?
    server = Support::RedisServer.new
    dir = Dir.mktmpdir("kmq-ruby-daemon-")
    plugins = File.join(dir, "plugins")
    Dir.mkdir(plugins)
    # kmqd refuses a plugin that group or others may write.
    FileUtils.install(File.join(ENV.fetch("KMQD_PLUGINS", File.dirname(bin)), "libkmq_testkit.so"), plugins,
                      mode: 0o755)
    config = File.join(dir, "kmqd.toml")
    template = File.read(File.join(__dir__, "..", "..", "testdata", "kmqd.toml"))
    File.write(config, template.gsub("REDIS_URL", server.url).gsub("PLUGINS_DIR", plugins))
    log = File.join(dir, "kmqd.log")
    daemon = Process.spawn(bin, "--config", config, out: log, err: log)
    # The daemon describes the queue's levels in its meta hash at start; the client learns them there.
    Support.eventually(30, "the daemon writes the queue's levels", -> { File.read(log) }) do
      server.redis.hget("kmq:{jobs}:meta", "levels") == "high,normal"
    end
    client = Kmq::Client.new(server.url)
    id = client.push("jobs", "job", { result: { rows: 3 } }, priority: "high")
    result = client.result("jobs", id, wait: 60)
    assert_equal ["done", { "rows" => 3 }], result.values_at("state", "result"), File.read(log)
  ensure
    if daemon
      Process.kill("TERM", daemon)
      unless wait_for(daemon, 20)
        Process.kill("KILL", daemon)
        Process.wait(daemon)
      end
    end
    client&.close
    server&.stop
    FileUtils.rm_rf(dir) if dir
  end

  # Waits up to `within` seconds for the process to end.
  def wait_for(pid, within)
    Support.eventually(within, "kmqd stops on SIGTERM") { Process.wait2(pid, Process::WNOHANG) }
    true
  rescue RuntimeError
    false
  end
end
