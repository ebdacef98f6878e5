"""The scratch layer's bookkeeping of which paths live in scratch (guardfs.scratch), without a mount."""

from __future__ import annotations

from pathlib import Path

from guardfs.scratch import ScratchBacking


def test_in_scratch_follows_its_roots_as_they_come_and_go(tmp_path: Path) -> None:
    (tmp_path / "ws/src/pkg/__pycache__").mkdir(parents=True)
    layer = ScratchBacking(str(tmp_path / "ws"), tmp_path / "scratch")
    try:
        assert not layer.in_scratch("src/pkg/__pycache__/m.pyc")
        layer._adopt("src/pkg/__pycache__")
        layer._adopt("lib/__pycache__")  # a second root with the same last name
        layer._adopt(".ruff_cache")
        assert layer.in_scratch("src/pkg/__pycache__")
        assert layer.in_scratch("src/pkg/__pycache__/m.pyc")
        assert layer.in_scratch(".ruff_cache/0.1/x")
        # The root's name as a part of other names, or the same name elsewhere, is no root.
        assert not layer.in_scratch("src/pkg/__pycache__x/m.pyc")
        assert not layer.in_scratch("src/__pycache__/m.pyc")
        assert not layer.in_scratch("src/pkg")
        assert not layer.in_scratch("")
        layer.removed("src/pkg/__pycache__")
        assert not layer.in_scratch("src/pkg/__pycache__/m.pyc")
        assert layer.in_scratch("lib/__pycache__/m.pyc")  # its twin stays a root
        layer.removed("lib/__pycache__")
        assert not layer.in_scratch("lib/__pycache__/m.pyc")
        assert layer.in_scratch(".ruff_cache/x")
    finally:
        layer.close()
