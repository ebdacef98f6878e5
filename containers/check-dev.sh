#!/bin/bash
# In the devcontainer, as the developer (`devcontainer exec`): the guard holds /workspace and
# the developer can look and approve, but not unmount, reach the real files, or stop it.
# One line per check: "CHECK devcontainer-name ok|FAIL detail".
set -u
check() { if [ "$2" -eq 0 ]; then echo "CHECK devcontainer-$1 ok"; else echo "CHECK devcontainer-$1 FAIL ${3:-}"; fi; }
mounted() { grep -q ' /workspace fuse' /proc/self/mounts; }
state() { guard status --json --run-dir /run/guard 2>&1 | python3 -c 'import json,sys; print(json.load(sys.stdin)["state"])' 2>&1; }

# devcontainer up returns before the entrypoint is done: wait (bounded) for the relay.
for _ in $(seq 1 300); do [ -S /run/guard/control.sock ] && break; sleep 0.1; done
[ "$(id -un)" = dev ]; check shell-non-root $? "id: $(id)"
mounted; check view-mounted $? "$(grep workspace /proc/self/mounts)"
out=$(guard status --run-dir /run/guard 2>&1); check guard-status $? "$out"
umount /workspace 2>/dev/null; u=$?; fusermount3 -u /workspace 2>/dev/null; f=$?
[ $u -ne 0 ] && [ $f -ne 0 ] && mounted; check cannot-unmount $? "umount $u fusermount3 $f"
! ls /var/lib/guardfs/real >/dev/null 2>&1; check cannot-reach-real $? "$(ls -ld /var/lib/guardfs/real 2>&1)"
! kill -TERM "$(cat /run/guard-mount.pid)" 2>/dev/null; check cannot-signal-guard $? "kill worked"
out=$(guard stop --run-dir /run/guard 2>&1); s=$?
[ $s -ne 0 ] && mounted; check cannot-stop-guard $? "guard stop: $s $out"
# The default manifest is read-only: a first write is refused with feedback, a second trips.
! timeout 20 sh -c 'echo x > /workspace/guard-check-1' 2>/dev/null; check out-of-scope-write-refused $? "written"
timeout 20 sh -c 'echo x > /workspace/guard-check-2' 2>/dev/null
before=$(state)
[ "$before" != closed ] && [ ! -e /workspace/guard-check-1 ]; check second-write-trips $? "state $before"
out=$(timeout 20 guard approve --run-dir /run/guard 2>&1); a=$?
after=$(state)
[ $a -eq 0 ] && [ "$after" != "$before" ]; check human-approves $? "approve: $a $out; state $before -> $after"
exit 0
