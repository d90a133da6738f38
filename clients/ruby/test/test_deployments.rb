# The client on the deployments beside a single Redis, each against real servers the tests start: a Redis Cluster
# of three masters (redis-cli --cluster create, started once for the file), a master watched by a Sentinel, and a
# redis-server with a TLS port whose certificate a CA the test makes with openssl signed.
require_relative "support"
require "open3"

module Deployments
  # A CA and a server certificate it signed for localhost and 127.0.0.1, with P-256 keys (made at once, where RSA
  # keys take seconds), as the Go client's tls_test.go makes them.
  def self.certificates(dir)
    File.write(File.join(dir, "server.ext"), "subjectAltName = DNS:localhost, IP:127.0.0.1\n")
    [%w[req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout ca.key -out ca.crt -days 2
        -subj /CN=kmq-ruby-test-CA],
     %w[req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout server.key -out server.csr
        -subj /CN=localhost],
     %w[x509 -req -in server.csr -CA ca.crt -CAkey ca.key -CAcreateserial -out server.crt -days 2
        -extfile server.ext]].each do |args|
      out, status = Open3.capture2e("openssl", *args, chdir: dir)
      raise "openssl #{args.join(' ')}: #{out}" unless status.success?
    end
  end

  # The nodes' TLS ports (tls-cluster: CLUSTER SLOTS names them to a client that came over TLS) and the CA file
  # their certificates are of.
  class << self
    attr_reader :tls_ports, :ca_file
  end

  # The file's one cluster, started at its first use and stopped when the tests end.
  def self.cluster
    @cluster ||= begin
      @tls_ports = []
      # One CA for every node: their bus connections check each other's certificates.
      certs = Dir.mktmpdir("kmq-ruby-certs-")
      certificates(certs)
      @ca_file = File.join(certs, "ca.crt")
      # Its own bus port: the default (the port + 10000) does not exist for a free port above 55535.
      nodes = Array.new(3) do
        @tls_ports << Support.free_port
        Support::RedisServer.new("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-port",
                                 Support.free_port.to_s, "--tls-port", @tls_ports.last.to_s, "--tls-cluster", "yes",
                                 "--tls-cert-file", File.join(certs, "server.crt"),
                                 "--tls-key-file", File.join(certs, "server.key"),
                                 "--tls-ca-cert-file", @ca_file, "--tls-auth-clients", "no")
      end
      Minitest.after_run do
        nodes.each(&:stop)
        FileUtils.rm_rf(certs)
      end
      # redis-cli waits for the nodes to agree without a bound of its own.
      out, status = Open3.capture2e("timeout", "60", "redis-cli", "--cluster", "create", *nodes.map(&:addr),
                                    "--cluster-yes")
      raise "redis-cli --cluster create: #{out}" unless status.success?

      Support.eventually(30, "every node reports cluster_state:ok") do
        nodes.all? { |node| node.redis.cluster("info").include?("cluster_state:ok") }
      end
      nodes
    end
  end

  # The node that serves key: the others answer MOVED.
  def self.owner_of(key)
    cluster.find do |node|
      node.redis.type(key)
      true
    rescue Redis::CommandError
      false
    end
  end

  # Makes target the master of key's slot on every node, as the last step of a resharding does.
  def self.move_slot(key, target)
    slot = target.redis.cluster("keyslot", key)
    id = target.redis.cluster("myid")
    [target, *cluster].each { |node| node.redis.cluster("setslot", slot, "node", id) }
  end
end

class ClusterTest < Minitest::Test
  def nodes = Deployments.cluster

  def client
    @client ||= Kmq::Client.new(cluster: [nodes.first.url])
  end

  def teardown
    @client&.close
  end

  def test_a_cluster_client_pushes_shows_and_cancels_on_each_queues_master
    queues = (0...6).map { |n| "q#{n}" }
    owners = queues.map { |queue| Deployments.owner_of("kmq:{#{queue}}:ready:normal") }.uniq
    assert_operator owners.size, :>=, 2, "the queues' slots are all on one master: the test would not show routing"
    queues.each do |queue|
      client.push(queue, "t", nil, id: "#{queue}-1", unique: true)
      client.push_batch(queue, [["t", { n: 1 }], ["t", { n: 2 }], ["t", nil, { expires_in: 60 }]])
      assert_raises(Kmq::DuplicateError) { client.push(queue, "t", nil, id: "#{queue}-1", unique: true) }
      assert_equal ["ready"], client.show(queue, "#{queue}-1").map { |place| place["state"] }
      assert_equal 1, client.cancel(queue, "#{queue}-1")
    end
    queues.each do |queue|
      key = "kmq:{#{queue}}:ready:normal"
      assert_equal 3, Deployments.owner_of(key).redis.llen(key)
    end
  end

  def test_over_tls_every_master_is_reached_on_its_tls_port
    nodes # the cluster, with its TLS ports
    client = Kmq::Client.new(cluster: ["rediss://127.0.0.1:#{Deployments.tls_ports.first}"],
                             ssl_params: { ca_file: Deployments.ca_file })
    queues = (0...6).map { |n| "tls#{n}" }
    queues.each { |queue| client.push(queue, "t", nil, id: "#{queue}-1") }
    queues.each do |queue|
      key = "kmq:{#{queue}}:ready:normal"
      assert_equal "#{queue}-1", JSON.parse(Deployments.owner_of(key).redis.lindex(key, 0))["id"]
    end
  ensure
    client&.close
  end

  def test_a_flow_over_queues_of_two_masters_is_pushed
    queues = %w[f0 f1 f2]
    assert_operator queues.map { |queue| Deployments.owner_of("kmq:{#{queue}}:ready:normal") }.uniq.size, :>=, 2
    tasks = client.push_flow({ "queue" => "f0", "type" => "merge", "id" => "f-root",
                               "after" => [{ "queue" => "f1", "type" => "part", "id" => "f-1" },
                                           { "queue" => "f2", "type" => "part", "id" => "f-2" }] })
    assert_equal 3, tasks.size
    assert_equal ["ready"], client.show("f1", "f-1").map { |place| place["state"] }
    assert_equal ["ready"], client.show("f2", "f-2").map { |place| place["state"] }
  end

  def test_a_moved_slot_is_followed_and_the_push_lands_once_on_the_new_master
    client.push("warm", "t", nil) # reads the slot map
    key = "kmq:{moving}:ready:normal"
    source = Deployments.owner_of(key)
    target = (nodes - [source]).first
    Deployments.move_slot(key, target)
    client.push("moving", "t", nil, id: "m-1")
    assert_equal 1, target.redis.llen(key)
  end

  def test_a_push_during_a_migration_waits_out_tryagain_and_lands_once_on_the_target
    key = "kmq:{asked}:ready:normal"
    source = Deployments.owner_of(key)
    target = (nodes - [source]).first
    slot = target.redis.cluster("keyslot", key)
    target.redis.cluster("setslot", slot, "importing", source.redis.cluster("myid"))
    source.redis.cluster("setslot", slot, "migrating", target.redis.cluster("myid"))
    client.push("warm", "t", nil) # reads the slot map
    # The queue has no keys on the source, which answers ASK; the target answers push.lua (keys it lacks) TRYAGAIN
    # until the migration ends.
    pushing = Thread.new { client.push("asked", "t", nil, id: "a-1") }
    Support.eventually(10, "the target answered TRYAGAIN") do
      target.redis.info("errorstats").key?("errorstat_TRYAGAIN")
    end
    Deployments.move_slot(key, target)
    assert_equal "a-1", pushing.value
    assert_equal 1, target.redis.llen(key)
  end

  def test_a_cluster_given_as_a_redis_object_is_refused_since_its_resends_cannot_be_turned_off
    redis = Redis.new(cluster: [nodes.first.url])
    error = assert_raises(Kmq::InvalidArgument) { Kmq::Client.new(redis: redis) }
    assert_match(/cluster:/, error.message)
  ensure
    redis&.close
  end
end

class SentinelTest < Minitest::Test
  def setup
    @master = Support::RedisServer.new
    @port = Support.free_port
    config = File.join(@master.dir, "sentinel.conf")
    File.write(config, "port #{@port}\nbind 127.0.0.1\nsentinel monitor mymaster 127.0.0.1 #{@master.port} 1\n")
    @sentinel = Process.spawn("redis-server", config, "--sentinel", "--logfile", File.join(@master.dir, "s.log"))
    Support.eventually(10, "the Sentinel names the master") do
      Redis.new(port: @port).then { |s| s.sentinel("get-master-addr-by-name", "mymaster").tap { s.close } } ==
        ["127.0.0.1", @master.port.to_s]
    rescue Redis::BaseConnectionError
      false
    end
  end

  def teardown
    Process.kill("KILL", @sentinel)
    Process.wait(@sentinel)
    @master.stop
  end

  def test_a_client_of_a_sentinel_watched_master_pushes_to_the_master
    client = Kmq::Client.new("redis://mymaster", sentinels: [{ host: "127.0.0.1", port: @port }], role: :master)
    client.push("mail", "mail.send", { to: "ada" }, id: "s-1")
    assert_equal ["s-1"], @master.redis.lrange("kmq:{mail}:ready:normal", 0, -1).map { |task| JSON.parse(task)["id"] }
  ensure
    client&.close
  end
end

class TlsTest < Minitest::Test
  # The class's one TLS server, started at its first use and stopped when the tests end.
  def self.server
    @server ||= begin
      tls_port = Support.free_port
      server = Support::RedisServer.new do |dir|
        Deployments.certificates(dir)
        ["--tls-port", tls_port.to_s, "--tls-cert-file", File.join(dir, "server.crt"),
         "--tls-key-file", File.join(dir, "server.key"), "--tls-ca-cert-file", File.join(dir, "ca.crt"),
         "--tls-auth-clients", "no"]
      end
      Minitest.after_run { server.stop }
      [server, tls_port]
    end
  end

  def url = "rediss://localhost:#{TlsTest.server[1]}/0"

  def server = TlsTest.server[0]

  def test_a_client_trusting_the_ca_file_pushes_over_tls
    client = Kmq::Client.new(url, ssl_params: { ca_file: File.join(server.dir, "ca.crt") })
    client.push("mail", "mail.send", nil, id: "tls-1")
    assert_equal "tls-1", JSON.parse(server.redis.lindex("kmq:{mail}:ready:normal", 0))["id"]
  ensure
    client&.close
  end

  def test_a_client_not_trusting_the_certificate_is_unreachable_with_nothing_written
    client = Kmq::Client.new(url)
    assert_raises(Kmq::Unreachable) { client.push("refused", "mail.send", nil) }
    assert_equal [], server.redis.keys("kmq:{refused}:*")
  ensure
    client&.close
  end
end
