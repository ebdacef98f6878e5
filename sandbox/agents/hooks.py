"""``guard hook claude|codex|gemini``: see :mod:`sandbox.agents.fasthook`, which agents run
directly (standard library only, so that it starts in milliseconds)."""

from sandbox.agents.fasthook import MUTATING_TOOLS, run_hook

__all__ = ["MUTATING_TOOLS", "hook_command", "run_hook"]


def hook_command(agent: str) -> str:
    """The shell command an agent's settings name for our hook."""
    import shlex
    import sys

    from sandbox.agents import fasthook

    return f"{shlex.quote(sys.executable)} -S -E {shlex.quote(fasthook.__file__)} {agent}"
