"""aider's entry in the agents' table, without aider: its own files in the policy, its fallback git
identity as real git reads it, and the scripted Chat Completions server the real-aider tests use
(tests/test_real_aider.py runs aider itself)."""

from __future__ import annotations

import json
import os
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from guardfs.manifest import parse_manifest
from guardfs.policy import AGENT_FILES_RULE, GENERATED_KEYS, PathPolicy, Scope
from sandbox.agents import hooks
from sandbox.agents.aider import AiderAnalyticsParser
from sandbox.agents.events import Step
from sandbox.agents.registry import AGENTS, HOOKED, detect

from .chat_server import Reply, scripted_chat
from .helpers import FIX_TAX, require

AIDER = AGENTS["aider"]


def policy(manifest: str = FIX_TAX) -> PathPolicy:
    return PathPolicy(parse_manifest(manifest), agent_files=AIDER.own_files, agent_caches=AIDER.own_caches)


@pytest.mark.parametrize(("path", "is_dir", "scope"), [
    # its histories: writable where they are (the top level, out of scope), kept in the workspace
    (".aider.chat.history.md", False, Scope.GENERATED),
    (".aider.input.history", False, Scope.GENERATED),
    (".aider.llm.history", False, Scope.GENERATED),
    # its tags cache (a pickle store): the scratch layer, whatever its version
    (".aider.tags.cache.v4", True, Scope.GENERATED_OUTSIDE),
    (".aider.tags.cache.v4/cache.db", False, Scope.GENERATED_OUTSIDE),
    (".aider.tags.cache.v5/cache.db-wal", False, Scope.GENERATED_OUTSIDE),
    # what it reads as settings (a config may name programs to run) is the user's, not its own
    (".aider.conf.yml", False, Scope.OUT_OF_SCOPE),
    (".aider.model.settings.yml", False, Scope.OUT_OF_SCOPE),
    (".aiderignore", False, Scope.OUT_OF_SCOPE),
    # only at the top level, where aider keeps them
    ("src/.aider.chat.history.md", False, Scope.OUT_OF_SCOPE),
    ("src/checkout/.aider.chat.history.md", False, Scope.ALLOWED),
])
def test_aiders_own_files_and_caches(path: str, is_dir: bool, scope: Scope) -> None:
    where = policy().classify(path, is_dir)
    assert where.scope is scope, where
    if scope in (Scope.GENERATED, Scope.GENERATED_OUTSIDE):
        # never counted, never tripped on (a refusal under the rule is quiet), never rolled back
        assert where.key == AGENT_FILES_RULE in GENERATED_KEYS and not where.scope.counted
        assert policy().generated(path, is_dir)


@pytest.mark.parametrize(("key", "scope"), [("secret", Scope.FORBIDDEN), ("forbidden", Scope.FORBIDDEN),
                                          ("protected", Scope.PROTECTED)])
def test_a_secret_or_protected_pattern_wins_over_the_agents_own_files(key: str, scope: Scope) -> None:
    where = policy(f'[task]\nid = "t"\ngoal = "g"\n[paths]\n{key} = [".aider*"]\n').classify(
        ".aider.chat.history.md", False)
    assert where.scope is scope and where.pattern == ".aider*", where
    # and another agent's run has no such files
    assert PathPolicy(parse_manifest(FIX_TAX)).classify(".aider.chat.history.md", False).scope is Scope.OUT_OF_SCOPE


def test_aider_is_detected_and_launched_without_hooks() -> None:
    assert detect(["/home/u/.local/bin/aider", "--message", "x"]) is AIDER
    assert "aider" not in HOOKED and AIDER.parser_class() is AiderAnalyticsParser
    argv, setup = hooks.launch("aider", ["/home/u/.local/bin/aider", "--gitignore", "--message", "x"])
    # guard's arguments first: the user's own (here --gitignore) come later and win
    assert argv == ["/home/u/.local/bin/aider", "--no-gitignore", "--no-check-update", "--no-show-release-notes",
                    "--analytics-log", "/dev/stdout", "--gitignore", "--message", "x"]
    assert setup.state is not None and setup.state[:2] == ("HOME", "~")
    assert {".gitconfig", ".aider/analytics.json"} <= set(setup.state.files)


def test_aiders_analytics_lines_are_its_model_calls() -> None:
    # The lines aider 0.86.2 writes (aider/analytics.py: event(); base_coder.py: "message_send"),
    # among its output for humans.
    send = {"event": "message_send", "properties": {
        "main_model": "openai/scripted", "weak_model": "openai/scripted", "editor_model": "openai/scripted",
        "edit_format": "diff", "prompt_tokens": 2512, "completion_tokens": 59, "total_tokens": 2571,
        "cost": 0.0, "total_cost": 0.0}, "user_id": "6f1c", "time": 1764621600}
    parser = AiderAnalyticsParser()
    lines = [b"Tokens: 2.5k sent, 59 received.", json.dumps({"event": "launched", "properties": {}}).encode(),
             json.dumps(send).encode(), json.dumps(send).encode() + b"\r",  # a pty's line end
             json.dumps({"event": "message_send", "properties": {"prompt_tokens": "2.5k"}}).encode()]
    events = [e for line in lines for e in parser.feed(line)]
    assert events == [Step("message-1", 2512, 59), Step("message-2", 2512, 59)]
    assert parser.skipped == 1  # a count of the wrong type: skipped, not a crash


def _git_identity(tmp_path: Path, home_config: str | None, repo_config: str | None = None) -> tuple[str, str]:
    """user.name and user.email as git reads them with aider's GIT_CONFIG_SYSTEM, in a repository."""
    git = require("git")
    (var, name, content), = AGENTS["aider"].launch("").files
    tmp_path.mkdir()
    system = tmp_path / name
    system.write_text(content)
    home, repo = tmp_path / "home", tmp_path / "repo"
    home.mkdir()
    if home_config is not None:
        (home / ".gitconfig").write_text(home_config)
    subprocess.run([git, "init", "-q", str(repo)], check=True)
    if repo_config is not None:
        with open(repo / ".git/config", "a") as f:
            f.write(repo_config)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GIT_", "XDG_CONFIG"))}
    env.update({var: str(system), "HOME": str(home)})
    out = [subprocess.run([git, "config", "--get", key], cwd=repo, env=env, capture_output=True, text=True,
                          check=True).stdout.strip() for key in ("user.name", "user.email")]
    return out[0], out[1]


def test_the_fallback_git_identity_holds_only_where_the_user_has_none(tmp_path: Path) -> None:
    # aider checks `git config --get user.name/user.email` and writes .git/config when they are
    # missing; the fallback makes them present, and the user's own (global or the repository's) win.
    assert _git_identity(tmp_path / "a", None) == ("guard", "guard@guardfs.invalid")
    mine = "[user]\n\tname = Dana Dev\n\temail = dana@example.com\n"
    assert _git_identity(tmp_path / "b", mine) == ("Dana Dev", "dana@example.com")
    assert _git_identity(tmp_path / "c", None, "[user]\n\tname = Repo Bot\n\temail = bot@example.com\n") == (
        "Repo Bot", "bot@example.com")


def _post(url: str, body: dict[str, Any]) -> bytes:
    # A loopback http URL of the test's own.
    req = urllib.request.Request(f"{url}/chat/completions", json.dumps(body).encode(),  # noqa: S310
                                 {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as resp:  # noqa: S310
        data: bytes = resp.read()
        return data


def test_the_chat_server_answers_streamed_and_whole() -> None:
    with scripted_chat([Reply("one\ntwo\n"), Reply("three")]) as (url, model):
        streamed = _post(url, {"model": "scripted", "stream": True, "stream_options": {"include_usage": True},
                               "messages": [{"role": "user", "content": "hi"}]})
        whole = json.loads(_post(url, {"model": "scripted", "messages": [{"role": "user", "content": "again"}]}))
        commit = json.loads(_post(url, {"model": "scripted", "messages": [
            {"role": "system", "content": "You generate concise, one-line Git commit messages"}]}))
    chunks = [json.loads(line[6:]) for line in streamed.decode().splitlines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == "one\ntwo\n"
    assert chunks[-1]["usage"]["total_tokens"] == 1600 and streamed.endswith(b"data: [DONE]\n\n")
    assert whole["choices"][0]["message"]["content"] == "three"
    assert commit["choices"][0]["message"]["content"] == "fix: round the tax to cents"
    assert model.shown() == ["hi", "again"] and model.commits == 1


def test_aiders_home_is_the_runs_own_with_copies_of_the_users_files(tmp_path: Path) -> None:
    home, stage = tmp_path / "home", tmp_path / "stage"
    (home / ".aider").mkdir(parents=True)
    stage.mkdir()
    choice = '{"uuid": "6f1c", "permanently_disable": true, "asked_opt_in": true}'
    (home / ".aider/analytics.json").write_text(choice)
    (home / ".gitconfig").write_text("[user]\n\tname = Dana Dev\n")
    (home / ".ssh").mkdir()
    (home / ".ssh/id_rsa").write_text("PRIVATE\n")
    _, setup = hooks.launch("aider", ["aider"])
    state = hooks.agent_state(setup, stage, {"HOME": str(home)})
    assert state is not None and state != home
    copied = sorted(str(p.relative_to(state)) for p in state.rglob("*") if p.is_file())
    assert copied == [".aider/analytics.json", ".gitconfig"], copied  # what exists of what it names; no key
    assert (state / ".aider/analytics.json").read_text() == choice
