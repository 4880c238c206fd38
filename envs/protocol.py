"""The conversation wire contract between a policy and an env: messages and tool calls in text.

An assistant message carries tool calls as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
blocks inside its text; `parse_tool_calls` extracts them and reports every malformed block as an error
string (it never raises), and `format_tool_call` renders the canonical block. This module is
tokenizer-free: the chat template maps these tags to special tokens; here they are plain text.
It does not execute anything (see envs/tools.py) and does not run the loop (see envs/episode.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"

Role = Literal["system", "user", "assistant", "tool"]


@dataclass(frozen=True)
class Message:
    """One chat message. `role="tool"` messages are observations; `name` is the tool that produced
    them, or None for protocol errors (unparseable call, no call at all)."""

    role: Role
    content: str
    name: str | None = None


@dataclass(frozen=True)
class ToolCall:
    """A parsed call. `raw` is the JSON text between the tags, kept for transcripts."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    raw: str = ""


_PREVIEW_CHARS = 200
_decoder = json.JSONDecoder()


def _preview(text: str) -> str:
    text = text.strip()
    return text if len(text) <= _PREVIEW_CHARS else text[:_PREVIEW_CHARS] + "..."


def _check_call(obj: Any, body: str) -> ToolCall | str:
    """A decoded block -> a ToolCall, or an error message the model can act on."""
    if not isinstance(obj, dict):
        return f"tool call must be a JSON object, got {type(obj).__name__}: {_preview(body)!r}"
    extra = sorted(set(obj) - {"name", "arguments"})
    if extra:
        return f"tool call has unexpected keys {extra}; only 'name' and 'arguments' are allowed"
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return f"tool call needs a non-empty string 'name': {_preview(body)!r}"
    args = obj.get("arguments", {})
    # OpenAI's wire format ships arguments as a JSON-encoded string; accept it when it decodes.
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            return f"tool call {name!r}: 'arguments' is a string that is not valid JSON ({e.msg})"
    if not isinstance(args, dict):
        return f"tool call {name!r}: 'arguments' must be a JSON object, got {type(args).__name__}"
    return ToolCall(name=name, arguments=args, raw=body.strip())


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def _parse_block(text: str, start: int) -> tuple[ToolCall | str, int]:
    """Parse the block whose body starts at `start`; returns (call or error, position after it).

    The JSON decoder decides where the body ends, so a close tag inside a JSON string (a file that
    mentions the tag) does not cut the call short.
    """
    body_start = _skip_ws(text, start)
    try:
        obj, end = _decoder.raw_decode(text, body_start)
    except json.JSONDecodeError as e:
        close = text.find(TOOL_CALL_CLOSE, start)
        if close < 0:
            return (f"unterminated {TOOL_CALL_OPEN} block (missing {TOOL_CALL_CLOSE}): "
                    f"{_preview(text[start:])!r}"), len(text)
        body = text[start:close]
        return (f"tool call is not valid JSON ({e.msg} at char {e.pos - start}): {_preview(body)!r}",
                close + len(TOOL_CALL_CLOSE))
    after = _skip_ws(text, end)
    if not text.startswith(TOOL_CALL_CLOSE, after):
        close = text.find(TOOL_CALL_CLOSE, after)
        resume = len(text) if close < 0 else close + len(TOOL_CALL_CLOSE)
        return (f"tool call JSON must be followed directly by {TOOL_CALL_CLOSE}: "
                f"{_preview(text[start:resume])!r}"), resume
    return _check_call(obj, text[body_start:end]), after + len(TOOL_CALL_CLOSE)


def parse_tool_calls(text: str) -> tuple[list[ToolCall], list[str]]:
    """Extract every `<tool_call>` block from assistant text, in order.

    Returns (calls, errors). Each malformed block (bad JSON, not an object, missing name, extra keys,
    arguments not an object, unterminated block) adds one error and no call; each stray close tag adds
    one error. Text outside blocks is free-form reasoning and is ignored. Never raises.
    """
    calls: list[ToolCall] = []
    errors: list[str] = []
    pos = 0
    while True:
        i = text.find(TOOL_CALL_OPEN, pos)
        outside = text[pos:] if i < 0 else text[pos:i]
        errors.extend([f"found {TOOL_CALL_CLOSE} without a matching {TOOL_CALL_OPEN}"]
                      * outside.count(TOOL_CALL_CLOSE))
        if i < 0:
            return calls, errors
        parsed, pos = _parse_block(text, i + len(TOOL_CALL_OPEN))
        if isinstance(parsed, ToolCall):
            calls.append(parsed)
        else:
            errors.append(parsed)


def format_tool_call(name: str, arguments: dict[str, Any] | None = None) -> str:
    """The canonical block for one call; `parse_tool_calls(format_tool_call(n, a))` returns it back."""
    payload = json.dumps({"name": name, "arguments": arguments or {}}, ensure_ascii=False)
    return f"{TOOL_CALL_OPEN}{payload}{TOOL_CALL_CLOSE}"
