"""The OpenAI-compatible client speaks the chat-completions protocol (against FakeOpenAIServer)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from envs.protocol import Message
from synth.llm import ChatClient, LLMError

_spec = importlib.util.spec_from_file_location("fake_openai", Path(__file__).parents[1] / "fakes" / "fake_openai.py")
fake_openai = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fake_openai)


def test_chat_request_and_response():
    with fake_openai.FakeOpenAIServer(["hello there"]) as srv:
        client = ChatClient(srv.base_url, "tiny-model", api_key="sk-test", max_tokens=64)
        assert client.chat([{"role": "user", "content": "hi"}]) == "hello there"
    req = srv.requests[0]
    assert req["path"] == "/v1/chat/completions"
    assert req["headers"]["Authorization"] == "Bearer sk-test"
    assert req["body"]["model"] == "tiny-model"
    assert req["body"]["messages"] == [{"role": "user", "content": "hi"}]
    assert req["body"]["max_tokens"] == 64 and req["body"]["temperature"] == 0.0
    assert client.usage == {"prompt_tokens": 11, "completion_tokens": 3, "calls": 1}


def test_retries_server_errors_then_succeeds():
    with fake_openai.FakeOpenAIServer([500, 429, "ok"]) as srv:
        client = ChatClient(srv.base_url, "m", retries=2)
        assert client.chat([{"role": "user", "content": "x"}]) == "ok"
    assert len(srv.requests) == 3


def test_client_errors_are_not_retried():
    with fake_openai.FakeOpenAIServer([400, "never"]) as srv:
        client = ChatClient(srv.base_url, "m", retries=3)
        with pytest.raises(LLMError, match="HTTP 400"):
            client.chat([{"role": "user", "content": "x"}])
    assert len(srv.requests) == 1


def test_policy_maps_tool_observations_to_user_turns():
    with fake_openai.FakeOpenAIServer(["next"]) as srv:
        client = ChatClient(srv.base_url, "m")
        out = client.policy([Message("system", "sys"), Message("user", "fix it"), Message("assistant", "call"),
                             Message("tool", "42 passed", name="run_tests")])
    assert out == "next"
    roles = [m["role"] for m in srv.requests[0]["body"]["messages"]]
    assert roles == ["system", "user", "assistant", "user"]
    assert srv.requests[0]["body"]["messages"][-1]["content"].startswith("[observation]")
