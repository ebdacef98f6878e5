#!/bin/sh
# What an agent under `guard run` tries, run as the agent inside its sandbox by
# containers/check-agent.sh. One line per probe: "PROBE name refused|ok|REACHED detail".
# GUARD_CHECK_PID_FILE names a file holding the guard's pid; GUARD_CHECK_BACKING the real
# directory the agent must not reach (besides the guard's /proc root).
ws=$GUARD_WORKSPACE
guard_pid=$(cat "$GUARD_CHECK_PID_FILE")
refused() {
    name=$1; shift
    if out=$("$@" 2>&1); then echo "PROBE $name REACHED $(echo "$out" | head -c 200)"; else echo "PROBE $name refused"; fi
}
echo "PROBE uid $(id -u)"
refused umount umount "$ws"
refused fusermount fusermount3 -u "$ws"
refused backing-proc ls "/proc/$guard_pid/root$ws"
[ -n "${GUARD_CHECK_BACKING:-}" ] && refused backing-real ls "$GUARD_CHECK_BACKING"
refused signal kill -TERM "$guard_pid"
[ -S /run/guard/control.sock ] && refused approve-own-trip guard approve --run-dir /run/guard
if echo ok > src/checkout/probe.txt; then echo "PROBE in-scope-write ok"; else echo "PROBE in-scope-write REACHED-NOT"; fi
refused out-of-scope-1 sh -c 'echo changed > README.md'
echo "PROBE alive-after-first-violation ok"
refused out-of-scope-2 sh -c 'echo new > other.txt'
