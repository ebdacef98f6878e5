"""The socket protocol: newline-delimited JSON, one reply line per request.

Every message is a pydantic model with a version field ``v`` (now 1) and a ``type``.
The agent socket speaks :data:`AgentMessage`: it can report and ask, never loosen a limit.
The control socket speaks :data:`ControlMessage`.

Everything on a line is bounded before it is parsed or used: its length (:data:`MAX_LINE`),
its JSON's nesting and number sizes (checked before ``json`` recurses or converts, see
:func:`sandbox.agents.fasthook.loads_bounded`), its strings (text, or surrogate-escaped bytes
of a name that is not UTF-8), then every field by its model. Whatever fails is a
:class:`ProtocolError` naming the problem, which the daemon sends back as the reply.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, Strict, TypeAdapter, ValidationError

from sandbox.agents.fasthook import MAX_HOOK_INPUT, VERSION, JsonBoundsError, loads_bounded
from sandbox.agents.registry import AGENTS

__all__ = [
    "MAX_LINE",
    "VERSION",
    "AgentMessage",
    "ControlMessage",
    "ProtocolError",
    "error_reply",
    "parse_agent",
    "parse_control",
]

#: The longest request line accepted, in bytes (newline included): a ``hook`` message carries
#: the agent's whole hook event (a Write's content with it), as much as the compiled helper reads.
MAX_LINE = MAX_HOOK_INPUT + 64 * 1024

# Strict: a count is a JSON integer, not true or "12".
_Count = Annotated[int, Strict(), Field(ge=0, le=100_000_000)]


def _known_agent(name: str) -> str:
    if name not in AGENTS:
        raise ValueError(f"unknown agent {name[:40]!r}; known: {', '.join(sorted(AGENTS))}")
    return name


class _Msg(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # Literal[VERSION] is not a type; tests/test_agent_table.py checks that this 1 is VERSION.
    v: Literal[1] = Field(default=VERSION, description="Protocol version.")


class Hello(_Msg):
    """An agent (or its hook, or a harness) introduces itself; arms idle detection."""

    type: Literal["hello"]
    agent: Annotated[str, Field(max_length=200)] = Field(default="unknown", description="Agent name.")


class Step(_Msg):
    """One model call: its token usage and, when known, the tool it decided to call."""

    type: Literal["step"]
    tokens_in: _Count = Field(default=0, description="Input tokens of the call (uncached).")
    tokens_out: _Count = Field(default=0, description="Output tokens of the call.")
    tokens_cached: _Count = Field(default=0, description="Cached input tokens (reported, not limited).")
    tool: Annotated[str, Field(max_length=200)] | None = Field(default=None, description="Tool called.")
    args: Any = Field(default=None, description="The tool's arguments (any JSON).")
    totals: Annotated[bool, Strict()] = Field(default=False, description=(
        "The tokens are an agent's end-of-run totals over many calls, not one call's: counted, "
        "not judged by the per-step token rules."))


class ToolResult(_Msg):
    """A tool finished with an exit code (0 is success)."""

    type: Literal["tool_result"]
    tool: Annotated[str, Field(max_length=200)]
    exit_code: Annotated[int, Strict(), Field(ge=-255, le=255)]
    summary: Annotated[str, Field(max_length=4000)] = Field(default="", description="Command or short output.")


class Check(_Msg):
    """May this tool call, on these paths, run? Asked by pre-tool hooks."""

    type: Literal["check"]
    tool: Annotated[str, Field(max_length=200)]
    paths: list[Annotated[str, Field(max_length=4096)]] = Field(
        default_factory=list, max_length=256,
        description="Target paths, relative to the workspace root or absolute inside it.",
    )
    args: Any = Field(default=None, description="The call's arguments, for repetition checks.")
    mutating: Annotated[bool, Strict()] = Field(default=True, description="Whether the tool writes its paths.")


class Note(_Msg):
    """A note for the ledger: a hypothesis disproved, the active subtask, or free text."""

    type: Literal["note"]
    kind: Literal["disproved", "subtask", "note"] = "note"
    text: Annotated[str, Field(min_length=1, max_length=4000)]


class Hook(_Msg):
    """An agent's own hook event, forwarded whole by the compiled hook helper; the guard
    answers with the exit status and the text the hook must print."""

    type: Literal["hook"]
    agent: Annotated[str, AfterValidator(_known_agent)]
    event: dict[str, Any]


class Status(_Msg):
    """The breaker's state and the ledger."""

    type: Literal["status"]


class Approve(_Msg):
    """Resume after a trip; optionally raise the limit that tripped."""

    type: Literal["approve"]
    raise_to: Annotated[int, Strict(), Field(ge=1, le=10**15)] | None = Field(
        default=None, description="New value of that limit.")


class Stop(_Msg):
    """Stop the run."""

    type: Literal["stop"]


class Rollback(_Msg):
    """Restore the workspace to a restore point: ``start``, ``last`` (the default) or a label."""

    type: Literal["rollback"]
    to: Annotated[str, Field(min_length=1, max_length=200)] = "last"


class Checkpoint(_Msg):
    """Mark a known-good point."""

    type: Literal["checkpoint"]
    label: Annotated[str, Field(max_length=200)] = ""


AgentMessage = Annotated[Hello | Step | ToolResult | Check | Note | Status | Hook, Field(discriminator="type")]
ControlMessage = Annotated[Status | Approve | Stop | Checkpoint | Rollback, Field(discriminator="type")]
_AGENT: TypeAdapter[AgentMessage] = TypeAdapter(AgentMessage)
_CONTROL: TypeAdapter[ControlMessage] = TypeAdapter(ControlMessage)
_AGENT_TYPES = ("hello", "step", "tool_result", "check", "note", "status", "hook")
_CONTROL_TYPES = ("status", "approve", "stop", "checkpoint", "rollback")


class ProtocolError(ValueError):
    """A request line that is not a valid message; the text names the problem."""


# A lone surrogate escape; most lines have none, and then no string is looked at.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
# Lone surrogates that surrogateescape never produces: not text, and not a byte of a file name.
_NOT_TEXT = re.compile("[\ud800-\udc7f\udd00-\udfff]")


def _check_text(data: Any) -> None:
    """Refuse strings that cannot be written as UTF-8 (or as surrogate-escaped bytes); no recursion."""
    stack = [data]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if found := _NOT_TEXT.search(item):
                raise ProtocolError(f"a string holds the lone surrogate U+{ord(found.group()):04X}, which is not "
                                    "text (bytes of a name that is not UTF-8 travel surrogate-escaped, "
                                    "U+DC80..U+DCFF)")
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def _parse(line: bytes, adapter: TypeAdapter[Any], allowed: tuple[str, ...], socket: str) -> Any:
    try:
        data = loads_bounded(line)
    except JsonBoundsError as err:
        raise ProtocolError(f"not accepted: {err}") from err
    except ValueError as err:  # json.JSONDecodeError, UnicodeDecodeError
        raise ProtocolError(f"not valid JSON: {err}") from err
    if _SURROGATE_ESCAPE.search(line):
        _check_text(data)
    if not isinstance(data, dict):
        raise ProtocolError("a message must be a JSON object with a 'type'")
    kind = data.get("type")
    if kind not in allowed:
        hint = ""
        if socket == "agent" and kind in ("approve", "stop", "checkpoint", "rollback"):
            hint = ": the agent socket can report and ask, never approve, stop or loosen a limit"
        raise ProtocolError(f"unknown message type {kind!r} on the {socket} socket "
                            f"(expected one of {', '.join(allowed)}){hint}")
    if data.get("v", VERSION) != VERSION:
        raise ProtocolError(f"unsupported protocol version {data.get('v')!r}; this guard speaks v{VERSION}")
    try:
        return adapter.validate_python(data)
    except ValidationError as err:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'][1:]) or e['loc'][0]}: {e['msg']}" for e in err.errors()
        )
        raise ProtocolError(f"invalid {kind} message: {problems}") from err


def parse_agent(line: bytes) -> Hello | Step | ToolResult | Check | Note | Status | Hook:
    """Parse one agent-socket line; raise ProtocolError naming the problem."""
    result: Hello | Step | ToolResult | Check | Note | Status | Hook = _parse(line, _AGENT, _AGENT_TYPES, "agent")
    return result


def parse_control(line: bytes) -> Status | Approve | Stop | Checkpoint | Rollback:
    """Parse one control-socket line; raise ProtocolError naming the problem."""
    result: Status | Approve | Stop | Checkpoint | Rollback = _parse(line, _CONTROL, _CONTROL_TYPES, "control")
    return result


def error_reply(message: str) -> dict[str, Any]:
    """The reply to a bad request."""
    return {"v": VERSION, "ok": False, "error": message}
