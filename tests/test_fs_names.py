"""File names that are not UTF-8 travel through the mount losslessly."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from guardfs.events import escape_name, unescape

from .mounts import guarded_mount

pytestmark = pytest.mark.mount


NAME = b"src/checkout/\xff"
PATH = os.fsdecode(NAME)  # "src/checkout/\udcff": the byte kept as a lone surrogate


def test_a_name_that_is_not_utf8_reaches_accounting_and_events(tmp_path: Path) -> None:
    (tmp_path / "backing/src/checkout").mkdir(parents=True)
    with guarded_mount(tmp_path) as g:
        mnt = os.fsencode(g.mnt)
        done = subprocess.run(["touch", mnt + b"/" + NAME], capture_output=True, check=False)
        assert (done.returncode, done.stderr) == (0, b"")
        assert os.path.exists(os.fsencode(g.backing) + b"/" + NAME)  # the very bytes, on disk
        with open(mnt + b"/" + NAME, "ab") as f:
            f.write(b"x = 1\n")
        with open(mnt + b"/" + NAME, "wb") as f:
            f.write(b"x = 2\n")
        assert os.listdir(mnt + b"/src/checkout") == [b"\xff"]
        assert PATH in g.fs.accounting.files and g.fs.accounting.files[PATH].rewrites == 2  # touch wrote nothing
        events = [e for e in g.events() if e["path"] == escape_name(PATH)]
        assert {e["op"] for e in events} >= {"create", "rewrite"}
        # events.jsonl writes the byte as a visible escape, and unescape gives the very bytes back.
        assert events[0]["path"] == "src/checkout/\\xff"
        assert unescape(events[0]["path"]) == NAME
        # STATE.md names it without failing the read (a byte escape, never the raw byte).
        state = (g.mnt / ".guard/STATE.md").read_bytes()
        assert b"src/checkout/\\xff" in state
        state.decode("utf-8")
        os.rename(mnt + b"/" + NAME, mnt + b"/src/checkout/\xfe")
        os.unlink(mnt + b"/src/checkout/\xfe")
        assert unescape(json.loads(g.events_path.read_text().splitlines()[-1])["path"]) == b"src/checkout/\xfe"
        # Out of scope, it is refused like any name, and the denial names it.
        done = subprocess.run(["touch", mnt + b"/out\xff"], capture_output=True, check=False)
        assert done.returncode != 0 and b"Read-only file system" in done.stderr
        denial = g.denials()[-1]
        assert denial["path"] == "out\\xff" and denial["rule"] == "not in paths.allowed"
        assert "out\\xff is outside the task's scope" in denial["reason"]


def test_a_name_replaced_behind_the_mount_is_looked_up_again(tmp_path: Path) -> None:
    """A file replaced in the backing behind the kernel's cached name (as a rollback does,
    before its invalidation lands) is written, not refused: the stale inode answers ESTALE,
    the kernel looks the name up again and retries. """
    (tmp_path / "backing/src/checkout").mkdir(parents=True)
    real = tmp_path / "backing/src/checkout/tax.py"
    real.write_text("v0\n")
    with guarded_mount(tmp_path) as g:
        mine = g.mnt / "src/checkout/tax.py"
        assert mine.read_text() == "v0\n"  # the kernel now caches the name for 60 s
        (tmp_path / "backing/src/checkout/new").write_text("restored\n")
        os.rename(tmp_path / "backing/src/checkout/new", real)
        with open(mine, "a") as f:
            f.write("next\n")
        assert real.read_text() == "restored\nnext\n"
