# The Ruby producer client of kmqd (docs/CLIENTS.md): `gem build kmq.gemspec && gem install kmq-*.gem`.
require_relative "lib/kmq/version"

Gem::Specification.new do |spec|
  spec.name = "kmq"
  spec.version = Kmq::VERSION
  spec.summary = "Push tasks to kmqd queues from Ruby"
  spec.description = "The producer client of kmqd, a Redis-backed task-queue daemon: push, push_batch, show, " \
                     "cancel and result over kmqd's own enqueue script (docs/PROTOCOL.md)."
  spec.authors = ["the kmqd authors"]
  spec.licenses = ["MIT", "Apache-2.0"]
  spec.required_ruby_version = ">= 3.1"
  spec.files = Dir["lib/**/*.rb"] + Dir["lib/kmq/*.lua"]
  spec.require_paths = ["lib"]
  # redis-rb: the usual Redis client of Ruby, and the one Debian packages (ruby-redis, 4.8). 5.x changed the
  # connection layer this client reads lost replies through, so 4.x only for now.
  spec.add_dependency "redis", ">= 4.6", "< 5"
  # The tests run with minitest (Debian's ruby-minitest): ruby -Ilib -Itest test/run.rb
  spec.add_development_dependency "minitest", "~> 5"
end
