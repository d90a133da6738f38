// The Go producer client of kmqd (docs/CLIENTS.md). Its one dependency is redigo, the Redis client Debian packages
// (golang-github-gomodule-redigo-dev, 1.8.x): scripts/test builds it from Debian's GOPATH, a user outside Debian
// gets it with `go get` like any module.
module github.com/kmqd/kmqd/clients/go

go 1.19

require github.com/gomodule/redigo v1.8.3
