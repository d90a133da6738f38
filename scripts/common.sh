# Shared by scripts/test, scripts/demo and the bench scripts: make sure the tools they need are here.

# apt_install PACKAGE...: installs Debian packages, with sudo when not root.
apt_install() {
    local sudo=""
    if [ "$(id -u)" -ne 0 ]; then
        sudo="sudo"
    fi
    $sudo apt-get update -qq
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

# ensure_command COMMAND PACKAGE...: installs the Debian packages when COMMAND is missing (a fresh Debian
# machine has neither redis-server nor a C compiler), with sudo when not root; exits 1 if it is still missing.
ensure_command() {
    local command="$1"
    shift
    if command -v "$command" >/dev/null 2>&1; then
        return
    fi
    echo "$command not found: installing Debian's $* package(s)" >&2
    apt_install "$@"
    command -v "$command" >/dev/null 2>&1 || { echo "installing $* failed" >&2; exit 1; }
}

# The package also brings redis-cli, which the tests and the demo use (and the Cluster and Sentinel harness of
# harness/: Debian's redis-server is built with TLS and runs as a Sentinel with --sentinel).
ensure_redis_server() {
    ensure_command redis-server redis-server
}

# The TLS tests make their own CA and certificates with the openssl command (harness/src/tls.rs).
ensure_openssl() {
    ensure_command openssl openssl
}

# tests/it/systemd.rs checks systemd/kmqd.service with `systemd-analyze verify` and `security --offline=true`,
# which need no running systemd (a container has none): Debian's systemd package brings the command.
ensure_systemd_analyze() {
    ensure_command systemd-analyze systemd
}

# tests/it/watch.rs runs `kmqd stats --watch` under a real pty with script(1), from util-linux: Debian's bsdutils
# package, essential, so normally there already.
ensure_script() {
    ensure_command script bsdutils
}

# tests/it/metrics.rs checks a real scrape with `promtool check metrics` and docs/alerts.yml with `promtool check
# rules`: Debian's prometheus package brings promtool (2.42 on Debian 12; the server it also installs is not run).
ensure_promtool() {
    ensure_command promtool prometheus
}

# tests/it/dashboard/browser.rs drives the dashboard's pages in a headless Chromium through Selenium: Debian's
# chromium, chromium-driver (chromedriver) and python3-selenium, for Debian's /usr/bin/python3. 130 packages on a
# Debian 12 machine that had none of their dependencies (X, GTK, fonts): 53 s to install, measured 2026-12-02;
# 380 MB on disk, Chromium itself most of it.
ensure_chromium() {
    ensure_command chromedriver chromium chromium-driver python3-selenium
    if ! /usr/bin/python3 -c 'import selenium' >/dev/null 2>&1; then
        echo "python3-selenium not found: installing Debian's package" >&2
        apt_install python3-selenium
        /usr/bin/python3 -c 'import selenium' || { echo "installing python3-selenium failed" >&2; exit 1; }
    fi
}

# tests/it/exec_persistent.rs runs its handler processes, and the Python SDK's tests, with python3 (standard
# library only).
ensure_python3() {
    ensure_command python3 python3
}

# ensure_packages PACKAGE...: installs those of the Debian packages that are not installed (for libraries, which
# have no command to look for), with sudo when not root; exits 1 if that fails.
ensure_packages() {
    local missing=() package
    for package in "$@"; do
        dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "ok installed" || missing+=("$package")
    done
    if [ ${#missing[@]} -eq 0 ]; then
        return
    fi
    echo "installing Debian's ${missing[*]} package(s)" >&2
    apt_install "${missing[@]}" || { echo "installing ${missing[*]} failed" >&2; exit 1; }
}

# The Go client's tests (clients/go/run-tests): Debian's Go (1.19 on Debian 12) and redigo, in Debian's GOPATH
# (the Go module proxy is not reachable from these machines).
ensure_go_client() {
    ensure_packages golang-go golang-github-gomodule-redigo-dev golang-opentelemetry-otel-dev
}

# The Ruby client's tests (clients/ruby/run-tests): Debian's ruby (3.1 on Debian 12), redis-rb 4.8 and minitest
# (RubyGems is not reachable from these machines).
ensure_ruby_client() {
    ensure_packages ruby ruby-redis ruby-minitest
}

# The Python client's tests (clients/python, docs/CLIENTS.md) run with Debian's /usr/bin/python3: pytest, redis-py
# and, to build its wheel, pip and setuptools (Debian's python3-pytest, python3-redis, python3-pip,
# python3-setuptools; about 15 s to install where missing).
ensure_python_client() {
    ensure_python3
    # pip apart: importing it before setuptools trips setuptools' distutils shim.
    if ! { /usr/bin/python3 -c 'import pytest, redis, setuptools' && /usr/bin/python3 -m pip --version; } >/dev/null 2>&1; then
        echo "pytest, redis-py, pip or setuptools not found for /usr/bin/python3: installing Debian's packages" >&2
        apt_install python3-pytest python3-redis python3-pip python3-setuptools
        { /usr/bin/python3 -c 'import pytest, redis, setuptools' && /usr/bin/python3 -m pip --version; } >/dev/null ||
            { echo "installing them failed" >&2; exit 1; }
    fi
}

# ensure_otel_venv: prints the python of a venv over /usr/bin/python3 (its Debian packages seen through
# --system-site-packages: pytest, redis-py) with opentelemetry-api from PyPI (Debian does not package it), for the
# Python SDK's and client's tracing tests. It lives in the target directory, so a warm one keeps it: 16 s to make
# with the download, 4 s CPU (2026-12-07, load average 22 on 2 cores), 3 s to check after. Needs python3-venv.
OTEL_API_VERSION=1.45.3
ensure_otel_venv() {
    local venv="${CARGO_TARGET_DIR:-$PWD/target}/python-otel"
    if ! "$venv/bin/python" -c 'import opentelemetry.trace, pytest, redis' >/dev/null 2>&1; then
        ensure_packages python3-venv >&2
        rm -rf "$venv"
        /usr/bin/python3 -m venv --system-site-packages "$venv" >&2
        "$venv/bin/pip" install --quiet --disable-pip-version-check "opentelemetry-api==$OTEL_API_VERSION" >&2 ||
            { echo "installing opentelemetry-api from PyPI into $venv failed" >&2; exit 1; }
    fi
    echo "$venv/bin/python"
}

# The Node SDK's tests (sdk/node, and tests/it/sdk.rs) run with node: Debian's nodejs package (18 on Debian 12).
ensure_node() {
    ensure_command node nodejs
}

# The Node client's tests install its dependency with npm (Debian packages it apart from nodejs).
ensure_npm() {
    ensure_command npm npm
}

ensure_cargo() {
    if ! command -v cargo >/dev/null 2>&1; then
        echo "cargo not found: install Rust first (https://rustup.rs), then run this again" >&2
        exit 1
    fi
    # Cargo links with `cc`, and scripts/test's plugin tests compile C plugins (and the ABI layout check) with it, and
    # the harness the preload that steps a redis-server's clock (harness/src/clock_shift.c; not libfaketime, which
    # hangs the jemalloc-linked redis-server of Debian at start).
    ensure_command cc gcc libc6-dev
}

# check_free_space GIB: says loudly, before anything is built, when the target directory's or the temp
# directory's file system has less than GIB GiB free. A whole run of scripts/test from a fresh clone writes
# about 7 GiB (target/: the debug build, its tests, the loom and release builds; measured 2026-12-06), and
# every test's redis-server writes into its own temp dir: on a full disk the tests that start after it fill
# up fail by the hundred with messages that do not say "disk" (a CI run of 2026-12-06 lost 137 tests that way,
# on a machine left with 5 GB free). A warning, not a refusal: a warm target needs much less.
check_free_space() {
    local want_kib=$(($1 * 1024 * 1024)) dir avail
    for dir in "${CARGO_TARGET_DIR:-target}" "${TMPDIR:-/tmp}"; do
        mkdir -p "$dir"
        avail=$(df -Pk "$dir" | awk 'NR == 2 { print $4 }')
        if [ "$avail" -lt "$want_kib" ]; then
            echo "WARNING: only $((avail / 1024)) MiB free on the file system of $dir; a whole test run" \
                "may need $1 GiB: tests fail for lack of space (df -h $dir)" >&2
        fi
    done
}

# Whether a script may print colour on standard output: only to a terminal, and never when NO_COLOR is set to
# anything (https://no-color.org), the rule kmqd itself follows (src/cli/colour.rs). Sets BOLD and RESET once;
# print escape codes only through them.
use_colour() {
    if [ -t 1 ] && [ -z "${NO_COLOR:-}" ]; then
        BOLD=$'\033[1m' RESET=$'\033[0m'
    else
        BOLD='' RESET=''
    fi
}

# scripts/package builds the Debian package with cargo-deb. Pinned: `--profile dev --no-build` (the test packs the
# debug build) is warned about in 3.x and may become an error in a later release. Installing it on a fresh
# 2-core machine took 6.4 min wall, 2.0 min CPU, measured 2026-12-01 while other builds kept the machine busy
# (load 7-10): about a minute quiet.
# cargo-deb needs dpkg-shlibdeps (dpkg-dev) for the package's Depends on libc6, and strip (binutils, which gcc
# brings).
CARGO_DEB_VERSION=3.8.0
ensure_cargo_deb() {
    ensure_command dpkg-shlibdeps dpkg-dev
    # Read whole, then matched: `cargo deb --version | grep -q` can fail on SIGPIPE under pipefail.
    if grep -qF "$CARGO_DEB_VERSION" <<<"$(cargo deb --version 2>/dev/null)"; then
        return
    fi
    echo "cargo-deb $CARGO_DEB_VERSION not found: installing it (cargo install)" >&2
    cargo install cargo-deb --version "$CARGO_DEB_VERSION" --locked --quiet
}

# scripts/package --check runs lintian on the package: about 1 min to install (145 small Debian packages, Perl
# mostly, 16 MB), 10 s to run.
ensure_lintian() {
    ensure_command lintian lintian
}

# src/broker/scripts/NAME.lua as revision REV has it, or as the work tree has it for REV `.`: the scripts/*-instructions
# compare two versions of a script by concatenating each revision's files as src/broker/mod.rs (`sources`) does.
script_of() {
    if [ "$1" = . ]; then cat "src/broker/scripts/$2.lua"; else git show "$1:src/broker/scripts/$2.lua"; fi
}

# Redis's instructions counted by valgrind's callgrind inside evalShaCommand only (scripts/*-instructions: a
# script's cost that a shared host's load does not move). Starts a redis-server of its own on a free loopback port
# under callgrind, its output in DIR, waits for it, and loads SCRIPT (a file) into it. Sets CALLGRIND_PORT,
# CALLGRIND_SERVER (its pid), CALLGRIND_OUT and CALLGRIND_SHA (the script's). Needs ensure_command valgrind valgrind.
callgrind_redis_start() {
    local dir="$1" script="$2"
    CALLGRIND_PORT="$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
    CALLGRIND_OUT="$dir/callgrind.$CALLGRIND_PORT"
    valgrind --tool=callgrind --collect-atstart=no --toggle-collect=evalShaCommand \
        --callgrind-out-file="$CALLGRIND_OUT" redis-server --port "$CALLGRIND_PORT" --save '' --appendonly no \
        >/dev/null 2>&1 &
    CALLGRIND_SERVER=$!
    until redis-cli -p "$CALLGRIND_PORT" ping >/dev/null 2>&1; do sleep 0.2; done
    CALLGRIND_SHA="$(redis-cli -p "$CALLGRIND_PORT" -x SCRIPT LOAD <"$script")"
}

# Stops the redis-server callgrind_redis_start started; prints the instructions callgrind counted in it.
callgrind_redis_stop() {
    redis-cli -p "$CALLGRIND_PORT" SHUTDOWN NOSAVE >/dev/null 2>&1 || true
    wait "$CALLGRIND_SERVER" || true
    awk '/^summary:/ {print $2}' "$CALLGRIND_OUT"
}
