"""The kernel's directory-listing cache and FLUSH-less closes (guardfs.fusereply): fewer
requests, the same answers, through a real mount."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from guardfs import fusereply

from .helpers import wait_for
from .mounts import Guarded, guarded_mount

pytestmark = pytest.mark.mount


def _warm(g: Guarded) -> None:
    """One reply to an open through the C module proves it is in pyfuse3's path; flags
    follow from then on (and directories are read by inode from the first OPENDIR on)."""
    (g.mnt / "src/checkout/tax.py").read_bytes()
    assert fusereply.active(), "guardfs._fusereply is not built or not in pyfuse3's path"
    assert fusereply.dirs_by_inode()


def _tree(tmp_path: Path) -> None:
    checkout = tmp_path / "backing/src/checkout"
    checkout.mkdir(parents=True)
    (checkout / "tax.py").write_text("RATE = 7\n")
    (checkout / "cart.py").write_text("ITEMS = []\n")


def test_a_directory_listed_again_is_served_by_the_kernel(tmp_path: Path) -> None:
    _tree(tmp_path)
    with guarded_mount(tmp_path, count_calls=True) as g:
        _warm(g)
        first = sorted(os.listdir(g.mnt / "src/checkout"))
        assert first == ["cart.py", "tax.py"]
        listed = g.calls["readdir"]
        for _ in range(5):
            assert sorted(os.listdir(g.mnt / "src/checkout")) == first
            assert sorted(os.listdir(g.mnt / "src")) == ["checkout"]
        assert g.calls["readdir"] == 2 * listed, "a listing of an unchanged directory reached the filesystem again"
        # One OPENDIR at most, ever (answered ENOSYS), and no RELEASEDIR.
        assert g.calls.get("opendir", 0) <= 1 and "releasedir" not in g.calls, g.calls


def test_the_cached_listing_follows_every_change_through_the_mount(tmp_path: Path) -> None:
    _tree(tmp_path)
    with guarded_mount(tmp_path, run_dir=tmp_path / "run") as g:  # a run directory: a scratch layer
        _warm(g)
        checkout = g.mnt / "src/checkout"
        assert sorted(os.listdir(checkout)) == ["cart.py", "tax.py"]
        (checkout / "coupon.py").write_text("MIN = 0\n")
        assert sorted(os.listdir(checkout)) == ["cart.py", "coupon.py", "tax.py"]
        os.rename(checkout / "cart.py", checkout / "basket.py")
        assert sorted(os.listdir(checkout)) == ["basket.py", "coupon.py", "tax.py"]
        (checkout / "tax.py").unlink()
        (checkout / "lib").mkdir()
        assert sorted(os.listdir(checkout)) == ["basket.py", "coupon.py", "lib"]
        # Generated output out of scope lands in the run's scratch layer, listed where it was made.
        (g.mnt / "src/__pycache__").mkdir()
        assert "__pycache__" in os.listdir(g.mnt / "src")
        assert not (g.backing / "src/__pycache__").exists()


def test_a_change_behind_the_mount_is_listed_once_attributes_expire(tmp_path: Path) -> None:
    """The host's own change is seen as every cached attribute is: within the cache timeout.
    A forbidden name it creates is never listed."""
    _tree(tmp_path)
    with guarded_mount(tmp_path, cache_timeout=0.5) as g:
        _warm(g)
        checkout = g.mnt / "src/checkout"
        assert sorted(os.listdir(checkout)) == ["cart.py", "tax.py"]
        (g.backing / "src/checkout/host.py").write_text("BY_HOST = 1\n")
        (g.backing / "src/checkout/.env.local").write_text("KEY=secret\n")
        wait_for(lambda: "host.py" in os.listdir(checkout), "the host's new file in the listing", timeout=10)
        assert sorted(os.listdir(checkout)) == ["cart.py", "host.py", "tax.py"]


def test_a_file_read_and_closed_sends_no_flush_and_a_write_still_counts_at_close(tmp_path: Path) -> None:
    _tree(tmp_path)
    with guarded_mount(tmp_path, count_calls=True) as g:
        _warm(g)
        applied = fusereply.applied()
        before = g.calls.get("flush", 0)
        for _ in range(3):
            assert (g.mnt / "src/checkout/tax.py").read_text() == "RATE = 7\n"
        assert g.calls.get("flush", 0) == before, "closing a file opened for reading sent FLUSH"
        assert fusereply.applied() >= applied + 3
        (g.mnt / "src/checkout/tax.py").write_text("RATE = 8\n")
        assert g.calls["flush"] > before
        # The rewrite is counted when close(2) returns, as before: the next open sees it.
        assert g.fs.accounting.files["src/checkout/tax.py"].rewrites == 1


@pytest.mark.parametrize("entry", ["sandbox.cli", "sandbox.launch.run", "guardfs.mount", "sandbox.session"])
def test_every_entry_point_loads_the_c_module_before_pyfuse3(entry: str) -> None:
    """Loaded after pyfuse3, the module is never called and the cache silently stays off."""
    code = f"import {entry}; import pyfuse3; from guardfs import fusereply; assert fusereply.loaded_first(), {entry!r}"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr


def test_a_listing_starts_with_dot_and_dot_dot_and_holds_no_reference_for_them(tmp_path: Path) -> None:
    """As a local directory lists them, across the several requests a large directory takes;
    readdirplus gives the kernel no reference for either, so the table keeps none."""
    _tree(tmp_path)
    many = tmp_path / "backing/src/checkout/many"
    many.mkdir()
    names = {f"{i:05d}-{'x' * 60}" for i in range(3000)}  # ~200 KiB of entries: many requests
    for name in names:
        (many / name).touch()
    with guarded_mount(tmp_path) as g:
        _warm(g)
        here = os.stat(g.mnt / "src/checkout/many")
        held = {e.path: e.lookups for e in g.fs.inodes if e.path in ("src/checkout", "src/checkout/many")}
        for _ in range(2):  # from the filesystem, then from the kernel's cache
            out = subprocess.run(["ls", "-a", "-f", "-i", str(g.mnt / "src/checkout/many")], capture_output=True,
                                 text=True, check=True).stdout.split("\n")
            listed = [line.split(maxsplit=1) for line in out if line]
            assert [name for _, name in listed[:2]] == [".", ".."]
            assert int(listed[0][0]) == here.st_ino
            assert int(listed[1][0]) == os.stat(g.mnt / "src/checkout").st_ino
            assert sorted(name for _, name in listed[2:]) == sorted(names)  # each once
        assert {e.path: e.lookups for e in g.fs.inodes if e.path in held} == held
        top = subprocess.run(["ls", "-a", "-f", str(g.mnt)], capture_output=True, text=True, check=True).stdout
        assert top.split("\n")[:2] == [".", ".."]
        assert sorted(os.listdir(g.mnt / "src/checkout")) == ["cart.py", "many", "tax.py"]  # no dots for Python
