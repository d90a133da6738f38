# Test support: a redis-server each test starts (its own free port on loopback and temp dir, killed at the end;
# never a Redis the test did not start), polling with deadlines, and a proxy that loses a reply.
require "minitest/autorun"
require "socket"
require "tmpdir"
require "kmq"

module Support
  # A private redis-server.
  class RedisServer
    attr_reader :port, :dir

    # extra: more of redis-server's arguments (a TLS port, cluster mode); a block given the dir first writes what
    # they name there (certificates).
    def initialize(*extra)
      @dir = Dir.mktmpdir("kmq-ruby-")
      @port = Support.free_port
      extra = yield(@dir) if block_given?
      @pid = Process.spawn("redis-server", "--port", @port.to_s, "--bind", "127.0.0.1", "--save", "",
                           "--appendonly", "no", "--dir", @dir, "--logfile", File.join(@dir, "redis.log"), *extra)
      Support.eventually(10, "redis-server answers PING", -> { log }) do
        Redis.new(url: url).tap(&:ping).close
        true
      rescue Redis::BaseConnectionError
        false
      end
    end

    def url = "redis://127.0.0.1:#{@port}/0"

    def addr = "127.0.0.1:#{@port}"

    def log = File.exist?(File.join(@dir, "redis.log")) ? File.read(File.join(@dir, "redis.log")) : ""

    # A plain redis-rb connection for the test's own reads and writes.
    def redis = @redis ||= Redis.new(url: url)

    def stop
      @redis&.close
      Process.kill("KILL", @pid)
      Process.wait(@pid)
      FileUtils.rm_rf(@dir)
    end
  end

  def self.free_port
    server = TCPServer.new("127.0.0.1", 0)
    server.addr[1]
  ensure
    server&.close
  end

  # Polls the block until it is true or the deadline passes.
  def self.eventually(within, what, explain = nil)
    deadline = Process.clock_gettime(Process::CLOCK_MONOTONIC) + within
    until yield
      if Process.clock_gettime(Process::CLOCK_MONOTONIC) > deadline
        raise "not within #{within} s: #{what}#{explain ? "\n#{explain.call}" : ''}"
      end

      sleep 0.01
    end
  end

  # A TCP proxy in front of a Redis that forwards what the client writes and, once armed, closes the client's
  # connection instead of forwarding Redis's next reply: the command ran, its reply is lost.
  class ReplyDropper
    def initialize(upstream_port)
      @server = TCPServer.new("127.0.0.1", 0)
      @armed = false
      @thread = Thread.new do
        loop do
          client = @server.accept
          upstream = TCPSocket.new("127.0.0.1", upstream_port)
          Thread.new { IO.copy_stream(client, upstream) rescue nil; upstream.close rescue nil }
          Thread.new do
            loop do
              data = upstream.readpartial(65_536)
              break if @armed

              client.write(data)
            end
          rescue IOError, SystemCallError
            nil
          ensure
            client.shutdown(:RDWR) rescue nil # wakes the copying thread too; a bare close waits for it
            client.close rescue nil
            upstream.close rescue nil
          end
        end
      rescue IOError, SystemCallError
        nil
      end
    end

    def url = "redis://127.0.0.1:#{@server.addr[1]}/0"

    def arm! = @armed = true

    def stop
      @server.close
      @thread.join
    end
  end
end
