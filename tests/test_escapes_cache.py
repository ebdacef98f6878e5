"""Hostile agents against the kernel's directory-listing cache and FLUSH-less read-only closes
(guardfs._fusereply, guardfs.fusereply), with the C module in pyfuse3's path, missing, and
loaded too late to be called: the answers must be the same, only the number of requests differs.
Each attack runs from inside a real ``guard run --ci``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from .helpers import FIX_TAX, reports, run_events

pytestmark = [pytest.mark.root, pytest.mark.mount]

SECRET = "SECRET=hunter2\n"

# How the guard starts: as `guard`, with guardfs._fusereply unimportable, or with pyfuse3
# imported (and bound to libfuse's fuse_reply_open) before guardfs loads the module. It says,
# on its last line, how many replies passed through the module and how many carried a flag.
LAUNCH = {
    "module": "",
    "no module": "sys.modules['guardfs._fusereply'] = None",
    "bound out": "import pyfuse3",
}
EPILOGUE = """
from guardfs import fusereply
status = main()
seen = 0 if fusereply._module is None else fusereply._module.seen()
print(json.dumps({"seen": seen, "applied": fusereply.applied()}), file=sys.stderr)
sys.exit(status)
"""

SCRIPT = r'''
import errno, json, os
def attempt(name, f):
    try:
        got = f()
    except OSError as err:
        got = errno.errorcode.get(err.errno, str(err.errno))
    print(json.dumps({name: got}), flush=True)
co = "src/checkout"
for i in range(3):  # listed again and again: from the kernel's cache once it can
    attempt(f"list{i}", lambda: sorted(os.listdir(co)))
attempt("read", lambda: open(f"{co}/tax.py").read())  # read-only opens: no FLUSH
attempt("read again", lambda: open(f"{co}/tax.py").read())
# A directory holding a hard link of .env (made before the run) moved into the listed one.
attempt("move", lambda: os.rename(f"{co}/data", f"{co}/sub/data"))
attempt("list moved", lambda: sorted(os.listdir(f"{co}/sub/data")))
attempt("list sub", lambda: sorted(os.listdir(f"{co}/sub")))
# A write, then a read-only open of the same file while the write is still open.
w = open(f"{co}/tax.py", "w")
w.write("RATE = 8\n")
w.flush()
attempt("read while written", lambda: open(f"{co}/tax.py").read())
w.close()
attempt("read written", lambda: open(f"{co}/tax.py").read())
attempt("list end", lambda: sorted(os.listdir(co)))
# Last: contact with a forbidden file trips the breaker (recoverable: the run goes on).
attempt("rename forbidden in", lambda: os.rename(".env", f"{co}/env"))
'''


def _guard_run(tmp_path: Path, launch: str) -> tuple[dict[str, Any], dict[str, int], list[dict[str, Any]],
                                                    subprocess.CompletedProcess[str]]:
    ws = tmp_path / "ws"
    (ws / "src/checkout/sub").mkdir(parents=True)
    (ws / "src/checkout/tax.py").write_text("RATE = 7\n")
    (ws / "src/checkout/data").mkdir()
    (ws / ".env").write_text(SECRET)
    os.link(ws / ".env", ws / "src/checkout/data/env_hl")
    (tmp_path / "manifest.toml").write_text(FIX_TAX)
    python3 = shutil.which("python3", path="/usr/bin:/bin")
    assert python3 is not None
    starter = f"import json, sys\n{LAUNCH[launch]}\nfrom sandbox.cli import main\n{EPILOGUE}"
    proc = subprocess.run(
        [sys.executable, "-c", starter, "run", "--ci", "--manifest", str(tmp_path / "manifest.toml"),
         "--run-dir", str(tmp_path / "run"), "--", python3, "-c", textwrap.dedent(SCRIPT)],
        cwd=ws, capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL,
    )
    seen: dict[str, Any] = {}
    for report in reports(tmp_path / "run/stdout.log"):
        seen.update(report)
    module: dict[str, int] = json.loads(proc.stderr.strip().splitlines()[-1])
    return seen, module, run_events(tmp_path / "run"), proc


@pytest.mark.parametrize("launch", list(LAUNCH))
def test_the_same_answers_with_the_listing_cache_without_it_and_with_the_module_bound_out(
        tmp_path: Path, launch: str) -> None:
    """No forbidden name is ever listed, cached or not (a directory holding another name of
    .env moved into a listed one; .env itself refused a move in, which trips); a listing follows every
    change; a read sees what a write left. Without the module, or with pyfuse3 bound to
    libfuse before it, no reply carries a flag: a flagged handle reaching the kernel would
    come back unknown to the guard (EIO)."""
    seen, module, events, proc = _guard_run(tmp_path, launch)
    assert proc.returncode == 0 and seen["rename forbidden in"] == "EACCES", (seen, proc.stderr[-2000:])
    listed = ["data", "sub", "tax.py"]
    assert [seen[f"list{i}"] for i in range(3)] == [listed] * 3, seen
    assert seen["read"] == seen["read again"] == "RATE = 7\n"
    assert seen["move"] is None and seen["list moved"] == [] and seen["list sub"] == ["data"], seen
    assert seen["read while written"] == seen["read written"] == "RATE = 8\n", seen
    assert seen["list end"] == ["sub", "tax.py"], seen
    assert "hunter2" not in (tmp_path / "run/stdout.log").read_text()
    assert not [e for e in events if e.get("errno") == "EIO"], events
    assert [e["rule"] for e in events if e["op"] == "trip"] == ["forbidden_path"], events
    if launch == "module":
        assert module["seen"] > 0 and module["applied"] > 0, module
    else:
        assert module == {"seen": 0, "applied": 0}, module
