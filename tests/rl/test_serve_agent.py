"""rl/agent_loop.py against a scripted OpenAI endpoint (tests/fakes/fake_openai.py): tool calls are
executed and answered with tool messages carrying their call ids, plain replies take the environment's
observation, per-turn seeds and the session id go out with every request."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from openai import OpenAI

from rl.agent_loop import AgentSampling, ToyAgentEnv, run_agent

# test modules are imported by path (--import-mode=importlib): load the fake the same way
_spec = importlib.util.spec_from_file_location("fake_openai", Path(__file__).parents[1] / "fakes" / "fake_openai.py")
fake_openai = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fake_openai)
FakeOpenAIServer = fake_openai.FakeOpenAIServer


class CountingEnv(ToyAgentEnv):
    def __init__(self):
        super().__init__(prompt="Find the bug.", target="fixed", n_turns=3)
        self.calls = []

    def tools(self):
        return [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]

    def tool(self, name, arguments):
        self.calls.append((name, arguments))
        return f"ran {arguments.get('command')}"


def test_agent_loop_runs_tool_calls_then_observations():
    call = {"id": "call_1", "type": "function", "function": {"name": "bash", "arguments": '{"command": "ls"}'}}
    env = CountingEnv()
    with FakeOpenAIServer([{"content": "", "tool_calls": [call]}, "looking", "fixed it"]) as srv:
        client = OpenAI(base_url=srv.base_url, api_key="-", max_retries=0)
        result = run_agent(client, "m", env, max_turns=5, sampling=AgentSampling(max_tokens=8), seed=3,
                           session_id="s1")  # fmt: skip
    assert env.calls == [("bash", {"command": "ls"})]
    assert [m["role"] for m in result.messages] == ["user", "assistant", "tool", "assistant", "tool", "assistant"]
    assert result.messages[2] == {"role": "tool", "tool_call_id": "call_1", "content": "ran ls"}
    assert result.replies[-1] == "fixed it" and env.reward(result.replies[-1]) == 1.0 and result.termination == "done"
    bodies = [r["body"] for r in srv.requests]
    assert [b["seed"] for b in bodies] == [3 * 1_000_003 + k for k in range(3)]
    assert all(b["session_id"] == "s1" and b["max_tokens"] == 8 and b["tools"] for b in bodies)
    assert json.loads(bodies[1]["messages"][1]["tool_calls"][0]["function"]["arguments"]) == {"command": "ls"}
