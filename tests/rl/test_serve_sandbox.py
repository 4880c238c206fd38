"""A sandbox episode played through flashpost-serve (rollout.agent=server): envs/episode.py is the harness
(tools in a real Docker container, pristine grading), rl/agent_loop.py's OpenAIPolicy its policy over the
OpenAI API; the trajectory is the server's session record and equals the template rendering of the
conversation with the tools."""

from __future__ import annotations

import asyncio

import pytest
import torch

from model.engine import InferenceEngine
from rl.actors import build_model
from rl.config import ModelChoice
from rl.rollout import RolloutRequest, SamplingParams
from rl.serve_app import Server, ServerThread, build_app
from rl.serve_engine import ServeConfig
from rl.serve_rollout import run_served_sandbox_episode

pytestmark = pytest.mark.docker

torch.set_num_threads(1)

DEBUG = ModelChoice(flavor="debug", overrides={"vocab_size": 4096, "engram_compressed_vocab_size": 2742,
                                               "max_seq_len": 2048})  # fmt: skip


@pytest.fixture(scope="module")
def fixture_task():
    from envs import engine

    if not engine.engine_available():
        pytest.skip("no Docker engine answers: run `bash infra/docker/ensure_engine.sh` (or `make test`)")
    from envs.fixtures.build import fixture_tasks

    return fixture_tasks(build=True)[0]


def test_served_sandbox_episode_is_graded_and_token_exact(fixture_task):
    from envs.episode import EpisodeConfig
    from envs.tools import tool_schemas

    model, template = build_model(DEBUG, seed=0)
    server = Server(InferenceEngine(model, template), template, ServeConfig(model_name="debug", decode_chunk=0))
    req = RolloutRequest(key="g/0", group_id="g", task_id=fixture_task.task_id, seed=0, env="sandbox",
                         task=fixture_task.to_dict())  # fmt: skip
    with ServerThread(build_app(server)) as thread:
        traj = asyncio.run(run_served_sandbox_episode(
            req, thread.base_url, "debug", SamplingParams(temperature=1.0, max_new_tokens=8), template,
            server.max_seq_len, episode_config=EpisodeConfig(max_turns=2, wall_time_s=120)))  # fmt: skip
    server.loop.close()
    assert not traj.infra_failed, traj.verifier
    assert traj.verifier["termination"] == "max_turns" and traj.verifier["reason"] is not None
    assert traj.token_ids == template.render(traj.transcript, tools=tool_schemas()).token_ids
    assert len(traj.turn_starts) == 2 and 2 <= traj.n_generated <= 18
    assert not server.conversations, "the session is deleted once its record is taken"
