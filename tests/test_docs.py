"""The documentation against the code: nothing a user can set, type or meet goes undocumented.

``docs/reference.md`` must name every manifest key (walked from the pydantic models), every CLI
verb and flag (walked from the argparse tree, so verbs added later are found too), every exit
status, breaker rule and state, socket message type and field, and every event kind the code
writes. Every relative link in the README and ``docs/`` must reach an existing file (and
heading). The README stays under 400 lines, cites no test file, and its quick start is the one
``tests/test_first_hour.py`` runs (both read it through ``tests/readme.py``). No mount, no
process: a fraction of a second.
"""

from __future__ import annotations

import argparse
import re
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from guardfs.errors import Exit
from guardfs.rules import RULES, Rule
from guardfs.schema import sections
from sandbox.breaker.protocol import AgentMessage, ControlMessage
from sandbox.cli import _parser

from .readme import README, agent_block, block_lines, quick_start

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
REFERENCE = DOCS / "reference.md"
#: The documents whose links must resolve: the README, the top-level guides and docs/.
DOCUMENTS = [README, ROOT / "CONTRIBUTING.md", ROOT / "SECURITY.md", *sorted(DOCS.glob("*.md"))]


def _section(text: str, heading: str) -> str:
    """The text under the markdown heading *heading* (a whole line, e.g. ``## Sockets``), up to
    the next heading of the same or a higher level."""
    level = len(heading) - len(heading.lstrip("#"))
    lines = text.splitlines()
    assert heading in lines, f"docs/reference.md has no heading {heading!r}"
    start = lines.index(heading) + 1
    end = next((i for i in range(start, len(lines))
                if re.match(rf"#{{1,{level}}} ", lines[i])), len(lines))
    return "\n".join(lines[start:end])


@pytest.fixture(scope="module")
def reference() -> str:
    return REFERENCE.read_text(encoding="utf-8")


# ----- the README --------------------------------------------------------------------


def test_the_readme_is_under_400_lines() -> None:
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines < 400, f"README.md has {lines} lines; move the detail to docs/"


def test_the_readme_cites_no_test_file() -> None:
    text = README.read_text(encoding="utf-8")
    cited = sorted(set(re.findall(r"\btests/[\w/.-]*\.py\b|\btest_\w+\.py\b|\bconftest\.py\b", text)))
    assert cited == [], f"README.md cites tests ({cited}); cite them from docs/ or CONTRIBUTING.md"


def test_the_quick_start_is_three_commands_that_test_first_hour_runs() -> None:
    start = quick_start()  # its own assertions say what is wrong with the block
    assert start.clone_dir == "django-taggit"  # the project test_first_hour builds from PyPI's sdist
    assert start.init[2:-1] == ["--allow", "taggit/", "--allow", "tests/"], start.init
    first_hour = (ROOT / "tests/test_first_hour.py").read_text(encoding="utf-8")
    # The test reads the commands, never copies them: no command line of the block appears there.
    assert "quick_start()" in first_hour and "QUICK_START.init" in first_hour and "QUICK_START.run" in first_hour
    assert '"--allow", "taggit/"' not in first_hour
    assert agent_block("claude")[:3] == ["guard", "run", "--ci"]  # the headless line test_first_hour runs


def test_every_agent_block_runs_guard_with_an_agent() -> None:
    lines = block_lines("agent-blocks")
    assert len(lines) >= 5, lines
    for command in ("claude", "codex", "gemini", "aider"):
        argv = agent_block(command)
        assert argv[argv.index("--") + 1] == command, argv


# ----- docs/reference.md against the code -------------------------------------------


def test_every_manifest_key_of_every_section_is_in_the_reference(reference: str) -> None:
    missing = []
    for name, model in sections().items():
        heading = next((line for line in reference.splitlines() if line.startswith(f"### [{name}]")), None)
        if heading is None:
            missing.append(f"[{name}]")
            continue
        table = _section(reference, heading)
        missing += [f"{name}.{key}" for key in model.model_fields if f"| `{key}` |" not in table]
    assert missing == [], f"docs/reference.md lacks these manifest keys: {missing}"


def _verbs(parser: argparse.ArgumentParser, prefix: str = "guard") -> dict[str, argparse.ArgumentParser]:
    """Every verb of the guard command (and of any verb with verbs of its own), by its words."""
    found: dict[str, argparse.ArgumentParser] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found[f"{prefix} {name}"] = sub
                found.update(_verbs(sub, f"{prefix} {name}"))
    return found


def _arguments(parser: argparse.ArgumentParser, shared: frozenset[str] = frozenset()) -> list[str]:
    """What a user types for each of *parser*'s own arguments: each option string (help, and the
    *shared* ones every verb accepts, aside), a positional's metavar or its choices."""
    out: list[str] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction | argparse._HelpAction) or action.help == argparse.SUPPRESS:
            continue
        if shared.intersection(action.option_strings):
            continue  # -v: documented once, under "Command line", as going before or after the verb
        if action.option_strings:
            out += [o for o in action.option_strings if o.startswith("--") or len(action.option_strings) == 1]
        elif action.choices:
            out += [str(c) for c in action.choices]
        else:
            out.append(str(action.metavar or action.dest.upper()))
    return out


def test_the_parser_has_the_verbs_a_user_is_told_about() -> None:
    verbs = _verbs(_parser())
    assert {"guard run", "guard init", "guard check", "guard report", "guard rollback"} <= set(verbs)


def test_every_cli_verb_and_flag_is_in_the_reference(reference: str) -> None:
    parser = _parser()
    top = _arguments(parser)
    missing = [f"guard {a}" for a in top if f"`{a}`" not in _section(reference, "## Command line")]
    shared = frozenset(top)
    for words, verb in _verbs(parser).items():
        heading = f"### {words}"
        if heading not in reference.splitlines():
            missing.append(words)
            continue
        entry = _section(reference, heading)
        missing += [f"{words} {a}" for a in _arguments(verb, shared) if f"`{a}" not in entry]
    assert missing == [], f"docs/reference.md lacks these verbs or arguments: {missing}"


def test_every_exit_status_is_in_the_reference(reference: str) -> None:
    table = _section(reference, "## Exit statuses")
    missing = [f"{e.value} {e.name}" for e in Exit if f"| {e.value} | `{e.name}` |" not in table]
    assert missing == [], f"docs/reference.md lacks these exit statuses: {missing}"


def test_every_breaker_rule_and_state_is_in_the_reference(reference: str) -> None:
    table = _section(reference, "## Breaker rules and states")
    names = [r.value for r in Rule] + [spec.open_state for spec in RULES.values()]
    names += [spec.limit_key for spec in RULES.values() if spec.limit_key is not None]
    names += ["CLOSED", "HALF_OPEN_REANCHOR"]
    missing = [n for n in names if f"`{n}`" not in table]
    assert missing == [], f"docs/reference.md lacks these breaker rules, states or limits: {missing}"


def _messages(union: object) -> list[type[BaseModel]]:
    """The message models of a discriminated union (``Annotated[A | B, Field(...)]``)."""
    members = typing.get_args(typing.get_args(union)[0])
    assert members and all(issubclass(m, BaseModel) for m in members), union
    return list(members)


@pytest.mark.parametrize(("socket", "union"), [("agent", AgentMessage), ("control", ControlMessage)])
def test_every_socket_message_and_field_is_in_the_reference(reference: str, socket: str, union: object) -> None:
    part = _section(reference, "## Sockets")
    table = part[part.index(f"**The {socket} socket**"):]
    table = table[:table.index("\n\n", table.index("| type |"))]
    missing = []
    for model in _messages(union):
        kind = typing.get_args(model.model_fields["type"].annotation)[0]
        row = next((line for line in table.splitlines() if line.startswith(f"| `{kind}` |")), None)
        if row is None:
            missing.append(kind)
            continue
        missing += [f"{kind}.{f}" for f in model.model_fields if f not in ("v", "type") and f"`{f}`" not in row]
    assert missing == [], f"docs/reference.md's {socket} socket table lacks: {missing}"


def _event_kinds() -> set[str]:
    """The event kinds the code writes by name: the first argument of every ``emit("…"`` call."""
    kinds: set[str] = set()
    for package in ("guardfs", "sandbox"):
        for path in (ROOT / package).rglob("*.py"):
            kinds.update(re.findall(r'emit\(\s*"([a-z_]+)"', path.read_text(encoding="utf-8")))
    return kinds


def test_every_event_kind_is_in_the_reference(reference: str) -> None:
    kinds = _event_kinds()
    assert {"trip", "breaker", "preimage", "protocol"} <= kinds  # the scan finds the calls
    table = _section(reference, "## Events")
    missing = sorted(k for k in kinds | {"dropped", "limit", "rewrite"} if f"`{k}`" not in table)
    assert missing == [], f"docs/reference.md's events table lacks: {missing}"


def test_every_manifest_key_that_names_a_refusal_is_in_the_reference(reference: str) -> None:
    keys: set[str] = set()
    for package in ("guardfs", "sandbox"):
        for path in (ROOT / package).rglob("*.py"):
            keys.update(re.findall(r'"((?:paths|limits|sandbox|breaker)\.[a-z_]+)"', path.read_text(encoding="utf-8")))
    assert {"paths.secret", "limits.max_files"} <= keys  # the scan finds them
    table = _section(reference, "## Breaker rules and states")
    missing = sorted(k for k in keys if f"`{k}`" not in table)
    assert missing == [], f"docs/reference.md does not name these rules of events: {missing}"


def test_the_default_generated_list_is_in_the_reference(reference: str) -> None:
    from guardfs.manifest import DEFAULT_GENERATED, DEFAULT_HOME_SECRETS

    table = _section(reference, "### The default generated list")
    stores = _section(reference, "### Credential stores masked in every sandbox")
    missing = [p for p in DEFAULT_GENERATED if f"`{p}`" not in table]
    missing += [f"~/{p}" for p in DEFAULT_HOME_SECRETS if f"`~/{p}`" not in stores]
    assert missing == [], f"docs/reference.md lacks these defaults: {missing}"


# ----- links ----------------------------------------------------------------------------


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    text = re.sub(r"`|\*\*|\[|\]\([^)]*\)", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    """The anchors of *path*'s headings (outside fenced blocks), duplicates numbered as GitHub does."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6} (.+)", line)):
            slug = _slug(m.group(1))
            out.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
            seen[slug] = seen.get(slug, 0) + 1
    return out


def _links(path: Path) -> list[str]:
    """The targets of *path*'s markdown links, outside fenced and inline code."""
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    return re.findall(r"\]\(([^)\s]+)\)", text)


def test_the_slugs_are_githubs() -> None:
    assert _slug("Git: scope and forbidden paths") == "git-scope-and-forbidden-paths"
    assert _slug("[task] (required)") == "task-required"
    assert _slug("`guard exec`") == "guard-exec"


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(document: Path) -> None:
    broken = []
    for link in _links(document):
        if re.match(r"[a-z]+:", link):
            continue  # https:, mailto:
        target, _, anchor = link.partition("#")
        path = (document.parent / target).resolve() if target else document
        if not path.exists():
            broken.append(f"{link}: no {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
            broken.append(f"{link}: no heading #{anchor} in {path.name}")
    assert broken == [], f"{document.name}: broken links: {broken}"


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_file_and_test_cited_exists(document: Path) -> None:
    text = document.read_text(encoding="utf-8")
    missing = []
    cited = r"\b((?:tests|guardfs|sandbox|bench|containers)/[\w/.-]*\.(?:py|c|sh))(?:::(\w+))?"
    for path, name in re.findall(cited, text):
        if not (ROOT / path).is_file():
            missing.append(path)
        elif name and not re.search(rf"\bdef {name}\b", (ROOT / path).read_text(encoding="utf-8")):
            missing.append(f"{path}::{name}")
    assert missing == [], f"{document.name} cites what does not exist: {missing}"
