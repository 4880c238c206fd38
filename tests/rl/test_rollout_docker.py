"""Sandbox rollouts (envs/episode.py in real Docker containers) through the token-in/token-out policy:
a group whose member's sandbox cannot start marks that member infra-failed, the others are graded,
and the group's statistics exclude the crashed one. Tokens equal the template rendering with tools. The
worker grades a task under its measured budget, not the cap."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from rl.actors import build_model
from rl.config import ModelChoice
from rl.payloads import TrajectoryGroup
from rl.rl_loop import score_groups
from rl.rollout import RolloutRequest, SamplingParams, SessionBatcher, run_sandbox_episode

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


def test_crashed_sandbox_is_infra_failed_and_excluded_from_its_group(fixture_task):
    from envs.episode import EpisodeConfig
    from envs.tools import tool_schemas
    from model.engine import InferenceEngine

    model, template = build_model(DEBUG, seed=0)
    engine = InferenceEngine(model, template)
    broken = dataclasses.replace(fixture_task, image="flashpost/no-such-image:missing")
    tasks = [fixture_task, fixture_task, broken]
    reqs = [RolloutRequest(key=f"g/{i}", group_id="g", task_id=t.task_id, seed=i, env="sandbox", task=t.to_dict())
            for i, t in enumerate(tasks)]  # fmt: skip

    async def main():
        batcher = SessionBatcher(engine, SamplingParams(temperature=1.0, max_new_tokens=8), max_wait_s=0.005)
        return await asyncio.gather(*(
            run_sandbox_episode(r, batcher, template, episode_config=EpisodeConfig(max_turns=2, wall_time_s=120))
            for r in reqs
        ))  # fmt: skip

    trajs = asyncio.run(main())
    assert [t.infra_failed for t in trajs] == [False, False, True], [t.verifier for t in trajs]
    assert trajs[2].verifier["termination"] == "sandbox_error" and trajs[2].n_generated == 0
    for t in trajs[:2]:  # graded episodes: their tokens are the rendering of the conversation with the tools
        assert t.verifier["termination"] == "max_turns" and t.verifier["reason"] is not None
        assert t.token_ids == template.render(t.transcript, tools=tool_schemas()).token_ids
        assert len(t.turn_starts) == 2 and t.timings["setup_s"] > 0
    trajs[0].reward = 1.0  # a pass and a fail among the graded members, so the group carries a signal
    scored = score_groups([TrajectoryGroup(group_id="g", trajectories=trajs)], "grpo", 1e-6)
    assert len(scored.trajs) == 2 and not any(t.infra_failed for t in scored.trajs)
    assert scored.advantages == pytest.approx([1.0, -1.0], abs=1e-5)


def test_worker_episodes_stop_at_rollout_max_turns():
    """The rollout worker's sandbox episodes take their turn limit from rollout.max_turns (not a constant)."""
    from rl.actors import RolloutWorker
    from rl.config import RolloutConfig

    worker = RolloutWorker(DEBUG, RolloutConfig(max_turns=3))
    assert worker._sandbox_tools()[2].max_turns == 3
    assert RolloutWorker(DEBUG, RolloutConfig(max_turns=7))._sandbox_tools()[2].max_turns == 7


def test_worker_grades_a_task_under_its_budget_not_the_cap(fixture_task):
    """The rollout worker's grading (the RL job's and the evaluator's) stops an endless loop at the task's
    measured budget (verification["grading_budget_s"]), not at env.grading_timeout_s."""
    import time

    from envs.fixtures.build import repo_files
    from envs.grading import GRADING_BUDGET_KEY
    from rl.actors import RolloutWorker
    from rl.config import EnvConfig, RolloutConfig
    from synth.patches import edits_to_patch

    path = "calkit/intervals.py"
    assert fixture_task.task_id == "calkit-merge-touching"
    source = repo_files()[path]
    endless = source.decode().replace("    merged: list[tuple[int, int]] = []\n", "    while True:\n        pass\n", 1)
    task = dataclasses.replace(fixture_task, verification={**fixture_task.verification, GRADING_BUDGET_KEY: 3.0})
    worker = RolloutWorker(DEBUG, RolloutConfig(), EnvConfig(grading_timeout_s=120.0))
    try:
        grade = worker._sandbox_tools()[1]
        t0 = time.monotonic()
        r = grade(task, edits_to_patch({path: source}, {path: endless}))
        assert r.reward == 0.0 and "pytest timed out" in r.reason, r.reason
        assert time.monotonic() - t0 < 30.0, "the grading waited for env.grading_timeout_s, not the task's budget"
    finally:
        worker.close()
