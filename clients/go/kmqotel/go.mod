// kmqotel: the Go client's OpenTelemetry bridge, a module of its own so that the client's module does not require
// OpenTelemetry (docs/CLIENTS.md). scripts/test builds it in GOPATH mode from Debian's
// golang-opentelemetry-otel-dev (1.1.0) and redigo, as clients/go/run-tests does the client.
module github.com/kmqd/kmqd/clients/go/kmqotel

go 1.19

require (
	github.com/gomodule/redigo v1.8.3
	github.com/kmqd/kmqd/clients/go v0.0.0
	go.opentelemetry.io/otel v1.1.0
	go.opentelemetry.io/otel/trace v1.1.0
)

replace github.com/kmqd/kmqd/clients/go => ../
