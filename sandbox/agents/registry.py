"""The agents guard run knows, one entry each: adding an agent is one entry here (and its parser).

Each :class:`Agent` holds everything agent-specific: the command names that are this agent,
what its command is given to call our hooks for one run (:class:`Launch`: arguments, or a
settings file named by an environment variable — never the user's own config files), the
format name and class of its machine-readable output's parser, the tools of its that write,
its hook convention (:class:`HookConvention`), and the files it keeps in the workspace for
itself. An agent with no hooks (aider) has None for its convention, one with no machine-readable
output None for its format and parser: the mount alone judges what it does. ``guard run``,
``guard feed --format``, ``guard hook``, the daemon's ``hook`` message and the compiled hook
helper all read this table.

Standard library only, like :mod:`sandbox.agents.fasthook`, which imports it (as a sibling
module when run as ``python3 -S -E fasthook.py``): parser classes are named, not imported.
NamedTuple, not dataclasses: importing dataclasses would add tens of milliseconds to every hook.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from sandbox.agents.events import JsonLinesParser

__all__ = ["AGENTS", "FORMATS", "HOOKED", "Agent", "HookConvention", "Launch", "State", "detect"]


class HookConvention(NamedTuple):
    """How an agent runs its hooks and reads their answer."""

    before: str  #: the hook event name before a tool runs
    after: str  #: ... and after it
    #: The exit status that blocks the tool; the reason goes on stderr and reaches the model as
    #: the tool's error. Exit 0 lets the tool run (text on stderr is then a warning).
    block_status: int = 2


class State(NamedTuple):
    """The state an agent needs of its own, as a directory of the run's own: the guard creates it,
    writable, in the staging directory, copies into it the user's files it names, and sets *var*
    to it. The user's own files are never written, nor bound into the sandbox (an agent that could
    write its user's configuration could leave hooks there that run unguarded later); the copies
    are discarded with the run. The rest of the user's home stays hidden."""

    var: str  #: the environment variable that moves the agent's state (CODEX_HOME, CLAUDE_CONFIG_DIR)
    default: str  #: the user's directory when *var* is not set (``~`` is the agent's home)
    files: tuple[str, ...]  #: copied from the user's directory, under the same relative names
    #: Files the agent keeps beside its directory when *var* is not set, and inside it when it
    #: is, each (name in the copy, where it is when *var* is not set): Claude's ``~/.claude.json``.
    beside: tuple[tuple[str, str], ...] = ()


class Launch(NamedTuple):
    """What an agent's command is given, for one run, to call our hooks."""

    args: tuple[str, ...] = ()  #: inserted right after the command's name
    #: Files written for the run, each (environment variable, file name, content): the guard writes
    #: the file and sets the variable to the path where the agent sees it.
    files: tuple[tuple[str, str, str], ...] = ()
    state: State | None = None  #: the agent's state, as the run's own copy


class Agent(NamedTuple):
    """One agent: how it is recognised, launched, parsed and hooked."""

    name: str  #: as --agent, ``guard hook NAME`` and the ``hook`` message name it
    commands: frozenset[str]  #: command names (basename of argv[0]) that are this agent
    stream_format: str | None  #: ``guard feed --format`` name of its machine-readable output, if it has one
    parser: str | None  #: ``module:Class`` of its output parser (imported on first use)
    mutating_tools: frozenset[str]  #: its tools that write (shells count, since they can)
    hook: HookConvention | None  #: None: it runs no hooks
    launch: Callable[[str], Launch]  #: given the shell command of our hook
    #: Its own files in the workspace (gitignore-style patterns, anchored at the top level): its
    #: bookkeeping, kept across runs, never counted, tripped on or rolled back. Never a file that
    #: makes it run a program (a config, a pickled cache): the next run, unguarded, would.
    own_files: tuple[str, ...] = ()
    #: Its caches in the workspace: as uncounted, but written to the run's scratch layer and
    #: dropped with it (what it reads back as code, such as pickles, never reaches the workspace).
    own_caches: tuple[str, ...] = ()

    def parser_class(self) -> type[JsonLinesParser] | None:
        """The output parser's class; None for an agent with no machine-readable output."""
        if self.parser is None:
            return None
        module, _, name = self.parser.partition(":")
        cls: type[JsonLinesParser] = getattr(importlib.import_module(module), name)
        return cls


def _claude(hook: str) -> Launch:
    entry = [{"matcher": "*", "hooks": [{"type": "command", "command": hook, "timeout": 10}]}]
    settings = json.dumps({"hooks": {"PreToolUse": entry, "PostToolUse": entry}}, separators=(",", ":"))
    # Claude Code writes its config (~/.claude.json, rewritten on every start) and its sessions,
    # and needs its login (.credentials.json): a CLAUDE_CONFIG_DIR of the run's own, which also
    # moves .claude.json into it (checked against 2.1.332), with copies of the user's login,
    # settings and memory.
    return Launch(args=("--settings", settings),
                  state=State("CLAUDE_CONFIG_DIR", "~/.claude", (".credentials.json", "settings.json", "CLAUDE.md"),
                              beside=((".claude.json", "~/.claude.json"),)))


def _codex(hook: str) -> Launch:
    quoted = hook.replace("\\", "\\\\").replace('"', '\\"')  # a TOML basic string
    entry = f'[{{matcher="*",hooks=[{{type="command",command="{quoted}",timeout=10}}]}}]'
    # `codex exec` silently skips hooks that are not trusted (their hash persisted in the user's
    # config), and -c overrides never are: --dangerously-bypass-hook-trust runs them for this
    # invocation without writing the user's config. It also runs the user's own enabled but
    # untrusted hooks for this invocation (a project's .codex/ layer stays off while the project
    # is untrusted). Only PreToolUse: Codex's PostToolUse carries the tool's output text and no
    # status (the `exec --json` stream has the exit codes).
    # Codex writes its home (sessions, state database) and exits 1 when it cannot: a CODEX_HOME
    # of the run's own, with copies of the user's login and config, works whatever the sandbox
    # makes of HOME, and keeps the agent from writing the user's config (hook trust included).
    return Launch(args=("--dangerously-bypass-hook-trust", "-c", f"hooks.PreToolUse={entry}"),
                  state=State("CODEX_HOME", "~/.codex", ("auth.json", "config.toml")))


def _gemini(hook: str) -> Launch:
    entry = [{"matcher": ".*", "hooks": [{"type": "command", "command": hook, "timeout": 10000}]}]
    settings = json.dumps({"hooks": {"BeforeTool": entry, "AfterTool": entry}}, indent=2)
    # --skip-trust: headless Gemini exits 55 in a folder the user has not trusted, and trusting it
    # through the user's trustedFolders.json would change their own configuration.
    # Gemini keeps its login, settings and chats in ~/.gemini, which GEMINI_CLI_HOME moves (it
    # stands for the home: checked against 0.61.0): a home of the run's own with copies of those.
    return Launch(args=("--skip-trust",),
                  files=(("GEMINI_CLI_SYSTEM_SETTINGS_PATH", "gemini-settings.json", settings),),
                  state=State("GEMINI_CLI_HOME", "~", tuple(f".gemini/{name}" for name in (
                      "oauth_creds.json", "google_accounts.json", "settings.json", "installation_id", "GEMINI.md"))))


#: aider's fallback git identity, for a user who has none (system scope: the user's own ~/.gitconfig,
#: copied into the run's HOME, and the repository's config win over it; /etc/gitconfig is still read).
_AIDER_GITCONFIG = """\
# guard run: the identity aider commits with when the user's git config names none (aider writes
# one into .git/config otherwise, which the guard refuses); aider credits itself in a trailer.
[user]
\tname = guard
\temail = guard@guardfs.invalid
[include]
\tpath = /etc/gitconfig
"""


def _aider(hook: str) -> Launch:
    del hook  # aider runs no hooks: the mount judges its edits, its shell commands and its commits
    # --analytics-log /dev/stdout: its analytics events, JSON lines with each model call's tokens,
    # on the stdout the guard parses (sandbox.agents.aider); they go nowhere else.
    # --no-gitignore: aider would add ".aider*" to the repository's .gitignore (a change to the
    # user's project, out of most tasks' scope); its files are the guard's to keep apart (own_files).
    # --no-check-update: with --yes-always it would pip-install a newer aider into its own
    # (read-only) installation; --no-show-release-notes: a fresh HOME is a first run each time.
    # The user's own arguments come after these, so theirs win (--gitignore, --analytics ...).
    # HOME: a directory of the run's own, with copies of aider's settings, the user's API keys
    # files (~/.env, as aider reads it), git config (their identity) and analytics choice (else a
    # fresh HOME asks again, and --yes-always would opt in); aider writes its caches there, never
    # into the user's home.
    return Launch(
        args=("--no-gitignore", "--no-check-update", "--no-show-release-notes", "--analytics-log", "/dev/stdout"),
        files=(("GIT_CONFIG_SYSTEM", "aider-gitconfig", _AIDER_GITCONFIG),),
        state=State("HOME", "~", (".aider.conf.yml", ".aider.model.settings.yml", ".aider.model.metadata.json",
                                  ".env", ".aider/oauth-keys.env", ".aider/analytics.json", ".gitconfig")),
    )


_TABLE = (
    Agent(
        name="claude", commands=frozenset({"claude"}), stream_format="claude-stream-json",
        parser="sandbox.agents.claude:ClaudeStreamParser",
        mutating_tools=frozenset({"Write", "Edit", "MultiEdit", "NotebookEdit", "Bash"}),
        hook=HookConvention("PreToolUse", "PostToolUse"), launch=_claude,
    ),
    Agent(
        name="codex", commands=frozenset({"codex"}), stream_format="codex-json",
        parser="sandbox.agents.codex:CodexJsonParser",
        # Its hooks name the shell tool "Bash" (exec_command/shell_command in the model's tools).
        mutating_tools=frozenset({"Bash", "shell", "shell_command", "exec_command", "apply_patch"}),
        hook=HookConvention("PreToolUse", "PostToolUse"), launch=_codex,
    ),
    Agent(
        name="gemini", commands=frozenset({"gemini"}), stream_format="gemini-stream-json",
        parser="sandbox.agents.gemini:GeminiStreamParser",
        mutating_tools=frozenset({"write_file", "replace", "run_shell_command", "edit"}),
        hook=HookConvention("BeforeTool", "AfterTool"), launch=_gemini,
    ),
    Agent(
        # No hooks: it edits files itself from the model's SEARCH/REPLACE blocks. Its output for
        # humans rounds the tokens; its analytics log (to stdout, see _aider) has them whole.
        name="aider", commands=frozenset({"aider"}), stream_format="aider-analytics",
        parser="sandbox.agents.aider:AiderAnalyticsParser",
        mutating_tools=frozenset(), hook=None, launch=_aider,
        # Its histories (chat, input, and the LLM log its docs name) are kept across runs; its
        # repository map's tags cache is a pickle store (diskcache): scratch, rebuilt each run.
        own_files=("/.aider.chat.history.md", "/.aider.input.history", "/.aider.llm.history"),
        own_caches=("/.aider.tags.cache.v*/",),
    ),
)

#: The agents by name.
AGENTS: dict[str, Agent] = {agent.name: agent for agent in _TABLE}
#: The agents by their output's format name (those that have one).
FORMATS: dict[str, Agent] = {agent.stream_format: agent for agent in _TABLE if agent.stream_format is not None}
#: The agents that run our hooks.
HOOKED: dict[str, Agent] = {agent.name: agent for agent in _TABLE if agent.hook is not None}


def detect(command: list[str]) -> Agent | None:
    """The agent *command* runs, from its name; None for any other command."""
    name = command[0].rsplit("/", 1)[-1] if command else ""
    return next((agent for agent in _TABLE if name in agent.commands), None)

