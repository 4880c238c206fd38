"""flashpost-serve through the official `openai` client on loopback (debug model, CPU): chat with and
without tools, streaming, n > 1, text completions, OpenAI error bodies and status codes, 429 beyond
capacity, weight updates by version, the factory's LLM client, and token-exact sessions: over random
multi-turn tool conversations the recorded ids equal the template rendering of the conversation."""

from __future__ import annotations

import json
import math
import random
import threading
import urllib.error
import urllib.request

import openai
import pytest
from openai import OpenAI

from model.engine import InferenceEngine
from rl.actors import build_model
from rl.config import ModelChoice
from rl.serve_app import Server, ServerThread, build_app, chat_message
from rl.serve_engine import Job, ServeConfig

DEBUG = ModelChoice(flavor="debug", overrides={"vocab_size": 4096, "engram_compressed_vocab_size": 2742,
                                               "max_seq_len": 256})  # fmt: skip
NAME = "debug"
TOOLS = [
    {"type": "function", "function": {"name": "bash", "description": "Run a shell command.",
                                      "parameters": {"type": "object", "properties": {"command": {"type": "string"}},
                                                     "required": ["command"]}}},
    {"type": "function", "function": {"name": "view", "parameters": {"type": "object", "properties": {
        "path": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "submit"}},
]  # fmt: skip


@pytest.fixture(scope="module")
def served():
    model, template = build_model(DEBUG)
    cfg = ServeConfig(model_name=NAME, decode_chunk=4, default_max_tokens=12, max_pending=64)
    server = Server(InferenceEngine(model, template, max_sessions=128), template, cfg)
    with ServerThread(build_app(server)) as thread:
        yield server, thread, OpenAI(base_url=thread.base_url, api_key="-", max_retries=0)
    server.loop.close()


def _schemas(tools):
    return [{k: v for k, v in t["function"].items()} | {"parameters": t["function"].get(
        "parameters", {"type": "object", "properties": {}})} for t in tools]  # fmt: skip


def test_chat_without_tools_carries_token_ids_logprobs_and_version(served):
    server, _, client = served
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."}]
    r = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=10, temperature=0.8, seed=1)
    ext = r.model_extra
    assert ext["prompt_token_ids"] == server.template.render(msgs, add_generation_prompt=True).token_ids
    choice = r.choices[0]
    ids, lps, versions = (choice.model_extra[k] for k in ("token_ids", "token_logprobs", "policy_versions"))
    assert 1 <= len(ids) <= 10 and len(lps) == len(ids) and r.usage.completion_tokens == len(ids)
    assert all(math.isfinite(x) and x <= 0 for x in lps)
    assert versions == [ext["policy_version"]] * len(ids)
    assert choice.finish_reason in ("stop", "length")
    assert choice.message.content == server.template.parse_assistant(ids).content


def test_chat_with_tools_renders_the_schemas_and_accepts_tool_history(served):
    server, _, client = served
    msgs = [{"role": "user", "content": "List files."},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": '{"command": "ls"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "a.py\nb.py"}]  # fmt: skip
    r = client.chat.completions.create(model=NAME, messages=msgs, tools=TOOLS, max_tokens=6, seed=2)
    template_msgs = [msgs[0], {"role": "assistant", "content": "", "tool_calls": [
        {"name": "bash", "arguments": {"command": "ls"}}]}, {"role": "tool", "content": "a.py\nb.py"}]  # fmt: skip
    want = server.template.render(template_msgs, tools=_schemas(TOOLS), add_generation_prompt=True).token_ids
    assert r.model_extra["prompt_token_ids"] == want


def test_generated_tool_calls_come_back_in_openai_form(served):
    server, _, _ = served
    t = server.template
    text = '<think>plan</think>Let me look.<tool_call>{"name": "view", "arguments": {"path": "a.py"}}</tool_call>'
    ids = t.tokenizer.encode(text, allowed_special=("<think>", "</think>", "<tool_call>", "</tool_call>"))
    job = Job(sid=0, max_tokens=64, temperature=1.0, top_p=1.0, stop=(), seed=0, on_chunk=print,
              token_ids=ids + [t.tokenizer.end_id], finish="stop")  # fmt: skip
    msg, reason = chat_message(server, job, ())
    assert reason == "tool_calls" and msg["content"] == "Let me look." and msg["reasoning_content"] == "plan"
    (call,) = msg["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "view"
    assert json.loads(call["function"]["arguments"]) == {"path": "a.py"}


def test_streamed_tool_calls_arrive_with_the_last_chunk(served):
    import asyncio

    from rl.serve_app import Opened, Run, _stream
    from rl.serve_protocol import GenParams

    server, _, _ = served
    tok = server.template.tokenizer
    text = 'ok<tool_call>{"name": "bash", "arguments": {"command": "ls"}}</tool_call>'
    ids = tok.encode(text, allowed_special=("<tool_call>", "</tool_call>")) + [tok.end_id]

    async def collect() -> list[dict]:
        run = Run([Opened(0, [1, 2], 64, None)], GenParams(), asyncio.get_running_loop())
        for n, finish in ((1, None), (len(ids), "stop")):
            run.queue.put_nowait((0, Job(sid=0, max_tokens=64, temperature=1.0, top_p=1.0, stop=(), seed=0,
                                         on_chunk=print, token_ids=ids[:n], finish=finish)))  # fmt: skip
        return [json.loads(x[6:]) async for x in _stream(server, run, True, None) if x != "data: [DONE]\n\n"]

    chunks = asyncio.run(collect())
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    last = chunks[-1]["choices"][0]
    assert content == "ok" and last["finish_reason"] == "tool_calls" and last["token_ids"] == ids
    (call,) = last["delta"]["tool_calls"]
    assert call["index"] == 0 and call["function"]["name"] == "bash"


def test_streaming_gives_the_same_tokens_and_text_as_a_plain_request(served):
    _, _, client = served
    kw = dict(model=NAME, messages=[{"role": "user", "content": "Count to five."}], max_tokens=14, seed=7,
              temperature=1.0)  # fmt: skip
    plain = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1
    assert finals[0].choices[0].model_extra["token_ids"] == plain.choices[0].model_extra["token_ids"]
    assert text == (plain.choices[0].message.content or "")
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    n_content = sum(1 for c in chunks if c.choices and c.choices[0].delta.content)
    assert len(plain.choices[0].model_extra["token_ids"]) <= 4 or n_content >= 1


def test_n_choices_sample_independently_from_one_prompt(served):
    _, _, client = served
    r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Pick a word."}], n=3,
                                       max_tokens=8, temperature=1.0, seed=11)  # fmt: skip
    assert [c.index for c in r.choices] == [0, 1, 2]
    ids = [tuple(c.model_extra["token_ids"]) for c in r.choices]
    assert len(set(ids)) > 1, "three seeded samples of ~8 tokens over 4096 ids should not all agree"
    assert r.usage.completion_tokens == sum(len(x) for x in ids)


def test_text_completions_and_models(served):
    server, _, client = served
    r = client.completions.create(model=NAME, prompt="def f(x):", max_tokens=5, seed=3, n=2)
    assert len(r.choices) == 2 and all(len(c.model_extra["token_ids"]) <= 5 for c in r.choices)
    assert r.model_extra["prompt_token_ids"] == server.tokenizer.encode("def f(x):")
    assert [m.id for m in client.models.list().data] == [NAME]
    assert client.models.retrieve(NAME).id == NAME


def test_concurrent_requests_share_engine_calls(served):
    server, _, client = served
    engine = server.loop.engine
    before = dict(engine.stats)
    errors = []

    def ask(i: int) -> None:
        try:
            client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Same prompt."}],
                                           max_tokens=8, seed=i)  # fmt: skip
        except Exception as e:  # collected: the assertion below names it
            errors.append(e)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    # alone, a request costs one forward per generated token; requests that share forwards cost fewer
    forwards = engine.stats["forward_calls"] - before["forward_calls"]
    generated = engine.stats["tokens_generated"] - before["tokens_generated"]
    assert generated > 1.5 * forwards, f"{generated} tokens in {forwards} forwards: the requests did not batch"


def _post(url: str, data: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_errors_are_openai_bodies_with_the_right_status(served):
    server, thread, client = served
    user = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=user)
    assert e.value.code == "model_not_found" and e.value.param == "model"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "word " * server.max_seq_len}])
    assert e.value.code == "context_length_exceeded"
    for tools in ([{"type": "function"}], [{"type": "function", "function": {"name": "bad name!"}}],
                  [{"type": "function", "function": {"name": "x", "parameters": {"type": "array"}}}], {"x": 1}):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=NAME, messages=user, tools=tools)
        assert e.value.param == "tools"
    bad_call = [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "bash", "arguments": "{not json"}}]}]  # fmt: skip
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=NAME, messages=user + bad_call)
    status, body = _post(thread.base_url + "/chat/completions", b"{not json")
    assert status == 400 and "not valid JSON" in body["error"]["message"]
    status, body = _post(thread.base_url + "/nowhere", b"{}")
    assert status == 404 and "error" in body
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=NAME, messages=user, temperature=5)


def test_beyond_capacity_requests_get_429_and_the_server_keeps_serving(served):
    server, _, client = served
    server.cfg.max_pending = 2
    codes = []

    def ask() -> None:
        try:
            client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}], max_tokens=12)
            codes.append(200)
        except openai.RateLimitError as e:
            codes.append(e.status_code)

    try:
        threads = [threading.Thread(target=ask) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        server.cfg.max_pending = 64
    assert sorted(set(codes)) == [200, 429] and len(codes) == 8
    assert client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}], max_tokens=2)


# ---------------------------------------------------------------------- token-exact sessions
def _random_text(rng: random.Random) -> str:
    pieces = ["hello", " world", "\n", "déjà vu", "<|end|>", "<tool_call>", "{\"a\": 1}", "  ", "x" * 7, "λ", "42"]
    return "".join(rng.choice(pieces) for _ in range(rng.randint(0, 6)))


def _as_template(messages: list[dict], replies: list[list[int]], end_id: int, stop_ids) -> list[dict]:
    """The client's conversation in template form, assistant turns as the ids the server reported (a turn
    that did not end with a stop id is closed with <|end|> when the conversation goes on)."""
    out, k = [], 0
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            ids = list(replies[k])
            k += 1
            if i + 1 < len(messages) and (not ids or ids[-1] not in stop_ids):
                ids.append(end_id)
            out.append({"role": "assistant", "content": None, "token_ids": ids})
        elif m["role"] == "tool":
            out.append({"role": "tool", "content": m["content"]})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    return out


@pytest.mark.parametrize("case", range(6))
def test_session_records_equal_the_template_rendering_of_multi_turn_tool_conversations(served, case):
    server, thread, client = served
    rng = random.Random(case)
    tools = rng.sample(TOOLS, rng.randint(0, 3)) or None
    key = f"prop-{case}"
    messages = ([{"role": "system", "content": _random_text(rng)}] if rng.random() < 0.5 else [])
    messages.append({"role": "user", "content": _random_text(rng) or "go"})
    replies = []
    for turn in range(rng.randint(1, 4)):
        stop = ["x"] if rng.random() < 0.3 else None
        r = client.chat.completions.create(model=NAME, messages=messages, tools=tools, max_tokens=rng.randint(1, 9),
                                           temperature=1.0, seed=case * 10 + turn, stop=stop,
                                           extra_body={"session_id": key})  # fmt: skip
        assert r.model_extra["session_id"] == key
        msg = r.choices[0].message
        replies.append(r.choices[0].model_extra["token_ids"])
        entry = {"role": "assistant", "content": msg.content or ""}
        if msg.tool_calls:
            entry["tool_calls"] = [c.model_dump() for c in msg.tool_calls]
        messages.append(entry)
        for j in range(rng.randint(0, 2)):
            messages.append({"role": "tool", "tool_call_id": f"c{turn}{j}", "content": _random_text(rng)})
        if rng.random() < 0.5 or messages[-1]["role"] == "assistant":
            messages.append({"role": "user", "content": _random_text(rng)})
    rec = json.loads(urllib.request.urlopen(f"{thread.base_url}/sessions/{key}", timeout=30).read())
    t = server.template
    want = t.render(_as_template(messages[: len(rec["messages"])], replies, t.tokenizer.end_id, t.stop_ids),
                    tools=_schemas(tools) if tools else None).token_ids  # fmt: skip
    assert rec["token_ids"] == want
    assert t.render(rec["messages"], tools=rec["tools"]).token_ids == rec["token_ids"]
    generated = [i for i, m in enumerate(rec["loss_mask"]) if m]
    assert len(generated) == sum(len(r) for r in replies)
    assert all(math.isfinite(rec["logprobs"][i]) for i in generated)
    assert all(rec["logprobs"][i] is None for i, m in enumerate(rec["loss_mask"]) if not m)
    assert len(rec["turn_starts"]) == len(replies)
    req = urllib.request.Request(f"{thread.base_url}/sessions/{key}", method="DELETE")
    assert json.loads(urllib.request.urlopen(req, timeout=30).read())["deleted"]


def test_a_session_refuses_a_diverged_history_and_changed_tools(served):
    _, _, client = served
    key = "diverge"
    msgs = [{"role": "user", "content": "one"}]
    r = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=3, extra_body={"session_id": key})
    msgs.append({"role": "assistant", "content": r.choices[0].message.content or ""})
    with pytest.raises(openai.BadRequestError) as e:  # the user turn was dropped: not an extension
        client.chat.completions.create(model=NAME, messages=[{"role": "system", "content": "s"}, *msgs,
                                       {"role": "user", "content": "two"}], extra_body={"session_id": key})  # fmt: skip
    assert e.value.code == "session_diverged"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, messages=[*msgs, {"role": "user", "content": "two"}], tools=TOOLS,
                                       extra_body={"session_id": key})  # fmt: skip
    assert e.value.param == "tools"


def test_idle_sessions_expire_and_free_their_engine_session(served):
    server, thread, client = served
    client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "a"}], max_tokens=2,
                                   extra_body={"session_id": "idle"})  # fmt: skip
    sid = server.conversations["idle"].sid
    server.cfg.session_ttl_s = 0.0
    try:
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "b"}], max_tokens=2)
    finally:
        server.cfg.session_ttl_s = 3600.0
    assert "idle" not in server.conversations and sid not in server.loop.engine.session_ids
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(f"{thread.base_url}/sessions/idle", timeout=30)
    assert e.value.code == 404


def test_served_toy_episode_is_the_session_record(served):
    from rl.rollout import RolloutRequest, SamplingParams, toy_tasks
    from rl.serve_rollout import run_served_episode

    server, thread, _ = served
    task = vars(toy_tasks(1, n_turns=3)[0])
    req = RolloutRequest(key="g0/0", group_id="g0", task_id=task["task_id"], seed=5, env="toy", task=task)
    traj = run_served_episode(req, thread.base_url, NAME, SamplingParams(temperature=1.0, max_new_tokens=6),
                              server.template)  # fmt: skip
    assert len(traj.turn_starts) == 3 and sum(traj.loss_mask) >= 3
    assert server.template.render(traj.transcript).token_ids == traj.token_ids
    assert traj.verifier["termination"] == "done"
    assert not any(k.startswith("g0-0.") for k in server.conversations), "the session is deleted afterwards"


def test_a_served_episode_is_the_in_process_episode_token_for_token():
    """decode_chunk=0 (a turn is one engine call) and the agent loop's per-turn seeds are the rollout worker's
    engine mode exactly: the same engine calls on the same weights, so the same tokens and log-probs."""
    import asyncio

    from rl.rollout import RolloutRequest, SamplingParams, SessionBatcher, run_toy_episode, toy_tasks
    from rl.serve_rollout import run_served_episode

    model, template = build_model(DEBUG)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=5)
    task = vars(toy_tasks(2, n_turns=3)[1])
    req = RolloutRequest(key="g1/0", group_id="g1", task_id=task["task_id"], seed=9, env="toy", task=task)
    engine = InferenceEngine(model, template)
    local = asyncio.run(run_toy_episode(req, SessionBatcher(engine, sampling), template))
    server = Server(engine, template, ServeConfig(model_name=NAME, decode_chunk=0))
    with ServerThread(build_app(server)) as thread:
        served = run_served_episode(req, thread.base_url, NAME, sampling, template)
    server.loop.close()
    assert served.token_ids == local.token_ids and served.loss_mask == local.loss_mask
    assert served.turn_starts == local.turn_starts
    gen = [i for i, m in enumerate(local.loss_mask) if m]
    assert [served.logprobs[i] for i in gen] == [local.logprobs[i] for i in gen]


def test_factory_llm_client_drives_an_episode_policy(served):
    from envs.protocol import Message
    from synth.llm import ChatClient

    server, thread, _ = served
    client = ChatClient(thread.base_url, NAME)  # as the solve stage builds it: max_tokens 2048 > the context
    reply = client.policy([Message("system", "You fix bugs."), Message("user", "Fix it."),
                           Message("tool", "tests failed")])  # fmt: skip
    assert isinstance(reply, str) and client.usage["calls"] == 1
    assert 1 <= client.usage["completion_tokens"] <= server.max_seq_len - client.usage["prompt_tokens"]


def test_weights_reach_the_server_by_version(served, tmp_path):
    from model.checkpoint import save_checkpoint

    server, thread, client = served
    other, _ = build_model(DEBUG, seed=3)
    path = save_checkpoint(other, tmp_path / "model.safetensors")
    status, body = _post(thread.base_url + "/weights", json.dumps({"checkpoint": str(path), "version": 5}).encode())
    assert status == 200 and body["policy_version"] == 5
    r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "v?"}], max_tokens=3)
    assert r.model_extra["policy_version"] == 5 and set(r.choices[0].model_extra["policy_versions"]) == {5}
    missing = json.dumps({"checkpoint": "/nonexistent", "version": 6}).encode()
    status, body = _post(thread.base_url + "/weights", missing)
    assert status == 400 and server.policy_version == 5
