# Shared by scripts/test and scripts/demo: make sure the tools they need are here.

# Installs Debian's redis-server package when redis-server is missing (a fresh Debian machine has none).
ensure_redis_server() {
    if command -v redis-server >/dev/null 2>&1; then
        return
    fi
    echo "redis-server not found: installing Debian's redis-server package" >&2
    local sudo=""
    if [ "$(id -u)" -ne 0 ]; then
        sudo="sudo"
    fi
    $sudo apt-get update -qq
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
    command -v redis-server >/dev/null 2>&1 || { echo "installing redis-server failed" >&2; exit 1; }
}

ensure_cargo() {
    if ! command -v cargo >/dev/null 2>&1; then
        echo "cargo not found: install Rust first (https://rustup.rs), then run this again" >&2
        exit 1
    fi
    # Cargo needs a C compiler as its linker, and scripts/test's plugin tests compile C: both callers need one.
    ensure_cc
}

# Installs Debian's gcc package when there is no C compiler: cargo links with `cc`, and the plugin tests compile C
# plugins (and the ABI layout check) with it.
ensure_cc() {
    if command -v cc >/dev/null 2>&1; then
        return
    fi
    echo "cc not found: installing Debian's gcc package" >&2
    local sudo=""
    if [ "$(id -u)" -ne 0 ]; then
        sudo="sudo"
    fi
    $sudo apt-get update -qq
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq gcc libc6-dev >/dev/null
    command -v cc >/dev/null 2>&1 || { echo "installing gcc failed" >&2; exit 1; }
}
