"""The walk of the workspace at start: one for every reader (issue 22) against one per reader.

Usage: .venv/bin/python bench/start_walk.py [--repeat 5] [--tree DIR]

At start a session needs three things of the workspace: the other names of forbidden files
(guardfs.links), where each ``.git`` is and which files are secrets (for the check of git's
history, guardfs.githistory: the secrets when a store holds nameless blobs). Before issue 22
each was a walk of its own; now one walk (``walk_workspace``) feeds the three. Over a real
tree (the standard library of this Python, a few thousand files, unless ``--tree``), copied,
committed with git and given a secret whose blob no tree names (so that all three are
needed), this times both ways on warm caches: "one walk" (what the Session does) and "three
walks" (each reader's own entry point, ``forbidden_links``, ``find_repositories``,
``secret_files``, each walking the workspace). Medians of ``--repeat``; JSON in
``bench/results/start_walk.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sysconfig
import tempfile
import time
from pathlib import Path

from common import ROOT

from guardfs.backing import Backing
from guardfs.githistory import find_repositories, secret_files
from guardfs.links import forbidden_links, walk_workspace
from guardfs.manifest import parse_manifest
from guardfs.policy import PathPolicy, Scope

MANIFEST = """
[task]
id = "bench"
goal = "Time the walk at start"
[paths]
allowed = ["src/"]
forbidden = [".env*", "**/*.pem"]
"""
_GIT = {"GIT_CONFIG_NOSYSTEM": "1", "GIT_AUTHOR_NAME": "b", "GIT_AUTHOR_EMAIL": "b@example.invalid",
        "GIT_COMMITTER_NAME": "b", "GIT_COMMITTER_EMAIL": "b@example.invalid"}


def _workspace(tree: Path, where: Path) -> int:
    """*tree* copied to *where* (no __pycache__, no site-packages), committed, with a nameless
    secret blob; the number of files."""
    shutil.copytree(tree, where, symlinks=True, ignore=shutil.ignore_patterns("__pycache__", "site-packages"))
    env = {**os.environ, "HOME": str(where.parent), **_GIT}
    (where / ".env").write_text("TOKEN=s3cr3t\n")
    for args in (["init", "-q"], ["add", ".env"], ["rm", "-q", "--cached", ".env"], ["add", "-A"],
                 ["commit", "-qm", "tree"]):
        subprocess.run(["git", *args], cwd=where, env=env, check=True, capture_output=True)
    return sum(len(files) for _d, _s, files in os.walk(where))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--tree", type=Path, default=Path(sysconfig.get_paths()["stdlib"]))
    args = parser.parse_args()
    policy = PathPolicy(parse_manifest(MANIFEST))

    def is_secret(path: str) -> bool:
        return policy.classify(path.rstrip("/"), path.endswith("/")).scope is Scope.FORBIDDEN

    with tempfile.TemporaryDirectory(prefix="guardfs-bench-walk-") as tmp:
        ws = Path(tmp) / "ws"
        files = _workspace(args.tree, ws)
        root = str(ws)

        def one() -> tuple[int, int, int]:
            walked = walk_workspace(root, policy)
            return len(walked.links_for(policy)), len(find_repositories(root, walked)), \
                len(secret_files(root, is_secret, walked))

        def three() -> tuple[int, int, int]:
            backing = Backing(root)
            try:
                links = forbidden_links(backing, policy)
            finally:
                backing.close()
            return len(links), len(find_repositories(root)), len(secret_files(root, is_secret))

        assert one() == three(), (one(), three())
        times: dict[str, list[float]] = {"one walk (now)": [], "three walks (one per reader)": []}
        for _ in range(args.repeat):
            for name, fn in (("one walk (now)", one), ("three walks (one per reader)", three)):
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
    medians = {name: statistics.median(values) for name, values in times.items()}
    print(f"workspace: {args.tree} copied, {files} files, committed; medians of {args.repeat}")
    for name, value in medians.items():
        print(f"{name:<30} {value * 1000:8.1f} ms")
    ratio = medians["three walks (one per reader)"] / medians["one walk (now)"]
    print(f"ratio three/one: {ratio:.2f}x")
    out = ROOT / "bench" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "start_walk.json").write_text(json.dumps({"tree": str(args.tree), "files": files, "repeat": args.repeat,
                                                     "seconds": times, "ratio": ratio}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
