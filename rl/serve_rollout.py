"""Rollouts played through flashpost-serve (rollout.agent=server): an agent speaking only the OpenAI API
drives the episode against the server with a `session_id`, and the server's record of that session
(GET /v1/sessions/{id}: exactly the tokens the engine consumed and produced, their log-probs and policy
versions) becomes the trajectory.

Toy episodes are played by rl/agent_loop.py's `run_agent`; sandbox episodes by envs/episode.py (the
harness: tools in a Docker sandbox, pristine grading) with rl/agent_loop.py's `OpenAIPolicy` as its
policy. Not here: the server (rl/serve_app.py), in-process episodes (rl/rollout.py).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import urllib.request
import uuid
from collections.abc import Callable
from typing import Any

from model.chat_template import ChatTemplate
from rl.payloads import Trajectory
from rl.rollout import (
    RolloutRequest,
    SamplingParams,
    ToyTask,
    graded_fields,
    sandbox_episode_kwargs,
    unstarted_trajectory,
)


def session_key(req: RolloutRequest) -> str:
    """URL-safe and fresh per attempt: a re-issued rollout gets a new session."""
    return f"{req.key.replace('/', '-')}.{uuid.uuid4().hex[:12]}"


def pop_record(base_url: str, key: str) -> dict[str, Any]:
    """GET the session's record, then DELETE the session (blocking)."""
    url = f"{base_url}/sessions/{key}"
    with urllib.request.urlopen(url, timeout=60) as resp:
        rec = json.loads(resp.read())
    urllib.request.urlopen(urllib.request.Request(url, method="DELETE"), timeout=60).close()
    return rec


def record_trajectory(rec: dict[str, Any], req: RolloutRequest, template: ChatTemplate, **fields: Any) -> Trajectory:
    """A session record as a Trajectory. A truncated last turn is closed with <|end|> as TokenPolicy closes
    it (a given token: no loss, no log-prob), so both modes give the same tokens for the same draws."""
    if rec["loss_mask"][-1] and rec["token_ids"][-1] not in template.stop_ids:
        end = template.tokenizer.end_id
        rec["messages"][-1]["token_ids"].append(end)
        for k, v in (("token_ids", end), ("loss_mask", False), ("logprobs", None), ("versions", -1)):
            rec[k].append(v)
    return Trajectory(
        token_ids=rec["token_ids"], loss_mask=rec["loss_mask"], versions=rec["versions"],
        logprobs=[math.nan if x is None else x for x in rec["logprobs"]], turn_starts=rec["turn_starts"],
        task_id=req.task_id, group_id=req.group_id, seed=req.seed, transcript=rec["messages"], **fields,
    )  # fmt: skip


def _agent_sampling(sampling: SamplingParams):
    from rl.agent_loop import AgentSampling

    return AgentSampling(temperature=sampling.temperature, top_p=sampling.top_p, max_tokens=sampling.max_new_tokens)


def run_served_episode(req: RolloutRequest, base_url: str, model: str, sampling: SamplingParams,
                       template: ChatTemplate) -> Trajectory:  # fmt: skip
    """One toy episode played by rl/agent_loop.py's `run_agent` (blocking; run it in a thread)."""
    from openai import OpenAI

    from rl.agent_loop import ToyAgentEnv, run_agent

    task = ToyTask(**req.task)
    env = ToyAgentEnv(task.prompt, task.target, task.n_turns)
    key = session_key(req)
    t0 = time.monotonic()
    result = run_agent(OpenAI(base_url=base_url, api_key="-", max_retries=5), model, env, max_turns=task.n_turns,
                       seed=req.seed, session_id=key, sampling=_agent_sampling(sampling))  # fmt: skip
    reward = env.reward(result.replies[-1] if result.replies else "")
    return record_trajectory(pop_record(base_url, key), req, template, reward=reward,
                             timings={"agent_s": time.monotonic() - t0},
                             verifier={"passed": reward == 1.0, "target": task.target,
                                       "termination": result.termination})  # fmt: skip


async def run_served_sandbox_episode(
    req: RolloutRequest,
    base_url: str,
    model: str,
    sampling: SamplingParams,
    template: ChatTemplate,
    max_seq_len: int,
    sandbox_factory: Callable | None = None,
    grade: Callable | None = None,
    episode_config: Any = None,
) -> Trajectory:
    """One envs/episode.py sandbox episode whose policy is `OpenAIPolicy` against the server; infra failures
    as in rl/rollout.py `run_sandbox_episode`."""
    from openai import AsyncOpenAI

    from envs.episode import run_episode
    from envs.task import Task
    from envs.tools import tool_schemas
    from rl.agent_loop import OpenAIPolicy

    key = session_key(req)
    task = Task(**req.task)
    tools = [{"type": "function", "function": s} for s in tool_schemas(task.tools)]
    policy = OpenAIPolicy(AsyncOpenAI(base_url=base_url, api_key="-", max_retries=5), model, _agent_sampling(sampling),
                          tools=tools, seed=req.seed, session_id=key)  # fmt: skip
    kwargs = sandbox_episode_kwargs(template, max_seq_len, sampling.max_new_tokens, sandbox_factory, grade,
                                    episode_config)  # fmt: skip
    result = await run_episode(task, policy, **kwargs)
    fields = graded_fields(result)
    if policy.n_calls == 0:  # the sandbox never started: the server saw no request
        return unstarted_trajectory(req, template, result, fields)
    rec = await asyncio.to_thread(pop_record, base_url, key)
    return record_trajectory(rec, req, template, **fields)


__all__ = ["pop_record", "record_trajectory", "run_served_episode", "run_served_sandbox_episode", "session_key"]
