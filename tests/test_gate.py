"""The gate, rename planning and GuardFS's constructor, without a mount: the gate is the
one path from a request to its verdict, accounting, the decider's commit and the event."""

from __future__ import annotations

import errno
import inspect
import json
import os
from pathlib import Path

import pytest
from pyfuse3 import FUSEError

from guardfs.accounting import WriteAccounting
from guardfs.backing import Backing
from guardfs.decision import LimitsDecider, Request, Verdict
from guardfs.events import EventLog
from guardfs.fs import GuardFS
from guardfs.gate import Commit, Gate
from guardfs.manifest import Manifest, parse_manifest
from guardfs.policy import PathPolicy
from guardfs.rename import plan_rename

MANIFEST = """
[task]
id = "gate"
goal = "judge requests"

[paths]
allowed = ["src/"]
forbidden = [".env*"]

[limits]
max_files = 2
max_rewrites = "unlimited"
"""


class _Recorder:
    """A decider that allows what the policy allows (or everything, if *loose*) and
    remembers what it was told was committed."""

    def __init__(self, loose: bool = False) -> None:
        self.loose = loose
        self.committed_ops: list[str] = []

    def decide(self, request: Request, policy: Verdict) -> Verdict:
        return Verdict(True) if self.loose else policy

    def committed(self, request: Request) -> None:
        self.committed_ops.append(request.op)


def _gate(decider: _Recorder | None = None) -> tuple[Gate, Manifest, EventLog, WriteAccounting]:
    manifest = parse_manifest(MANIFEST)
    events, acct = EventLog(None), WriteAccounting()
    policy = PathPolicy(manifest)
    gate = Gate(policy, acct, decider or LimitsDecider(manifest.limits, acct), events, manifest.limits)
    return gate, manifest, events, acct


def test_constructor_takes_three_positional_arguments_then_keywords(tmp_path: Path) -> None:
    params = list(inspect.signature(GuardFS).parameters.values())
    assert [p.name for p in params[:3]] == ["backing", "manifest", "events"]
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params[:3])
    assert [p.name for p in params[3:]] == [
        "decider", "cache_timeout", "state_text", "accounting", "checkpoint_dir", "xattrs", "policy", "gitscope",
        "scratch_dir", "links"]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params[3:])
    with pytest.raises(TypeError):
        GuardFS(str(tmp_path), parse_manifest(MANIFEST), EventLog(None), None)  # type: ignore[call-arg]


def test_a_denial_is_one_event_and_its_errno() -> None:
    gate, _, events, acct = _gate()
    where = gate.policy.classify("docs/a.md", False)
    with pytest.raises(FUSEError) as info:
        gate.ask("create", "docs/a.md", where)
    assert info.value.errno == errno.EROFS
    assert events.counts == {"deny": 1}
    assert not acct.files  # a refused operation counts nothing


def test_a_decider_may_tighten_the_policy_never_loosen_it() -> None:
    gate, _, events, _ = _gate(_Recorder(loose=True))
    with pytest.raises(FUSEError) as info:
        gate.check(Request("lookup", ".env", gate.policy.classify(".env", False), False))
    assert info.value.errno == errno.EACCES
    assert events.counts["deny"] == 1


def test_done_counts_records_commits_and_says_when_the_limit_is_reached() -> None:
    decider = _Recorder()
    gate, _, events, acct = _gate(decider)
    for name in ("src/a.py", "src/b.py"):
        request = gate.ask("create", name, gate.policy.classify(name, False))
        assert request.new_files == (name,)
        gate.done(request)
    assert acct.distinct == 2 and all(acct.files[p].created for p in ("src/a.py", "src/b.py"))
    assert decider.committed_ops == ["create", "create"]
    assert events.counts["create"] == 2 and events.counts["limit"] == 1  # max_files = 2 reached


def test_done_commits_a_rewrite_and_its_units_reach_the_event(tmp_path: Path) -> None:
    gate, _, _, acct = _gate()
    gate.events = EventLog(tmp_path / "events.jsonl")
    where = gate.policy.classify("src/a.py", False)
    old, new = b"def f():\n    return 1\n", b"def f():\n    return 2\n"
    plan = acct.plan_rewrite("src/a.py", old, new)
    gate.done(Request("rewrite", "src/a.py", where, True, rewrite=plan), Commit(rewrite=plan, old=old))
    gate.events.close()
    assert acct.files["src/a.py"].rewrites == 1
    [event] = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert event["op"] == "rewrite" and event["decision"] == "allow"
    assert event["units"] == {"symbol f": 1} and "cycle" not in event


def test_an_atomic_save_is_one_rewrite_of_its_target(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "src/a.py").write_bytes(b"x = 1\n")
    (tmp_path / "src/a.py.tmp.1").write_bytes(b"x = 2\n")
    gate, _, _, acct = _gate()
    acct.touch("src/a.py.tmp.1", created=True)  # a scratch name: not recorded
    backing = Backing(str(tmp_path))
    try:
        src, dst = "src/a.py.tmp.1", "src/a.py"
        request, commit = plan_rename(
            gate, backing,
            (src, os.lstat(tmp_path / src), gate.policy.classify(src, False)),
            (dst, os.lstat(tmp_path / dst), gate.policy.classify(dst, False)),
            exchange=False,
        )
    finally:
        backing.close()
    assert commit.rewrite is not None and commit.rewrite.path == dst and commit.old == b"x = 1\n"
    assert commit.scratch == src and commit.move is None
    assert request.rewrite is commit.rewrite and request.new_files == ()
    gate.check(request)
    gate.done(request, commit)
    assert list(acct.files) == [dst] and acct.files[dst].rewrites == 1


def test_a_file_this_run_created_moves_on_with_its_record(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "src/new.py").write_bytes(b"y = 1\n")
    gate, _, _, acct = _gate()
    acct.touch("src/new.py", created=True)
    backing = Backing(str(tmp_path))
    try:
        request, commit = plan_rename(
            gate, backing,
            ("src/new.py", os.lstat(tmp_path / "src/new.py"), gate.policy.classify("src/new.py", False)),
            ("src/moved.py", None, gate.policy.classify("src/moved.py", False)),
            exchange=False,
        )
    finally:
        backing.close()
    assert commit == Commit(move=("src/new.py", "src/moved.py")) and request.new_files == ()
    gate.done(request, commit)
    assert list(acct.files) == ["src/moved.py"] and acct.distinct == 1
