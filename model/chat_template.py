"""Chat template: messages -> token ids + loss mask, and a tolerant parser of assistant output.

Layout (every tag a single special token; text between tags is encoded piece by piece):

    <|bos|>
    <|system|>{system text}[\\n\\n# Tools\\n{one signature line per tool}]<|end|>
    <|user|>{text | image spans}<|end|>
    <|assistant|>[<think>{reasoning}</think>]{content}[<tool_call>{json}</tool_call>]...<|end|>
    <|tool|><tool_result>{result}</tool_result><|end|>

The loss mask covers exactly what the assistant generates: everything after its `<|assistant|>`
header, its `<|end|>` included. A turn renders from that message alone (reasoning of old turns is
kept, nothing looks ahead), so a prompt rendered with `add_generation_prompt=True`, then the
generated ids, then `render_continuation(next tool/user turns)` is token-for-token the rendering of
the whole conversation (DESIGN §3.1, token-in/token-out). The `<tool_call>{json}</tool_call>` text
is the one of `envs/protocol.py` (not imported: model/ does not depend on envs/). No sampling or
tool execution here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from model.tokenizer import TEXT, Tokenizer

ROLES = ("system", "user", "assistant", "tool")
THINK, THINK_END = "<think>", "</think>"
TOOL_CALL, TOOL_CALL_END = "<tool_call>", "</tool_call>"
# Tags the assistant emits itself: in assistant text they are encoded as their special tokens,
# exactly as the model generates them. Everywhere else they stay plain text (no injection).
ASSISTANT_TAGS = (THINK, THINK_END, TOOL_CALL, TOOL_CALL_END)


@dataclass(frozen=True)
class TurnSpan:
    """One rendered message: tokens [start, end); its body (after the role header) starts at
    `body_start`. For an assistant turn, [body_start, end) is what the policy generated."""

    message_index: int
    role: str
    start: int
    body_start: int
    end: int


@dataclass
class RenderedChat:
    """`token_ids`, `loss_mask` and `token_types` (TEXT -1 / image 0..3) have equal length."""

    token_ids: list[int]
    loss_mask: list[bool]
    turn_spans: list[TurnSpan]
    token_types: list[int]


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass
class ParsedAssistant:
    """What an assistant turn said. `errors` lists every malformed piece (the parser never raises);
    `finished` is whether the turn ended with `<|end|>`/`<|eos|>` (False = truncated)."""

    content: str
    reasoning: str | None
    tool_calls: list[ToolCall]
    errors: list[str]
    finished: bool

    def to_message(self) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning is not None:
            msg["reasoning"] = self.reasoning
        if self.tool_calls:
            msg["tool_calls"] = [{"name": c.name, "arguments": c.arguments} for c in self.tool_calls]
        return msg


def _field(obj: Any, key: str) -> Any:
    """Messages and tool calls may be dicts or dataclasses (e.g. envs.protocol.Message)."""
    return obj.get(key) if isinstance(obj, Mapping) else getattr(obj, key, None)


def format_tool_call(name: str, arguments: Mapping[str, Any] | None = None) -> str:
    """The canonical block; byte-identical to envs.protocol.format_tool_call."""
    payload = json.dumps({"name": name, "arguments": dict(arguments or {})}, ensure_ascii=False)
    return f"{TOOL_CALL}{payload}{TOOL_CALL_END}"


# parameter keys a signature spells out; a parameter with any other key is shown as its JSON schema
_SIGNATURE_KEYS = {"type", "description", "minimum", "enum", "items", "minItems", "maxItems"}


def _param_type(p: Mapping[str, Any]) -> str:
    if set(p) - _SIGNATURE_KEYS or ("items" in p and set(p["items"]) - {"type"}):
        return json.dumps({k: v for k, v in p.items() if k != "description"}, ensure_ascii=False)
    if "enum" in p:
        return "|".join(json.dumps(v, ensure_ascii=False) for v in p["enum"])
    text = p.get("type", "any")
    if "items" in p:
        n = p.get("minItems") if p.get("minItems") == p.get("maxItems") else None
        text = f"{p['items'].get('type', 'any')}[{'' if n is None else n}]"
    return text + (f" >= {p['minimum']}" if "minimum" in p else "")


def tool_signature(schema: Mapping[str, Any]) -> str:
    """A tool's JSON schema (OpenAI function form) as one line, `name(arg: type, opt?: type): what it
    does. arg: its note.`, parameters in the schema's order: the same facts as the schema's JSON in about
    half the tokens, and every token of it is prefill of every episode and demonstration."""
    params = schema.get("parameters") or {}
    props = params.get("properties") or {}
    required = set(params.get("required") or ())
    args = ", ".join(f"{k}{'' if k in required else '?'}: {_param_type(p)}" for k, p in props.items())
    notes = "".join(f" {k}: {p['description']}" for k, p in props.items() if p.get("description"))
    return f"{schema['name']}({args}): {schema.get('description', '')}{notes}".rstrip()


def assistant_text(message: Any) -> str:
    """The text an assistant message stands for: reasoning block, content, then tool-call blocks.
    A message whose content already holds tags (envs' wire format) passes through unchanged."""
    reasoning = _field(message, "reasoning")
    text = "" if reasoning is None else f"{THINK}{reasoning}{THINK_END}"
    text += _field(message, "content") or ""
    for call in _field(message, "tool_calls") or ():
        text += format_tool_call(_field(call, "name"), _field(call, "arguments"))
    return text


class ChatTemplate:
    """Renders conversations for one tokenizer; `stop_ids` end a generated turn."""

    def __init__(self, tokenizer: Tokenizer):
        needed = ["bos", "eos", "system", "user", "assistant", "tool", "end", "think", "think_end",
                  "tool_call", "tool_call_end", "tool_result", "tool_result_end"]  # fmt: skip
        missing = [n for n in needed if getattr(tokenizer, f"{n}_id") is None]
        if missing:
            raise ValueError(f"tokenizer lacks special tokens {missing}; pass special_tokens= to map them")
        self.tokenizer = tokenizer
        t = tokenizer
        self.header_ids = {"system": t.system_id, "user": t.user_id, "assistant": t.assistant_id,
                           "tool": t.tool_id}  # fmt: skip
        self.stop_ids = (t.end_id, t.eos_id)

    # ------------------------------------------------------------------ rendering
    def render(
        self, messages: Sequence[Any], tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = False,
    ) -> RenderedChat:  # fmt: skip
        """A whole conversation from its start. `tools` (JSON-schema dicts) go into the first
        system turn, which is created if the conversation has none."""
        messages = list(messages)
        if tools and (not messages or _field(messages[0], "role") != "system"):
            messages.insert(0, {"role": "system", "content": ""})
            offset = -1  # spans keep the caller's message indices; the synthesized turn is -1
        else:
            offset = 0
        out = RenderedChat([self.tokenizer.bos_id], [False], [], [TEXT])
        for i, msg in enumerate(messages):
            self._append_turn(out, i + offset, msg, tools if i == 0 else None)
        if add_generation_prompt:
            self._append_generation_prompt(out)
        return out

    def render_continuation(
        self, messages: Sequence[Any], add_generation_prompt: bool = True
    ) -> RenderedChat:
        """Turns appended to a conversation already in flight (tool results, a new user turn): no
        bos, no tools; spans count from 0 of this segment."""
        out = RenderedChat([], [], [], [])
        for i, msg in enumerate(messages):
            self._append_turn(out, i, msg, None)
        if add_generation_prompt:
            self._append_generation_prompt(out)
        return out

    def generation_ids(self, message: Any) -> list[int]:
        """The ids an assistant message stands for after its header, `<|end|>` included: the
        message's own `token_ids` (what the engine sampled, kept verbatim) or its canonical encoding."""
        if _field(message, "token_ids") is not None:
            return list(_field(message, "token_ids"))
        return self.tokenizer.encode(assistant_text(message), allowed_special=ASSISTANT_TAGS) + [
            self.tokenizer.end_id
        ]

    def _append_generation_prompt(self, out: RenderedChat) -> None:
        out.token_ids.append(self.tokenizer.assistant_id)
        out.loss_mask.append(False)
        out.token_types.append(TEXT)

    def _append_turn(self, out: RenderedChat, index: int, msg: Any, tools: Sequence[Mapping] | None) -> None:
        role = _field(msg, "role")
        if role not in ROLES:
            raise ValueError(f"message {index}: role {role!r} is not one of {ROLES}")
        t = self.tokenizer
        start = len(out.token_ids)
        body: list[int]
        types: list[int] | None = None
        if role == "assistant":
            body = self.generation_ids(msg)
        elif role == "tool":
            result = t.encode(_field(msg, "content") or "")
            body = [t.tool_result_id, *result, t.tool_result_end_id, t.end_id]
        else:
            body, types = self._encode_content(index, _field(msg, "content"))
            if tools:
                body += t.encode(("\n\n" if body else "") + "# Tools\n" + "\n".join(map(tool_signature, tools)))
                types += [TEXT] * (len(body) - len(types))
            body.append(t.end_id)
            types.append(TEXT)
        out.token_ids += [self.header_ids[role], *body]
        out.loss_mask += [False] + [role == "assistant"] * len(body)
        out.token_types += [TEXT] + (types or [TEXT] * len(body))
        out.turn_spans.append(TurnSpan(index, role, start, start + 1, len(out.token_ids)))

    def _encode_content(self, index: int, content: Any) -> tuple[list[int], list[int]]:
        """System/user content: a string, or a list of parts {"type": "text", "text": ...} /
        {"type": "image", "n_llm_h": h, "n_llm_w": w} (the LLM grid of §3.15)."""
        t = self.tokenizer
        if content is None or isinstance(content, str):
            ids = t.encode(content or "")
            return ids, [TEXT] * len(ids)
        ids, types = [], []
        for part in content:
            kind = _field(part, "type")
            if kind == "text":
                piece = t.encode(_field(part, "text"))
                ids += piece
                types += [TEXT] * len(piece)
            elif kind == "image":
                span, span_types = t.image_span(_field(part, "n_llm_h"), _field(part, "n_llm_w"))
                ids += span
                types += span_types
            else:
                raise ValueError(f"message {index}: content part type {kind!r} is not 'text' or 'image'")
        return ids, types

    # ------------------------------------------------------------------ parsing
    def parse_assistant(self, text_or_ids: str | Sequence[int]) -> ParsedAssistant:
        """Parse generated assistant output given as text or as token ids (decoded with special
        tokens kept). See `parse_assistant`."""
        if not isinstance(text_or_ids, str):
            text_or_ids = self.tokenizer.decode(list(text_or_ids))
        names = self.tokenizer.special_tokens
        return parse_assistant(text_or_ids, header=names["assistant"], end_tags=(names["end"], names["eos"]))


_decoder = json.JSONDecoder()


def _check_call(obj: Any, body: str) -> ToolCall | str:
    """Same acceptance rules and messages as envs.protocol._check_call."""
    preview = body.strip()[:200]
    if not isinstance(obj, dict):
        return f"tool call must be a JSON object, got {type(obj).__name__}: {preview!r}"
    extra = sorted(set(obj) - {"name", "arguments"})
    if extra:
        return f"tool call has unexpected keys {extra}; only 'name' and 'arguments' are allowed"
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return f"tool call needs a non-empty string 'name': {preview!r}"
    args = obj.get("arguments", {})
    if isinstance(args, str):  # OpenAI ships arguments as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            return f"tool call {name!r}: 'arguments' is a string that is not valid JSON ({e.msg})"
    if not isinstance(args, dict):
        return f"tool call {name!r}: 'arguments' must be a JSON object, got {type(args).__name__}"
    return ToolCall(name, args)


def _parse_calls(text: str) -> tuple[str, list[ToolCall], list[str]]:
    """(text outside blocks, calls, errors). The JSON decoder decides where a body ends, so a close
    tag inside a JSON string does not cut the call short (as envs.protocol.parse_tool_calls)."""
    content, calls, errors, pos = [], [], [], 0
    while True:
        i = text.find(TOOL_CALL, pos)
        outside = text[pos:] if i < 0 else text[pos:i]
        content.append(outside)
        errors += [f"found {TOOL_CALL_END} without a matching {TOOL_CALL}"] * outside.count(TOOL_CALL_END)
        if i < 0:
            return "".join(content), calls, errors
        start = i + len(TOOL_CALL)
        body_start = len(text[start:]) - len(text[start:].lstrip()) + start
        try:
            obj, end = _decoder.raw_decode(text, body_start)
        except json.JSONDecodeError as e:
            close = text.find(TOOL_CALL_END, start)
            if close < 0:
                errors.append(
                    f"unterminated {TOOL_CALL} block (missing {TOOL_CALL_END}): {text[start:][:200]!r}"
                )
                return "".join(content), calls, errors
            errors.append(
                f"tool call is not valid JSON ({e.msg} at char {e.pos - start}): {text[start:close]!r}"
            )
            pos = close + len(TOOL_CALL_END)
            continue
        after = end + len(text[end:]) - len(text[end:].lstrip())
        if not text.startswith(TOOL_CALL_END, after):
            close = text.find(TOOL_CALL_END, after)
            pos = len(text) if close < 0 else close + len(TOOL_CALL_END)
            errors.append(
                f"tool call JSON must be followed directly by {TOOL_CALL_END}: {text[start:pos][:200]!r}"
            )
            continue
        parsed = _check_call(obj, text[body_start:end])
        if isinstance(parsed, ToolCall):
            calls.append(parsed)
        else:
            errors.append(parsed)
        pos = after + len(TOOL_CALL_END)


def _tags_in(text: str) -> set[str]:
    return {tag for tag in ASSISTANT_TAGS if tag in text}


def parse_assistant(
    text: str, header: str = "<|assistant|>", end_tags: Sequence[str] = ("<|end|>", "<|eos|>")
) -> ParsedAssistant:
    """Split generated assistant text into reasoning, content and tool calls. Never raises.

    A leading `header` is ignored; the first end tag finishes the turn (anything after
    it is an error). Reasoning is a `<think>...</think>` block at the start; a `</think>` without an
    opening tag makes the text before it the reasoning (reported). Content is the text outside
    reasoning and tool-call blocks, unchanged (no stripping), so canonical renders round-trip.
    """
    errors: list[str] = []
    if text.startswith(header):
        text = text[len(header) :]
    ends = [(text.find(tag), tag) for tag in end_tags if tag in text]
    finished = bool(ends)
    if ends:
        cut, tag = min(ends)
        if text[cut + len(tag) :].strip():
            errors.append(
                f"text after the end-of-turn tag {tag} is ignored: {text[cut + len(tag) :][:200]!r}"
            )
        text = text[:cut]
    reasoning = None
    if text.lstrip().startswith(THINK):
        rest = text.lstrip()[len(THINK) :]
        close = rest.find(THINK_END)
        if close < 0:
            errors.append(f"unclosed {THINK} block (missing {THINK_END})")
            reasoning, text = rest, ""
        else:
            reasoning, text = rest[:close], rest[close + len(THINK_END) :]
    elif THINK_END in text and not {THINK, TOOL_CALL} & _tags_in(text[: text.find(THINK_END)]):
        close = text.find(THINK_END)
        errors.append(
            f"found {THINK_END} without a matching {THINK}; the text before it is taken as reasoning"
        )
        reasoning, text = text[:close], text[close + len(THINK_END) :]
    content, calls, call_errors = _parse_calls(text)
    if THINK in content or THINK_END in content:
        errors.append(f"stray {THINK}/{THINK_END} tag outside the leading reasoning block (kept as content)")
    return ParsedAssistant(content, reasoning, calls, errors + call_errors, finished)


__all__ = [
    "ASSISTANT_TAGS", "ChatTemplate", "ParsedAssistant", "RenderedChat", "ToolCall", "TurnSpan",
    "assistant_text", "format_tool_call", "parse_assistant", "tool_signature",
]  # fmt: skip
