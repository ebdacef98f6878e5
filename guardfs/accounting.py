"""Write accounting: distinct files mutated, rewrites per file and per symbol, returns.

Pure bookkeeping: the filesystem asks what a mutation *would* do (``plan_*``), lets the
decision object judge the plan, performs the operation, and only then commits the plan.
A refused operation therefore leaves the counters untouched.

Each counted file has a content history: the versions it held, in order. A rewrite back to
an earlier version is a *return* (a revert: A→B→A is one); the decider limits how many a
file may make (``limits.max_returns``), so flipping back and forth trips while one revert
does not. What is no version: a content made by truncation alone (the agent wrote none of
its bytes), and anything before the agent deleted the file (made again, it starts anew).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from guardfs.signature import MAX_ANALYSED_BYTES, Change, analyse, content_hash, units_of

__all__ = ["FileRecord", "RewritePlan", "WriteAccounting", "WriteSession", "is_scratch_name"]

# Names of temporary files that editors, sed -i and atomic writers create next to the file
# they save; they are not counted as new files (the rename onto the target is).
_SCRATCH = re.compile(
    r"""^(\.?\#.*                # emacs lock / autosave
        |sed[A-Za-z0-9]{6}         # sed -i
        |\.?tmp[\w.-]*             # tmpXXXX, .tmpXXXX
        |4913)$                    # vim's write probe
      |(\.swp|\.swx|\.tmp|\.part|~)$
      |\.tmp\.                     # name.tmp.<pid>.<time> (Claude Code, write-file-atomic)
    """,
    re.VERBOSE,
)


def is_scratch_name(path: str) -> bool:
    """Whether *path* looks like an editor's or atomic writer's temporary file."""
    return _SCRATCH.search(path.rsplit("/", 1)[-1]) is not None


@dataclass(slots=True)
class FileRecord:
    """What this run has done to one counted file."""

    created: bool = False  # did not exist before this run touched it
    # The creating write has not been analysed yet: its units are counted (once each) by
    # the next rewrite, which parses that content anyway. Files written once and never
    # again (an extracted tree, generated code) are never parsed.
    creation_pending: bool = False
    rewrites: int = 0
    symbols: Counter[str] = field(default_factory=Counter)
    regions: list[list[int]] = field(default_factory=list)  # [first, last, count]
    # The content history: the versions the file held, in order, since the run first touched
    # it or the agent last deleted it. The counts above survive a deletion; this does not.
    hashes: list[str] = field(default_factory=list)
    # Versions git has put back once without a count: a second return to one is a return like
    # any other, so git itself (checkout of one commit, then another, in a loop) cannot flip
    # the file freely.
    restored: set[str] = field(default_factory=set)
    returns: int = 0  # returns to an earlier version of this history (git's exempt ones aside)
    # Deleted by the agent and not written since: its next content is a creation.
    reborn: bool = False


@dataclass(frozen=True, slots=True)
class RewritePlan:
    """One rewrite of *path*: the counts each unit would reach, and whether it is a return."""

    path: str
    counts: dict[str, int]  # "symbol f" / "lines 3-9" / "file" -> count after this rewrite
    new_hash: str | None  # the version it adds to the history; None: it adds none
    # The file's returns to an earlier version (other than the current one), this one
    # included; None: this rewrite is no return.
    returns: int | None
    change: Change | None
    born: Change | None = None  # the creation's units, counted now (creation_pending)
    unchanged: bool = False  # the content is what it was: a write that changed nothing
    # Git returning the file to an earlier version it holds (`git stash`, `git stash pop`,
    # `git checkout`, `git reset --hard`, `git rebase`): neither a return nor a rewrite.
    restored: bool = False
    # Only the size changed (truncate, ftruncate, an O_TRUNC open, nothing written since):
    # no byte of it is the agent's, so it is no version and no rewrite of any unit.
    resized: bool = False

    @property
    def peak(self) -> tuple[str, int] | None:
        """The unit with the highest count after this rewrite."""
        return max(self.counts.items(), key=lambda kv: kv[1]) if self.counts else None

    def over_returns(self, limit: int | None) -> bool:
        """Whether this rewrite is a return past *limit* (``limits.max_returns``; None: unlimited)."""
        return self.returns is not None and limit is not None and self.returns > limit


@dataclass(slots=True)
class WriteSession:
    """One open-for-write of a counted file, from open (or the last flush) to close.

    Only the pre-image is kept; the new content is read back from the disk when the
    session ends, so writes through other handles or a path truncate are seen as they are.
    """

    path: str
    old: bytes | None  # None: too large to analyse
    by_git: bool = False  # opened by the git binary (guardfs.gitguard.is_git_process)


class WriteAccounting:
    """Counters for the files an agent mutates during one run."""

    def __init__(self, committed: Callable[[str, bytes], bool] | None = None) -> None:
        self.files: dict[str, FileRecord] = {}
        #: Whether git holds content for a path (see guardfs.gitscope.GitScope.committed_version);
        #: None: no repository to ask.
        self.committed = committed

    @property
    def distinct(self) -> int:
        """Number of distinct counted files mutated so far."""
        return len(self.files)

    def is_new(self, path: str) -> bool:
        """Whether mutating *path* would add a file to the blast radius."""
        return path not in self.files and not is_scratch_name(path)

    def touch(self, path: str, created: bool = False) -> None:
        """Record a mutation of *path* that is not a content rewrite (create, chmod, unlink)."""
        if path in self.files or is_scratch_name(path):
            return
        self.files[path] = FileRecord(created=created)

    def plan_rewrite(self, path: str, old: bytes | None, new: bytes | None, by_git: bool = False,
                     resized: bool = False) -> RewritePlan:
        """What rewriting *path* from *old* to *new* would count (nothing is recorded);
        *by_git*: git itself writes it (a checkout, stash, reset or rebase); *resized*: only
        truncations made *new*, no write (see RewritePlan.resized)."""
        if resized:
            return RewritePlan(path, {}, None, None, None, unchanged=old is not None and old == new, resized=True)
        rec = self.files.get(path) or FileRecord(created=old is None)
        counts: dict[str, int] = {}
        change = born = None
        analysable = new is not None and len(new) <= MAX_ANALYSED_BYTES and (
            old is None or len(old) <= MAX_ANALYSED_BYTES
        )
        if not old and _creating(rec):
            pass  # the creating write: analysed lazily, see FileRecord.creation_pending
        elif analysable:
            assert new is not None
            base = rec
            if rec.creation_pending:
                born = units_of(path, old or b"")
                base = _bumped(rec, born)
            change = analyse(path, old or b"", new)
            for sym in change.symbols:
                counts[f"symbol {sym}"] = base.symbols[sym] + 1
            for lo, hi in change.regions:
                slot = _region_slot(base.regions, lo, hi)
                counts[f"lines {lo}-{hi}"] = (base.regions[slot][2] if slot is not None else 0) + 1
        else:  # too large to analyse: the whole file is the unit
            counts["file"] = rec.rewrites + 1
        new_hash = content_hash(new) if new is not None else None
        history = rec.hashes or ([content_hash(old)] if old is not None else [])
        returning = new_hash is not None and new_hash in history[:-1] and new_hash != history[-1]
        unchanged = new_hash is not None and bool(history) and new_hash == history[-1]
        # Git putting back a version it holds (asked only of a return by git, so rarely):
        # not an oscillation of the agent's, nor its rewrite. The agent's own return to an
        # earlier version (its editor, its shell) is a return, counted as a rewrite.
        restored = (returning and by_git and new is not None and new_hash not in rec.restored
                    and self.committed is not None and self.committed(path, new))
        if restored:
            counts, change, born = {}, None, None
        returns = rec.returns + 1 if returning and not restored else None
        return RewritePlan(path, counts, new_hash, returns, change, born, unchanged, restored)

    def commit_rewrite(self, plan: RewritePlan, old: bytes | None) -> None:
        """Record a rewrite that was allowed and performed (scratch files are not tracked)."""
        if is_scratch_name(plan.path):
            return
        rec = self.files.get(plan.path)
        if rec is None:
            rec = self.files[plan.path] = FileRecord(created=old is None)
        if old is not None and not rec.hashes:
            rec.hashes.append(content_hash(old))
        if plan.resized:
            return  # no version, no unit: the write that fills it in is the rewrite
        if plan.restored:
            if plan.new_hash is not None:
                rec.hashes.append(plan.new_hash)
                rec.restored.add(plan.new_hash)
            return
        if plan.born is not None:
            _bump(rec, plan.born)
        if plan.change is not None:
            _bump(rec, plan.change)
        rec.creation_pending = (rec.creation_pending and plan.change is None) or (
            _creating(rec) and plan.change is None and not plan.counts
        )
        rec.rewrites += 1
        rec.reborn = False
        if plan.returns is not None:
            rec.returns = plan.returns
        # The history holds committed versions: a write that left the content as it was
        # adds none (so A, B, B, A is the return A, B, A).
        if plan.new_hash is not None and not (rec.hashes and rec.hashes[-1] == plan.new_hash):
            rec.hashes.append(plan.new_hash)

    def removed(self, path: str) -> None:
        """The agent deleted *path*: a file made there again starts a new content history
        (no return to what the deleted one held), its first content a creation. Its counts
        toward max_rewrites stay, so deleting is no way around them. (Git's own deletions,
        a checkout's unlink before it writes a version back, are not reported here.)"""
        rec = self.files.get(path)
        if rec is None:
            return
        rec.hashes.clear()
        rec.restored.clear()
        rec.returns = 0
        rec.creation_pending = False  # the deleted content's units are gone uncounted
        rec.reborn = True

    def put_back(self, path: str, data: bytes | None) -> None:
        """The guard's rollback put *data* back at *path* (None: too large to hash): the
        current version of its history, neither a return nor a rewrite of the agent's."""
        rec = self.files.get(path)
        if rec is None or data is None:
            return
        version = content_hash(data)
        if not rec.hashes or rec.hashes[-1] != version:
            rec.hashes.append(version)

    def forget_scratch(self, path: str) -> None:
        """Drop a file that was only a step of an atomic save (renamed onto its target)."""
        rec = self.files.get(path)
        if rec is not None and rec.created:
            del self.files[path]

    def move(self, src: str, dst: str) -> None:
        """Records at or below *src* now live at *dst* (a rename that carried them)."""
        prefix = src + "/"
        for path in [p for p in self.files if p == src or p.startswith(prefix)]:
            self.files[dst + path[len(src):]] = self.files.pop(path)

    def hot(self, path: str, limit: int) -> bool:
        """Whether one more rewrite of *path* could exceed *limit* for some unit."""
        rec = self.files.get(path)
        if rec is None:
            return False
        if rec.creation_pending and limit <= 1:
            return True
        if rec.rewrites >= limit and not rec.symbols and not rec.regions:
            return True
        return any(n >= limit for n in rec.symbols.values()) or any(r[2] >= limit for r in rec.regions)

    def summary(self) -> dict[str, object]:
        """Counters for the ledger and the closing summary."""
        return {
            "distinct_files": self.distinct,
            "files": {
                p: {"rewrites": r.rewrites, "created": r.created, "symbols": dict(r.symbols)}
                for p, r in sorted(self.files.items())
            },
        }


def _creating(rec: FileRecord) -> bool:
    """Whether *rec*'s next content (from empty) is its creation: made by this run and not
    rewritten yet, or made again after the agent deleted it."""
    return rec.reborn or (rec.created and rec.rewrites == 0)


def _region_slot(regions: list[list[int]], lo: int, hi: int) -> int | None:
    for i, (a, b, _n) in enumerate(regions):
        if lo <= b and a <= hi:
            return i
    return None


def _bump(rec: FileRecord, change: Change) -> None:
    """Count one mutation of every unit *change* names."""
    for sym in change.symbols:
        rec.symbols[sym] += 1
    for lo, hi in change.regions:
        slot = _region_slot(rec.regions, lo, hi)
        if slot is None:
            rec.regions.append([lo, hi, 1])
        else:
            r = rec.regions[slot]
            r[0], r[1], r[2] = min(r[0], lo), max(r[1], hi), r[2] + 1


def _bumped(rec: FileRecord, change: Change) -> FileRecord:
    """A copy of *rec* with *change* counted."""
    copy = FileRecord(rec.created, rec.creation_pending, rec.rewrites, Counter(rec.symbols),
                      [list(r) for r in rec.regions], list(rec.hashes))
    _bump(copy, change)
    return copy

