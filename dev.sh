#!/usr/bin/env bash
# Set up guardfs on a fresh Debian/Ubuntu machine and run it.
#
#   ./dev.sh demo    install what is missing, then run the built-in demo
#   ./dev.sh test    install what is missing, then ruff, mypy --strict and the test suite
#
# What it installs: the Debian packages fuse3, libfuse3-dev, pkg-config, git and
# python3-venv when they are absent (as root through apt-get; otherwise it says what to
# install), and a virtualenv in .venv with guardfs and its test and bench extras.
set -euo pipefail

cd "$(dirname "$0")"
VENV=${GUARDFS_VENV:-.venv}
PYTHON=${PYTHON:-python3}
APT_PACKAGES=(fuse3 libfuse3-dev pkg-config git gcc bubblewrap util-linux)
# Only the tests need these: headless Chromium opens the page guard report writes.
TEST_APT_PACKAGES=(chromium)

say() { printf 'dev.sh: %s\n' "$*" >&2; }

install_system_packages() {
    local missing=()
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
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
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

setup() {
    install_system_packages "$@"
    install_venv
    if [ ! -e /dev/fuse ]; then
        say "/dev/fuse is missing: load the fuse module (modprobe fuse), or give the container --device /dev/fuse --cap-add SYS_ADMIN"
        exit 69
    fi
}

case "${1:-}" in
    demo)
        setup "${APT_PACKAGES[@]}"
        exec "$VENV/bin/guard" demo
        ;;
    test)
        setup "${APT_PACKAGES[@]}" "${TEST_APT_PACKAGES[@]}"
        shift
        "$VENV/bin/ruff" check guardfs sandbox tests bench
        "$VENV/bin/mypy" --strict
        if [ $# -eq 0 ]; then
            # The pure core runs where FUSE cannot: prove it with /dev/fuse hidden (bubblewrap,
            # a fresh /dev without it), so a test that mounts without its marker fails here.
            say "pytest -m 'not mount' with no /dev/fuse"
            bwrap --bind / / --dev /dev --proc /proc --unshare-pid --die-with-parent \
                "$VENV/bin/pytest" -q -p no:cacheprovider -m "not mount" --basetemp="$(mktemp -d)"
        fi
        exec "$VENV/bin/pytest" "$@"
        ;;
    *)
        echo "usage: ./dev.sh demo | ./dev.sh test [pytest args]" >&2
        exit 64
        ;;
esac
