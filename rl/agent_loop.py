"""A small external agent loop that speaks only the OpenAI chat API (the official `openai` client), as
outside harnesses do; pointed at flashpost-serve with a `session_id`, its episodes become training
trajectories token for token (the server records what it consumed and produced).

The loop: send the conversation, append the assistant message as returned, execute its tool calls with
the environment's `tool` (or, without calls, take the environment's next observation), until the
environment says the episode is over, the turn budget is spent or the context is full. `ToyAgentEnv` is
the toy task family of rl/rollout.py in this form. `OpenAIPolicy` is the other way round: the policy of
envs/episode.py's loop (an outside harness with its own tool protocol) served over the OpenAI API. Not
here: the server, trajectories (rl/serve_rollout.py turns a session record into one), Docker sandboxes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Protocol


class AgentEnv(Protocol):
    def first_messages(self) -> list[dict[str, Any]]: ...

    def tools(self) -> list[dict[str, Any]] | None: ...

    def tool(self, name: str, arguments: dict[str, Any]) -> str: ...

    def observe(self, turn: int, reply: str) -> list[dict[str, Any]] | None:
        """Messages after a reply without tool calls; None ends the episode."""
        ...


@dataclass(kw_only=True)
class AgentSampling:
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 64


@dataclass
class AgentResult:
    messages: list[dict[str, Any]]  # the OpenAI-form conversation as the client holds it
    replies: list[str] = field(default_factory=list)
    termination: str = "done"  # "done" | "max_turns" | "context"
    turns: int = 0


def run_agent(client: Any, model: str, env: AgentEnv, *, max_turns: int, sampling: AgentSampling,
              seed: int | None = None, session_id: str | None = None) -> AgentResult:  # fmt: skip
    """One episode through `client` (an `openai.OpenAI`). Turn k is requested with seed·1000003 + k (the
    rollout worker's rule), so a re-run episode asks for the same draws."""
    import openai

    messages = env.first_messages()
    result = AgentResult(messages)
    tools = env.tools()
    extra = {"session_id": session_id} if session_id is not None else None
    for turn in range(max_turns):
        kwargs: dict[str, Any] = {"tools": tools} if tools else {}
        if seed is not None:
            kwargs["seed"] = (seed * 1_000_003 + turn) % 2**63
        try:
            resp = client.chat.completions.create(
                model=model, messages=messages, temperature=sampling.temperature, top_p=sampling.top_p,
                max_tokens=sampling.max_tokens, extra_body=extra, **kwargs,
            )  # fmt: skip
        except openai.BadRequestError as e:
            if getattr(e, "code", None) == "context_length_exceeded":
                result.termination = "context"
                return result
            raise
        msg = resp.choices[0].message
        reply = msg.content or ""
        result.replies.append(reply)
        result.turns = turn + 1
        calls = msg.tool_calls or []
        entry: dict[str, Any] = {"role": "assistant", "content": reply}
        if calls:
            entry["tool_calls"] = [{"id": c.id, "type": "function",
                                    "function": {"name": c.function.name, "arguments": c.function.arguments}}
                                   for c in calls]  # fmt: skip
        messages.append(entry)
        if calls:
            for c in calls:
                try:
                    args = json.loads(c.function.arguments or "{}")
                except json.JSONDecodeError as e:
                    output = f"error: arguments are not valid JSON ({e.msg})"
                else:
                    output = env.tool(c.function.name, args if isinstance(args, dict) else {})
                messages.append({"role": "tool", "tool_call_id": c.id, "content": output})
            continue
        more = env.observe(turn, reply)
        if more is None:
            return result
        messages += more
    result.termination = "max_turns"
    return result


class OpenAIPolicy:
    """An envs/episode.py policy (`await policy(messages) -> assistant text`) over an OpenAI endpoint
    (`openai.AsyncOpenAI`). Tool calls the endpoint returns in OpenAI form are written back as the
    episode loop's `<tool_call>{json}</tool_call>` text (envs/protocol.py); tool observations go out as
    tool messages. Turn k asks with seed·1000003 + k and, when given, the `session_id`."""

    def __init__(self, client: Any, model: str, sampling: AgentSampling, *, tools: list[dict[str, Any]] | None,
                 seed: int | None = None, session_id: str | None = None):  # fmt: skip
        self.client, self.model, self.sampling, self.tools = client, model, sampling, tools
        self.seed, self.session_id = seed, session_id
        self.n_calls = 0

    async def __call__(self, messages: list[Any]) -> str:
        from envs.protocol import format_tool_call

        wire = []
        for i, m in enumerate(messages):
            wire.append({"role": m.role, "content": m.content})
            if m.role == "tool":
                wire[-1]["tool_call_id"] = f"observation-{i}"
        kwargs: dict[str, Any] = {"tools": self.tools} if self.tools else {}
        if self.seed is not None:
            kwargs["seed"] = (self.seed * 1_000_003 + self.n_calls) % 2**63
        resp = await self.client.chat.completions.create(
            model=self.model, messages=wire, temperature=self.sampling.temperature, top_p=self.sampling.top_p,
            max_tokens=self.sampling.max_tokens,
            extra_body={"session_id": self.session_id} if self.session_id else None, **kwargs,
        )  # fmt: skip
        self.n_calls += 1
        msg = resp.choices[0].message
        text = msg.content or ""
        for c in msg.tool_calls or []:
            try:
                args = json.loads(c.function.arguments or "{}")
            except json.JSONDecodeError:
                args = {"_unparsed": c.function.arguments}  # the episode loop reports it as a bad call
            text += format_tool_call(c.function.name, args if isinstance(args, dict) else {"_value": args})
        return text


@dataclass
class ToyAgentEnv:
    """rl/rollout.py's ToyTask as an agent environment: the task prompt, then a fixed tool observation after
    each of the first n_turns - 1 replies; reward 1 when the last reply contains the target."""

    prompt: str
    target: str
    n_turns: int = 2

    def first_messages(self) -> list[dict[str, Any]]:
        return [{"role": "user", "content": self.prompt}]

    def tools(self) -> list[dict[str, Any]] | None:
        return None

    def tool(self, name: str, arguments: dict[str, Any]) -> str:
        return f"error: the toy task has no tool {name!r}"

    def observe(self, turn: int, reply: str) -> list[dict[str, Any]] | None:
        if turn + 1 >= self.n_turns:
            return None
        return [{"role": "tool", "tool_call_id": f"observation-{turn}", "content": f"observation {turn}: keep going"}]

    def reward(self, last_reply: str) -> float:
        return 1.0 if self.target in last_reply else 0.0


__all__ = ["AgentEnv", "AgentResult", "AgentSampling", "OpenAIPolicy", "ToyAgentEnv", "run_agent"]
