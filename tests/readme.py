"""What the tests read out of the README, so that what it tells a user is what they run.

The README marks the blocks with HTML comments (``<!-- quick-start -->`` … ``<!-- /quick-start -->``),
invisible on the rendered page; each block is one fenced ``sh`` block, one command a line.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

__all__ = ["README", "QuickStart", "agent_block", "block_lines", "quick_start"]

README = Path(__file__).resolve().parent.parent / "README.md"


def block_lines(name: str, text: str | None = None) -> list[str]:
    """The command lines of the README's block *name*: the fenced block between
    ``<!-- name -->`` and ``<!-- /name -->``, without its fences, blank lines or comments."""
    text = README.read_text(encoding="utf-8") if text is None else text
    found = re.search(rf"<!-- {re.escape(name)} -->\n```[a-z]*\n(.*?)\n```\n<!-- /{re.escape(name)} -->", text, re.S)
    assert found is not None, f"README.md has no <!-- {name} --> block holding one fenced code block"
    lines = [line.split("  #")[0].rstrip() for line in found.group(1).splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


@dataclass(frozen=True)
class QuickStart:
    """The README's quick start: clone a repository, ``guard init``, ``guard run``."""

    clone_dir: str  #: the directory the first line clones into and enters
    init: list[str]  #: ``guard init …``'s argv
    run: list[str]  #: ``guard run …``'s argv


def quick_start(text: str | None = None) -> QuickStart:
    """The README's three quick-start commands, parsed (an AssertionError says what is wrong)."""
    lines = block_lines("quick-start", text)
    assert len(lines) == 3, f"the quick start is three commands, not {len(lines)}: {lines}"
    clone, init, run = lines
    # git clone URL && cd DIR: the test makes that clone from a copy of the same project.
    words = shlex.split(clone)
    assert words[:2] == ["git", "clone"] and words[3:5] == ["&&", "cd"] and len(words) == 6, clone
    assert words[2].rstrip("/").rsplit("/", 1)[-1].removesuffix(".git") == words[5], clone
    init_argv, run_argv = shlex.split(init), shlex.split(run)
    assert init_argv[:2] == ["guard", "init"], init
    assert run_argv[:2] == ["guard", "run"] and "--" in run_argv, run
    return QuickStart(words[5], init_argv, run_argv)


def agent_block(command: str, text: str | None = None) -> list[str]:
    """The argv of the README's headless line for the agent whose command is *command*
    (the ``<!-- agent-blocks -->`` block: ``guard run --ci -- COMMAND …``)."""
    for line in block_lines("agent-blocks", text):
        argv = shlex.split(line)
        if argv[:2] == ["guard", "run"] and "--" in argv and argv[argv.index("--") + 1:][:1] == [command]:
            return argv
    raise AssertionError(f"README.md's agent blocks have no line for {command}")
