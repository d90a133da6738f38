# Shared by scripts/test, scripts/demo and the bench scripts: make sure the tools they need are here.

# ensure_command COMMAND PACKAGE...: installs the Debian packages when COMMAND is missing (a fresh Debian
# machine has neither redis-server nor a C compiler), with sudo when not root; exits 1 if it is still missing.
ensure_command() {
    local command="$1"
    shift
    if command -v "$command" >/dev/null 2>&1; then
        return
    fi
    echo "$command not found: installing Debian's $* package(s)" >&2
    local sudo=""
    if [ "$(id -u)" -ne 0 ]; then
        sudo="sudo"
    fi
    $sudo apt-get update -qq
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
    command -v "$command" >/dev/null 2>&1 || { echo "installing $* failed" >&2; exit 1; }
}

# The package also brings redis-cli, which the tests and the demo use (and the Cluster and Sentinel harness of
# src/redis_server/: Debian's redis-server is built with TLS and runs as a Sentinel with --sentinel).
ensure_redis_server() {
    ensure_command redis-server redis-server
}

# The TLS tests make their own CA and certificates with the openssl command (src/redis_server/tls.rs).
ensure_openssl() {
    ensure_command openssl openssl
}

# tests/it/systemd.rs checks systemd/kmqd.service with `systemd-analyze verify` and `security --offline=true`,
# which need no running systemd (a container has none): Debian's systemd package brings the command.
ensure_systemd_analyze() {
    ensure_command systemd-analyze systemd
}

# tests/it/metrics.rs checks a real scrape with `promtool check metrics` and docs/alerts.yml with `promtool check
# rules`: Debian's prometheus package brings promtool (2.42 on Debian 12; the server it also installs is not run).
ensure_promtool() {
    ensure_command promtool prometheus
}

ensure_cargo() {
    if ! command -v cargo >/dev/null 2>&1; then
        echo "cargo not found: install Rust first (https://rustup.rs), then run this again" >&2
        exit 1
    fi
    # Cargo links with `cc`, and scripts/test's plugin tests compile C plugins (and the ABI layout check) with it.
    ensure_command cc gcc libc6-dev
}
