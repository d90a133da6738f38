# Runs every test of the Ruby client: ruby -Ilib -Itest test/run.rb (from clients/ruby).
Dir[File.join(__dir__, "test_*.rb")].sort.each { |file| require file }
