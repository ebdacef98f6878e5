#!/bin/bash
# The guarded devcontainer's entrypoint (runs as root, then runs CMD).
#
# 1. The real workspace is bound to /var/lib/guardfs/real (root-only), /workspace is covered
#    by an empty read-only tmpfs (so that if the guard ever stops, /workspace shows nothing,
#    never the real files), and the guarded view is mounted over it:
#      guard mount --run-dir /run/guardfs /var/lib/guardfs/real /workspace
#    with /workspace/guard.toml, or /etc/guardfs/default-guard.toml when there is none.
# 2. guard-relay opens /run/guard/control.sock to the group `guard` (the developer, `dev`):
#    status, approve and checkpoint pass; stop and rollback do not; and a caller inside a
#    `guard run` sandbox (an agent) is refused. See containers/README.md.
# 3. CMD runs (default: sleep infinity); the container lives as long as it does.
#
# GUARD_MANIFEST overrides the manifest; GUARD_WORKSPACE=off skips all of this.
set -euo pipefail

say() { printf 'guard-entrypoint: %s\n' "$*" >&2; }

WS=/workspace
REAL=/var/lib/guardfs/real
RUN_DIR=/run/guardfs
HUMAN=/run/guard

if [ "${GUARD_WORKSPACE:-on}" = off ]; then
    say "GUARD_WORKSPACE=off: /workspace is NOT guarded"
    exec "$@"
fi
if [ "$(id -u)" -ne 0 ]; then
    say "must start as root to mount the guard (the developer's shell runs as dev); set GUARD_WORKSPACE=off to skip"
    exit 77
fi
if [ ! -c /dev/fuse ]; then
    say "/dev/fuse is missing: run the container with --device /dev/fuse --cap-add SYS_ADMIN (see devcontainer.json)"
    exit 69
fi

manifest=${GUARD_MANIFEST:-}
if [ -z "$manifest" ]; then
    if [ -f "$WS/guard.toml" ]; then manifest=$WS/guard.toml; else manifest=/etc/guardfs/default-guard.toml; fi
fi
# Read before the view covers it, and checked: a bad manifest stops the container here,
# with guard's message, rather than leaving an unguarded workspace.
install -d -m 0700 /var/lib/guardfs
cp "$manifest" /var/lib/guardfs/manifest.toml
guard check --workspace "$WS" /var/lib/guardfs/manifest.toml >/dev/null
say "manifest: $manifest"

install -d -m 0700 "$REAL"
mountpoint -q "$REAL" || mount --bind "$WS" "$REAL"
mount -t tmpfs -o ro,mode=0755,size=4k guardfs-closed "$WS"
install -d -m 0755 "$RUN_DIR"
guard mount --manifest /var/lib/guardfs/manifest.toml --run-dir "$RUN_DIR" "$REAL" "$WS" \
    2>>"$RUN_DIR/guard.log" &
guard_pid=$!
echo "$guard_pid" > /run/guard-mount.pid

for _ in $(seq 1 300); do  # up to 30 s for the mount and the control socket
    [ -S "$RUN_DIR/control.sock" ] && grep -q " $WS fuse" /proc/self/mounts && break
    kill -0 "$guard_pid" 2>/dev/null || { say "guard mount exited; its log:"; cat "$RUN_DIR/guard.log" >&2; exit 70; }
    sleep 0.1
done
grep -q " $WS fuse" /proc/self/mounts || { say "the guarded view did not come up in 30 s"; exit 70; }

install -d -m 0750 -g guard "$HUMAN"
guard-relay "$RUN_DIR/control.sock" "$HUMAN/control.sock" guard 2>>"$RUN_DIR/relay.log" &
relay_pid=$!
for _ in $(seq 1 100); do [ -S "$HUMAN/control.sock" ] && break; sleep 0.1; done
[ -S "$HUMAN/control.sock" ] || { say "guard-relay did not start; its log:"; cat "$RUN_DIR/relay.log" >&2; exit 70; }
say "guarded view mounted over $WS (guard pid $guard_pid); from the developer's shell: guard status --run-dir $HUMAN"

"$@" &
cmd_pid=$!
trap 'kill -TERM "$cmd_pid" 2>/dev/null' TERM INT
# PID 1 reaps; the guard and the relay end with the container (no restart: if the guard
# dies, /workspace shows the closed tmpfs until the container is restarted).
status=0
wait "$cmd_pid" || status=$?
kill -TERM "$relay_pid" "$guard_pid" 2>/dev/null || true
wait || true
exit "$status"
