#!/bin/bash
# Inside the image: run containers/agent-probe.sh as an agent under `guard run --ci` and print
# one line per check, "CHECK name ok" or "CHECK name FAIL detail".
#   check-agent.sh PREFIX root   the guard is root, the agent is the user `agent` (--user agent)
#   check-agent.sh PREFIX user   the guard and the agent are the calling user (the devcontainer)
set -u
prefix=$1 mode=$2
here=$(dirname "$(readlink -f "$0")")
base=$(mktemp -d /tmp/guard-check.XXXXXX)
chmod 0755 "$base"
ws=$base/ws
mkdir -p "$ws/src/checkout"
echo 'x = 1' > "$ws/src/checkout/tax.py"
echo readme > "$ws/README.md"
cat > "$base/guard.toml" <<'TOML'
[task]
id = "container-check"
goal = "Probe the sandbox from inside"
[paths]
allowed = ["src/checkout/"]
TOML
args=(--ci --manifest "$base/guard.toml")
if [ "$mode" = root ]; then
    chown -R agent: "$ws"
    args+=(--user agent)
fi
export GUARD_CHECK_PID_FILE=$base/guard.pid GUARD_CHECK_BACKING=${GUARD_CHECK_BACKING:-}
cd "$ws" || exit 1
# exec keeps the pid: the pid file names the guard itself.
timeout 120 sh -c 'echo $$ > "$GUARD_CHECK_PID_FILE"; exec "$@"' sh guard run "${args[@]}" -- "$here/agent-probe.sh" \
    > "$base/console" 2> "$base/stderr" < /dev/null
status=$?
run_dir=$(sed -n 's/^guard: run directory //p' "$base/stderr" | head -1)
log=$(cat "$run_dir/stdout.log" 2>/dev/null)

check() {  # check NAME CONDITION-EXIT-STATUS DETAIL
    if [ "$2" -eq 0 ]; then echo "CHECK $prefix-$1 ok"; else echo "CHECK $prefix-$1 FAIL $3"; fi
}
probe() { grep -q "^PROBE $1 $2\$" <<<"$log"; }
detail="status $status; probes: $(grep -o 'PROBE .*' <<<"$log" | tr '\n' ';' | head -c 600); stderr: $(tail -c 300 "$base/stderr" | tr '\n' ' ')"

want_uid=$(id -u); [ "$mode" = root ] && want_uid=$(id -u agent)
probe uid "$want_uid"; check agent-uid $? "$detail"
probe umount refused && probe fusermount refused; check cannot-unmount $? "$detail"
probe backing-proc refused && { [ -z "$GUARD_CHECK_BACKING" ] || probe backing-real refused; }
check cannot-reach-backing $? "$detail"
probe signal refused; check cannot-signal-guard $? "$detail"
if [ -S /run/guard/control.sock ]; then probe approve-own-trip refused; check cannot-approve-own-trip $? "$detail"; fi
probe in-scope-write ok && [ "$(cat "$ws/src/checkout/probe.txt" 2>/dev/null)" = ok ]
check in-scope-write $? "$detail"
probe out-of-scope-1 refused && probe alive-after-first-violation ok && [ "$(cat "$ws/README.md")" = readme ]
check out-of-scope-write-refused $? "$detail"
[ "$status" -eq 75 ] && [ ! -e "$ws/other.txt" ]; check exit-75-on-second-violation $? "$detail"
if [ "$mode" = root ]; then
    case $run_dir in /var/lib/guardfs/runs/*) ok=0 ;; *) ok=1 ;; esac
    check default-run-dir $ok "run directory ${run_dir:-none}; $detail"
fi
rm -rf "$base"
[ -n "$run_dir" ] && rm -rf "$run_dir"
exit 0
