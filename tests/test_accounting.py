"""Write accounting and oscillation signatures, as pure functions."""

from __future__ import annotations

import pytest

from guardfs.accounting import WriteAccounting, is_scratch_name
from guardfs.signature import analyse, units_of

SRC = b"""import os

def f(a):
    return a + 1

class C:
    y = 1

    @staticmethod
    def m():
        if True:
            def inner():
                return 2
        return 3

try:
    def g():
        pass
except ImportError:
    def g():
        return None
"""


def test_python_changes_name_the_innermost_symbol() -> None:
    assert analyse("x.py", SRC, SRC.replace(b"a + 1", b"a + 2")).symbols == {"f"}
    assert analyse("x.py", SRC, SRC.replace(b"return 2", b"return 5")).symbols == {"C.m.inner"}
    assert analyse("x.py", SRC, SRC.replace(b"return 3", b"return 4")).symbols == {"C.m"}
    assert analyse("x.py", SRC, SRC.replace(b"y = 1", b"y = 2")).symbols == {"C"}
    assert analyse("x.py", SRC, SRC.replace(b"import os", b"import sys")).symbols == {"<module>"}
    assert analyse("x.py", SRC, SRC.replace(b"        pass", b"        return 0")).symbols == {"g"}
    assert analyse("x.py", SRC, SRC + b"\ndef h():\n    pass\n").symbols == {"h"}
    # Comments-only and blank-line changes outside symbols still name the module.
    assert analyse("x.py", SRC, SRC).symbols == frozenset()


def test_other_files_and_broken_python_fall_back_to_regions() -> None:
    old = b"a\nb\nc\nd\n"
    assert analyse("x.ts", old, b"a\nB\nc\nd\n").regions == ((2, 2),)
    assert analyse("x.py", b"def f(:\n", b"def f():\n").regions == ((1, 1),)
    assert units_of("x.md", old).regions == ((1, 4),)
    assert units_of("x.py", SRC).symbols >= {"f", "C", "C.m", "C.m.inner", "g", "<module>"}


@pytest.mark.parametrize(
    ("name", "scratch"),
    [("tax.py.tmp.123.456", True), (".tax.py.swp", True), ("tax.py~", True), ("sedAb12Cd", True),
     ("tmpk2j3h4", True), ("4913", True), (".#tax.py", True), ("tax.py", False), ("template.py", False),
     ("sed.py", False), ("attempt.py", False)],
)
def test_scratch_names(name: str, scratch: bool) -> None:
    assert is_scratch_name(f"src/{name}") is scratch


def test_creation_counts_once_for_every_unit() -> None:
    acct = WriteAccounting()
    acct.touch("m.py", created=True)
    v1 = b"def f():\n    return 1\n\ndef g():\n    return 1\n"
    plan = acct.plan_rewrite("m.py", b"", v1)
    assert plan.counts == {} and plan.change is None  # not parsed yet
    acct.commit_rewrite(plan, b"")
    v2 = v1.replace(b"return 1\n\ndef g", b"return 2\n\ndef g")
    plan = acct.plan_rewrite("m.py", v1, v2)
    assert plan.counts == {"symbol f": 2}  # its creation, then this change
    acct.commit_rewrite(plan, v1)
    rec = acct.files["m.py"]
    assert rec.symbols == {"f": 2, "g": 1}
    assert not rec.creation_pending


def test_cycle_and_hot() -> None:
    acct = WriteAccounting()
    a, b = b"X = 1\n", b"X = 2\n"
    for old, new in ((a, b), (b, a)):
        plan = acct.plan_rewrite("c.py", old, new)
        acct.commit_rewrite(plan, old)
    assert plan.cycle
    assert acct.files["c.py"].symbols["<module>"] == 2
    assert acct.hot("c.py", 2) and not acct.hot("c.py", 3)
    assert not acct.hot("unknown.py", 1)


def test_distinct_files_and_moves() -> None:
    acct = WriteAccounting()
    acct.touch("a.py", created=True)
    acct.touch("a.py.tmp.1.2", created=True)  # scratch: not counted
    acct.touch("d/x.py")
    assert acct.distinct == 2
    assert acct.is_new("b.py") and not acct.is_new("a.py") and not acct.is_new("b.py~")
    acct.move("d", "e")
    assert set(acct.files) == {"a.py", "e/x.py"}
    acct.forget_scratch("a.py")  # created in this run: an atomic save's temporary moved on
    assert set(acct.files) == {"e/x.py"}
    summary = acct.summary()
    assert summary["distinct_files"] == 1
