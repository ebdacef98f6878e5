"""Blast radius, rewrite limits and returns to an earlier content, through a real mount."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from .helpers import snapshot
from .mounts import guarded_mount

pytestmark = pytest.mark.mount


LIMITED = """
[task]
id = "limits"
goal = "Exercise the limits"

[paths]
allowed = ["src/checkout/"]

[limits]
max_files = 6
max_rewrites = 3
"""

FUNC = "def total(x):\n    return {body}\n\n\ndef other():\n    return 1\n"


def test_seventh_distinct_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "backing/src/checkout").mkdir(parents=True)
    existing = tmp_path / "backing/src/checkout/existing.py"
    existing.write_text("x = 1\n")
    with guarded_mount(tmp_path, LIMITED) as g:
        code = g.mnt / "src/checkout"
        for i in range(5):
            (code / f"f{i}.py").write_text(f"v = {i}\n")
        with open(code / "existing.py", "a") as f:  # the 6th: a change to an existing file
            f.write("y = 2\n")
        assert g.fs.accounting.distinct == 6
        before = snapshot(g.backing)
        with pytest.raises(OSError) as info:
            (code / "f6.py").write_text("v = 6\n")
        assert info.value.errno == errno.EDQUOT
        with pytest.raises(OSError) as info:
            os.mkfifo(code / "pipe")
        assert info.value.errno == errno.EDQUOT
        assert snapshot(g.backing) == before
        # The first six keep their content and stay writable.
        for i in range(5):
            assert (g.backing / f"src/checkout/f{i}.py").read_text() == f"v = {i}\n"
        assert existing.read_text() == "x = 1\ny = 2\n"
        (code / "f0.py").write_text("v = 'again'\n")
        assert (g.backing / "src/checkout/f0.py").read_text() == "v = 'again'\n"
        # A directory does not count.
        (code / "pkg").mkdir()
        events = g.events()
        limit = [e for e in events if e["op"] == "limit"]
        assert limit and limit[0]["rule"] == "limits.max_files"
        denied = [e for e in g.denials() if e["rule"] == "limits.max_files"]
        assert denied[0]["path"] == "src/checkout/f6.py" and denied[0]["errno"] == "EDQUOT"
        assert "max_files=6" in denied[0]["reason"]


def test_fourth_mutation_of_one_function_is_refused(tmp_path: Path) -> None:
    (tmp_path / "backing/src/checkout").mkdir(parents=True)
    tax = tmp_path / "backing/src/checkout/tax.py"
    tax.write_text(FUNC.format(body="x"))
    with guarded_mount(tmp_path, LIMITED) as g:
        path = g.mnt / "src/checkout/tax.py"
        for body in ("x + 1", "max(0, x)", "abs(x)"):  # three in-place rewrites of total()
            path.write_text(FUNC.format(body=body))
        assert g.fs.accounting.files["src/checkout/tax.py"].symbols["total"] == 3
        # Another function in the same file is still fine.
        path.write_text(FUNC.format(body="abs(x)").replace("return 1", "return 2"))
        with pytest.raises(OSError) as info:
            path.write_text(FUNC.format(body="round(x, 2)").replace("return 1", "return 2"))
        assert info.value.errno == errno.EDQUOT
        # The refused rewrite left the file as it was, although it was opened with O_TRUNC.
        assert tax.read_text() == FUNC.format(body="abs(x)").replace("return 1", "return 2")
        assert path.read_text() == tax.read_text()
        # The same through an atomic save: refused at the rename, the target untouched.
        path.write_text(FUNC.format(body="abs(x)").replace("return 1", "return 2"))
        tmp = g.mnt / "src/checkout/tax.py.tmp.1.2"
        tmp.write_text(FUNC.format(body="x * 2").replace("return 1", "return 2"))
        content = tax.read_text()
        with pytest.raises(OSError) as info:
            os.rename(tmp, path)
        assert info.value.errno == errno.EDQUOT
        assert tax.read_text() == content
        denial = [e for e in g.denials() if e["rule"] == "limits.max_rewrites"][-1]
        assert "symbol total" in denial["reason"] and "oscillation" in denial["reason"]


def test_a_return_is_recognised_and_a_second_refused(tmp_path: Path) -> None:
    (tmp_path / "backing/src/checkout").mkdir(parents=True)
    with guarded_mount(tmp_path, LIMITED.replace("max_rewrites = 3", "max_rewrites = 10")) as g:
        path = g.mnt / "src/checkout/rate.py"
        a, b = "RATE = 0.2\n", "RATE = 0.25\n"
        path.write_text(a)
        path.write_text(b)
        assert not any(e.get("returns") for e in g.events())
        path.write_text(a)  # A -> B -> A: a revert, allowed
        returns = [e for e in g.events() if e.get("returns")]
        assert len(returns) == 1 and returns[0]["path"] == "src/checkout/rate.py" and returns[0]["returns"] == 1
        # The flip back, also through an atomic save, is refused (max_returns = 1 by default).
        tmp = g.mnt / "src/checkout/rate.py~"
        tmp.write_text(b)
        with pytest.raises(OSError) as info:
            os.rename(tmp, path)
        assert info.value.errno == errno.EDQUOT
        assert path.read_text() == a
        assert [d["rule"] for d in g.denials()] == ["limits.max_returns"]
