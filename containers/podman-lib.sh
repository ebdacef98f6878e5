# Sourced by containers/test-image.sh and containers/test-feature.sh (bash, set -euo pipefail,
# as root): what both tests need of podman on Debian 12, done one way so that they share the
# base image, the devcontainer CLI and podman's configuration (under $CACHE).
#
# Before sourcing: CACHE (a directory kept between runs) and TMP (this run's, removed after).

BASE_IMAGE=localhost/guardfs-debian:12
DEVCONTAINER_CLI_VERSION=0.89.0

lib_say() { printf '%s: %s\n' "$(basename "$0" .sh)" "$*" >&2; }
lib_stamp() { lib_say "$(date +%T) $*"; }

# podman_packages [npm]: podman, runc and mmdebstrap (and npm for the devcontainer CLI) with
# apt-get when missing.
podman_packages() {
    local want=(podman runc mmdebstrap) missing=() pkg
    [ "${1:-}" = npm ] && ! command -v npm >/dev/null && want+=(npm)
    for pkg in "${want[@]}"; do
        dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
    done
    if [ ${#missing[@]} -gt 0 ]; then
        lib_stamp "installing ${missing[*]}"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
    fi
}

# podman_config: a containers.conf of the tests' own, exported as CONTAINERS_CONF (the user's
# global config is not touched): runc (crun refuses this kernel's hybrid cgroup layout),
# cgroupfs, ulimits at or below the host's hard limits.
podman_config() {
    local hard_nofile hard_nproc nofile=20000 nproc=32768
    hard_nofile=$(ulimit -Hn); hard_nproc=$(ulimit -Hu)
    [ "$hard_nofile" != unlimited ] && [ "$hard_nofile" -lt "$nofile" ] && nofile=$hard_nofile
    [ "$hard_nproc" != unlimited ] && [ "$hard_nproc" -lt "$nproc" ] && nproc=$hard_nproc
    cat > "$CACHE/containers.conf" <<EOF
# Written by containers/podman-lib.sh; used through CONTAINERS_CONF by the container tests only.
[containers]
default_ulimits = ["nofile=$nofile:$nofile", "nproc=$nproc:$nproc"]
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
EOF
    export CONTAINERS_CONF=$CACHE/containers.conf
}

# base_image: a Debian 12 base image built with mmdebstrap from Debian's archive as the host's
# apt sources name it, imported as $BASE_IMAGE (no image registry needed; kept: skipped when
# present). A lock keeps two tests (pytest-xdist workers) from building it at once.
base_image() {
    exec 9> "$CACHE/setup.lock"
    flock 9
    if ! podman image exists "$BASE_IMAGE"; then
        local sources=() f
        for f in /etc/apt/sources.list.d/*.sources; do
            [ -f "$f" ] && grep -Eq 'debian-archive-keyring|[/.]debian\.org' "$f" && sources+=("$f")
        done
        for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
            [ -f "$f" ] || continue
            grep -E '^deb .*[/.]debian\.org' "$f" > "$TMP/$(basename "$f").list" && sources+=("$TMP/$(basename "$f").list")
        done
        lib_stamp "building $BASE_IMAGE with mmdebstrap from ${sources[*]:-the default Debian mirror}"
        mmdebstrap --quiet --variant=minbase --include=ca-certificates bookworm "$TMP/base.tar" "${sources[@]}" >&2
        podman import --quiet --change 'CMD ["/bin/bash"]' "$TMP/base.tar" "$BASE_IMAGE" >&2
        rm -f "$TMP/base.tar"
    fi
    flock -u 9
    exec 9>&-
}

# extra_ca FILE: the host's extra CA certificates (a TLS-inspecting proxy's) concatenated into
# FILE, empty when there are none.
extra_ca() {
    find /usr/local/share/ca-certificates -name '*.crt' -type f -exec cat {} + > "$1" 2>/dev/null || true
}

# pip_index_env: pip's index settings as KEY=VALUE lines, the network ones (http/https) from
# PIP_* or pip's config files: local file:// indexes and find-links of the host do not exist
# in a build.
pip_index_env() {
    python3 - <<'PY'
import configparser, os
keys = {"index-url": "PIP_INDEX_URL", "extra-index-url": "PIP_EXTRA_INDEX_URL", "timeout": "PIP_DEFAULT_TIMEOUT",
        "default-timeout": "PIP_DEFAULT_TIMEOUT"}
found = {}
home = os.path.expanduser("~")
for path in ("/etc/xdg/pip/pip.conf", "/etc/pip.conf", f"{home}/.pip/pip.conf", f"{home}/.config/pip/pip.conf"):
    cp = configparser.ConfigParser()
    cp.read(path)
    for key, env in keys.items():
        if cp.has_option("global", key):
            found[env] = cp.get("global", key)
for env in set(keys.values()):
    if os.environ.get(env):
        found[env] = os.environ[env]
for env, value in sorted(found.items()):
    if env != "PIP_DEFAULT_TIMEOUT":
        value = " ".join(u for u in value.split() if u.startswith(("http://", "https://")))
    print(f"{env}={value}")
PY
}

# devcontainer_cli: the path of @devcontainers/cli (pinned, from npm, under $CACHE; installed
# under the same lock as the base image, the two tests may start together).
devcontainer_cli() {
    local dir=$CACHE/devcontainers-cli-$DEVCONTAINER_CLI_VERSION
    exec 9> "$CACHE/setup.lock"
    flock 9
    if [ ! -x "$dir/node_modules/.bin/devcontainer" ]; then
        lib_stamp "installing @devcontainers/cli@$DEVCONTAINER_CLI_VERSION into $dir"
        npm install --silent --no-audit --no-fund --prefix "$dir" "@devcontainers/cli@$DEVCONTAINER_CLI_VERSION" >&2
    fi
    flock -u 9
    exec 9>&-
    echo "$dir/node_modules/.bin/devcontainer"
}
