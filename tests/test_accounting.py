"""Write accounting and oscillation signatures, as pure functions."""

from __future__ import annotations

import errno

import pytest

from guardfs.accounting import RewritePlan, WriteAccounting, is_scratch_name
from guardfs.decision import ALLOW, LimitsDecider, Request
from guardfs.errors import ManifestError
from guardfs.manifest import parse_manifest
from guardfs.policy import PathPolicy
from guardfs.signature import analyse, content_hash, units_of

from .helpers import FIX_TAX

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


def _write(acct: WriteAccounting, path: str, old: bytes, new: bytes, **kw: bool) -> RewritePlan:
    """Plan and commit one rewrite of *path* (as the filesystem does once it landed)."""
    plan = acct.plan_rewrite(path, old, new, **kw)
    acct.commit_rewrite(plan, old)
    return plan


def test_one_return_is_a_revert_counted_as_a_rewrite_and_a_flip_is_two() -> None:
    acct = WriteAccounting()
    a, b = b"X = 1\n", b"X = 2\n"
    assert _write(acct, "c.py", a, b).returns is None
    revert = _write(acct, "c.py", b, a)  # A -> B -> A
    assert revert.returns == 1 and not revert.over_returns(1) and revert.counts == {"symbol <module>": 2}
    assert acct.files["c.py"].symbols["<module>"] == 2  # counted as a rewrite
    flip = acct.plan_rewrite("c.py", a, b)  # A -> B -> A -> B
    assert flip.returns == 2 and flip.over_returns(1) and not flip.over_returns(2) and not flip.over_returns(None)
    # Planning records nothing: the refused flip leaves the count where it was.
    assert acct.files["c.py"].returns == 1
    assert _write(acct, "c.py", a, b"X = 3\n").returns is None  # moving on is no return
    assert _write(acct, "c.py", b"X = 3\n", b"X = 3\n").returns is None  # nor is a write that changed nothing


def test_unchanged_writes_add_no_version() -> None:
    """A, B, B, A is the one return A, B, A."""
    acct = WriteAccounting()
    a, b = b"a\n", b"b\n"
    _write(acct, "r.txt", a, b)
    assert _write(acct, "r.txt", b, b).unchanged
    assert _write(acct, "r.txt", b, a).returns == 1
    assert acct.files["r.txt"].hashes == [content_hash(a), content_hash(b), content_hash(a)]


def test_decider_limits_returns() -> None:
    """limits.max_returns: 1 by default, refused past it with the rule and what to do."""
    for extra, refused in (("", True), ("max_returns = 2\n", False), ('max_returns = "unlimited"\n', False)):
        manifest = parse_manifest(FIX_TAX + "[limits]\nmax_rewrites = \"unlimited\"\n" + extra)
        acct = WriteAccounting()
        decider = LimitsDecider(manifest.limits, acct)
        path = "src/checkout/tax.py"
        for old, new in ((b"A\n", b"B\n"), (b"B\n", b"A\n")):
            _write(acct, path, old, new)
        plan = acct.plan_rewrite(path, b"A\n", b"B\n")
        request = Request("rename", path, PathPolicy(manifest).classify(path, False), True, rewrite=plan)
        verdict = decider.decide(request, ALLOW)
        assert verdict.allow is not refused, extra
        if refused:
            assert verdict.rule == "limits.max_returns" and verdict.errno == errno.EDQUOT
            assert "return 2 (max_returns=1)" in verdict.reason and "oscillation" in verdict.reason
    assert parse_manifest(FIX_TAX).limits.max_returns == 1
    with pytest.raises(ManifestError, match=r"limits\.max_returns"):
        parse_manifest(FIX_TAX + "[limits]\nmax_returns = 0\n")


def test_a_file_deleted_and_made_again_starts_a_new_history() -> None:
    """echo x > f; rm f; echo x > f: no return; the counts toward max_rewrites stay."""
    acct = WriteAccounting()
    acct.touch("f.txt", created=True)
    x, y = b"x\n", b"y\n"
    _write(acct, "f.txt", b"", x)
    _write(acct, "f.txt", x, y)
    lines = acct.files["f.txt"].regions[0][2]
    acct.removed("f.txt")
    again = _write(acct, "f.txt", b"", x)  # made again with its first content
    assert again.returns is None and again.counts == {}  # a creation: counted at its next rewrite
    assert acct.files["f.txt"].hashes == [content_hash(b""), content_hash(x)]
    assert acct.files["f.txt"].regions[0][2] == lines  # deleting wipes no count
    assert _write(acct, "f.txt", x, y).counts == {"lines 1-1": lines + 2}  # its creation, then this
    assert acct.distinct == 1
    # The new history is judged like any other: A -> B -> A -> B is still two returns.
    assert _write(acct, "f.txt", y, x).returns == 1
    assert acct.plan_rewrite("f.txt", x, y).returns == 2
    acct.removed("unknown.txt")  # never counted: nothing to end


def test_truncation_is_no_version() -> None:
    """truncate -s 123 g; truncate -s 0 g; truncate -s 123 g: sizes, not contents of the agent's."""
    acct = WriteAccounting()
    acct.touch("g", created=True)
    zeros = b"\0" * 123
    for old, new in ((b"", zeros), (zeros, b""), (b"", zeros)):
        plan = _write(acct, "g", old, new, resized=True)
        assert plan.resized and plan.returns is None and plan.counts == {} and not plan.unchanged
    rec = acct.files["g"]
    assert rec.hashes == [content_hash(b"")] and rec.rewrites == 0 and not rec.symbols and not rec.regions
    assert _write(acct, "g", zeros, zeros, resized=True).unchanged  # the same size again: no change
    # Truncating between versions hides no flip: A, (cut), B, (cut), A, (cut), B is two returns.
    a, b = b"def f():\n    return 1\n", b"def f():\n    return 2\n"
    _write(acct, "m.py", a, b"", resized=True)
    assert _write(acct, "m.py", b"", a).unchanged  # cut, then the same content again: no change
    plans, current = [], a
    for new in (b, a, b):
        _write(acct, "m.py", current, b"", resized=True)
        plans.append(_write(acct, "m.py", b"", new))
        current = new
    assert [p.returns for p in plans] == [None, 1, 2]


def test_git_restores_once_per_version() -> None:
    """git stash / pop put back versions git holds: no return, no rewrite, once per version."""
    acct = WriteAccounting(committed=lambda path, data: True)
    a, b = b"A\n", b"B\n"
    _write(acct, "s.txt", a, b)
    stash = _write(acct, "s.txt", b, a, by_git=True)
    pop = _write(acct, "s.txt", a, b, by_git=True)
    assert stash.restored and pop.restored and stash.returns is None and pop.returns is None
    rec = acct.files["s.txt"]
    assert rec.returns == 0 and rec.regions == [[1, 1, 1]]
    assert acct.plan_rewrite("s.txt", b, a, by_git=True).returns == 1  # the same version again: a return
    assert acct.plan_rewrite("s.txt", b, a).returns == 1  # the agent's own return is one at once


def test_hot() -> None:
    acct = WriteAccounting()
    a, b = b"X = 1\n", b"X = 2\n"
    for old, new in ((a, b), (b, a)):
        _write(acct, "c.py", old, new)
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
