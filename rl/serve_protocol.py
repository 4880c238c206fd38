"""The OpenAI wire format of flashpost-serve: request validation, OpenAI messages and tools mapped onto
the chat template (model/chat_template.py), tool calls parsed back out, and OpenAI-style error bodies.

Pure functions over dicts; no HTTP, no engine. Requests are read from the raw JSON (not a pydantic
model) so that every rejection carries an OpenAI error body naming the offending parameter.
Extensions beyond the OpenAI API: request `session_id` (ties a multi-turn conversation to one engine
session), response `prompt_token_ids` / `policy_version` / `session_id`, and per choice `token_ids`,
`token_logprobs`, `policy_versions` (rl/serve_app.py attaches them).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from model.chat_template import ParsedAssistant


class ApiError(Exception):
    """An OpenAI-style error: `status` is the HTTP code, the rest is the body's `error` object."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param, code)


@dataclass(kw_only=True)
class GenParams:
    """Sampling settings of one request (OpenAI names mapped to the engine's)."""

    max_tokens: int | None = None  # None: the server's default, capped by the room left in the context
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stop: tuple[str, ...] = ()
    seed: int | None = None
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False


@dataclass(kw_only=True)
class ChatRequest:
    model: str
    messages: list[dict[str, Any]]  # chat-template form
    tools: list[dict[str, Any]] | None  # JSON-schema dicts (the function objects), None when absent
    params: GenParams
    session_id: str | None = None
    raw_messages: list[dict[str, Any]] = field(default_factory=list)


@dataclass(kw_only=True)
class CompletionRequest:
    model: str
    prompt: str | list[int]
    params: GenParams


# ---------------------------------------------------------------------- scalar checks
def _number(body: Mapping, key: str, default: float, lo: float, hi: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
        raise bad(f"'{key}' must be a number in [{lo}, {hi}], got {value!r}", key)
    return float(value)


def _int(body: Mapping, key: str, lo: int, hi: int | None = None) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
        raise bad(f"'{key}' must be an integer >= {lo}{'' if hi is None else f' and <= {hi}'}, got {value!r}", key)
    return value


def parse_params(body: Mapping, max_n: int) -> GenParams:
    """The sampling fields common to chat and text completions."""
    stop = body.get("stop")
    if stop is None:
        stop = ()
    elif isinstance(stop, str):
        stop = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) and s for s in stop) and len(stop) <= 4:
        stop = tuple(stop)
    else:
        raise bad(f"'stop' must be a string or a list of at most 4 non-empty strings, got {stop!r}", "stop")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    max_tokens = _int({"max_tokens": max_tokens}, "max_tokens", 1)
    options = body.get("stream_options") or {}
    if not isinstance(options, Mapping):
        raise bad("'stream_options' must be an object", "stream_options")
    return GenParams(
        max_tokens=max_tokens, temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 1e-6, 1.0), n=_int(body, "n", 1, max_n) or 1, stop=stop,
        seed=_int(body, "seed", 0), stream=bool(body.get("stream", False)),
        include_usage=bool(options.get("include_usage", False)), logprobs=bool(body.get("logprobs", False)),
    )  # fmt: skip


# ---------------------------------------------------------------------- messages and tools
def _text_content(content: Any, where: str) -> str | list[dict[str, Any]]:
    """String content, or text parts kept as the template's parts."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad(f"{where}: only text content parts ({{'type': 'text', 'text': ...}}) are served",
                          "messages")  # fmt: skip
            parts.append({"type": "text", "text": part["text"]})
        return parts
    raise bad(f"{where}: content must be a string or a list of text parts", "messages")


def _joined(content: str | list[dict[str, Any]]) -> str:
    return content if isinstance(content, str) else "".join(p["text"] for p in content)


def _tool_call(call: Any, where: str) -> dict[str, Any]:
    """An OpenAI assistant tool call -> the template's {"name", "arguments": dict}."""
    fn = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise bad(f"{where}: each tool call needs function.name", "messages")
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            raise bad(f"{where}: function.arguments of {fn['name']!r} is not valid JSON ({e.msg})", "messages") from e
    if not isinstance(args, dict):
        raise bad(f"{where}: function.arguments of {fn['name']!r} must encode a JSON object", "messages")
    return {"name": fn["name"], "arguments": args}


def to_template_messages(messages: Any) -> list[dict[str, Any]]:
    """OpenAI chat messages -> the chat template's messages ("developer" is a system turn; a tool
    message keeps its content, its tool_call_id is the client's bookkeeping)."""
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, Mapping):
            raise bad(f"{where} must be an object", "messages")
        role = m.get("role")
        if role in ("system", "developer", "user"):
            out.append({"role": "system" if role == "developer" else role,
                        "content": _text_content(m.get("content"), where)})  # fmt: skip
        elif role == "assistant":
            calls = m.get("tool_calls") or []
            if not isinstance(calls, list):
                raise bad(f"{where}: tool_calls must be a list", "messages")
            msg = {"role": "assistant", "content": _joined(_text_content(m.get("content"), where))}
            reasoning = m.get("reasoning_content")
            if isinstance(reasoning, str):
                msg["reasoning"] = reasoning
            if calls:
                msg["tool_calls"] = [_tool_call(c, where) for c in calls]
            out.append(msg)
        elif role == "tool":
            out.append({"role": "tool", "content": _joined(_text_content(m.get("content"), where))})
        else:
            raise bad(f"{where}: role {role!r} is not one of system, developer, user, assistant, tool", "messages")
    return out


def to_tool_schemas(tools: Any) -> list[dict[str, Any]] | None:
    """OpenAI `tools` ([{"type": "function", "function": {name, description?, parameters?}}]) -> the
    JSON-schema dicts the template writes into the system turn."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad("'tools' must be a list of {'type': 'function', 'function': {...}} objects", "tools")
    out, names = [], set()
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(tool, Mapping) or tool.get("type") != "function" or not isinstance(fn, Mapping):
            raise bad(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}", "tools")
        name = fn.get("name")
        if not isinstance(name, str) or not name or len(name) > 64 or not name.replace("-", "_").isidentifier():
            raise bad(f"tools[{i}].function.name must be 1-64 letters, digits, '_' or '-', got {name!r}", "tools")
        if name in names:
            raise bad(f"tools[{i}]: duplicate function name {name!r}", "tools")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, Mapping) or params.get("type", "object") != "object":
            raise bad(f"tools[{i}].function.parameters must be a JSON schema of type 'object'", "tools")
        names.add(name)
        schema = {"name": name, "parameters": dict(params)}
        if isinstance(fn.get("description"), str):
            schema["description"] = fn["description"]
        out.append(schema)
    return out or None


def parse_chat_request(body: Any, max_n: int) -> ChatRequest:
    if not isinstance(body, Mapping):
        raise bad("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("'model' is required", "model")
    session_id = body.get("session_id")
    if session_id is not None and (not isinstance(session_id, str) or not session_id):
        raise bad("'session_id' must be a non-empty string", "session_id")
    params = parse_params(body, max_n)
    if session_id is not None and params.n != 1:
        raise bad("a session is one conversation: use n=1 with session_id", "n")
    if body.get("tool_choice") not in (None, "auto", "none"):
        raise bad("only tool_choice 'auto' or 'none' is served", "tool_choice")
    tools = to_tool_schemas(body.get("tools"))
    return ChatRequest(model=model, messages=to_template_messages(body.get("messages")), tools=tools,
                       params=params, session_id=session_id, raw_messages=list(body["messages"]))  # fmt: skip


def parse_completion_request(body: Any, max_n: int, vocab_size: int) -> CompletionRequest:
    if not isinstance(body, Mapping):
        raise bad("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("'model' is required", "model")
    prompt = body.get("prompt")
    ids_ok = isinstance(prompt, list) and prompt and all(isinstance(t, int) and 0 <= t < vocab_size for t in prompt)
    if not (isinstance(prompt, str) and prompt) and not ids_ok:
        raise bad(f"'prompt' must be a non-empty string or a list of token ids in [0, {vocab_size})", "prompt")
    return CompletionRequest(model=model, prompt=prompt, params=parse_params(body, max_n))


# ---------------------------------------------------------------------- responses
def cut_at_stop(text: str, stop: tuple[str, ...]) -> str:
    """OpenAI returns the text before the first stop string, the stop string excluded."""
    cuts = [text.find(s) for s in stop if s in text]
    return text[: min(cuts)] if cuts else text


def openai_tool_calls(parsed: ParsedAssistant) -> list[dict[str, Any]]:
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}}
            for c in parsed.tool_calls]  # fmt: skip


def finish_reason(engine_reason: str, has_tool_calls: bool) -> str:
    return "tool_calls" if has_tool_calls and engine_reason == "stop" else engine_reason


__all__ = [
    "ApiError", "ChatRequest", "CompletionRequest", "GenParams", "bad", "cut_at_stop", "finish_reason",
    "openai_tool_calls", "parse_chat_request", "parse_completion_request", "to_template_messages",
    "to_tool_schemas",
]  # fmt: skip
