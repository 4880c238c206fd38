"""Token-in/token-out rollouts on the real InferenceEngine (debug model, default tokenizer), no Ray:
for multi-turn episodes the concatenated rollout tokens are the template rendering of the whole
conversation (property test), every generated token carries its log-prob and policy version, and
crashed sandboxes are excluded from their group's statistics."""

from __future__ import annotations

import asyncio
import math
import random

import pytest
import torch

from rl.actors import build_model
from rl.config import ModelChoice
from rl.payloads import Trajectory, TrajectoryGroup
from rl.rl_loop import score_groups
from rl.rollout import RolloutRequest, SamplingParams, SessionBatcher, run_toy_episode, toy_tasks

torch.set_num_threads(1)

DEBUG = ModelChoice(flavor="debug", overrides={"vocab_size": 4096, "engram_compressed_vocab_size": 2742,
                                               "max_seq_len": 256})  # fmt: skip


@pytest.fixture(scope="module")
def engine_and_template():
    from model.engine import InferenceEngine

    model, template = build_model(DEBUG, seed=0)
    return InferenceEngine(model, template), template


def _run_group(engine, template, n_turns: int, group: int, seed: int, max_new: int, temperature: float):
    task = vars(toy_tasks(1, n_turns=n_turns)[0])
    reqs = [RolloutRequest(key=f"g/{m}", group_id="g", task_id=task["task_id"], seed=seed + m, env="toy", task=task)
            for m in range(group)]  # fmt: skip

    async def main():
        batcher = SessionBatcher(engine, SamplingParams(temperature=temperature, max_new_tokens=max_new))
        return await asyncio.gather(*(run_toy_episode(r, batcher, template) for r in reqs))

    return asyncio.run(main())


def _cases(n: int, seed: int = 2024) -> list[tuple]:
    """Random conversations shapes (a seeded property sweep): turns, group size, seed, reply budget,
    temperature (0 = greedy, 3 = near-uniform tokens, the hardest case for re-tokenisation)."""
    rng = random.Random(seed)
    return [(rng.randint(1, 3), rng.randint(1, 3), rng.randrange(10**6), rng.randint(1, 10),
             rng.choice([0.0, 1.0, 3.0])) for _ in range(n)]  # fmt: skip


@pytest.mark.parametrize(("n_turns", "group", "seed", "max_new", "temperature"), _cases(6))
def test_rollout_tokens_are_the_template_rendering_of_the_whole_conversation(
    engine_and_template, n_turns, group, seed, max_new, temperature
):
    engine, template = engine_and_template
    engine.load_state_dict(engine.model.state_dict(), version=3)
    for traj in _run_group(engine, template, n_turns, group, seed, max_new, temperature):
        rendered = template.render(traj.transcript)
        assert traj.token_ids == rendered.token_ids
        assistant = [s for s in rendered.turn_spans if s.role == "assistant"]
        assert traj.turn_starts == [s.body_start for s in assistant] and len(assistant) == n_turns
        for i, (m, lp, v) in enumerate(zip(traj.loss_mask, traj.logprobs, traj.versions)):
            if m:  # generated: the template marks it as assistant output, and it has μ and a version
                assert rendered.loss_mask[i] and lp <= 0.0 and v == 3
            else:  # given: prompt, observations, or the <|end|> that closes a truncated turn
                assert math.isnan(lp) and v == -1
                assert not rendered.loss_mask[i] or traj.token_ids[i] == template.tokenizer.end_id
        forced = sum(1 for i, m in enumerate(rendered.loss_mask) if m and not traj.loss_mask[i])
        assert forced <= n_turns and traj.n_generated + forced == sum(rendered.loss_mask)


def test_same_seed_same_rollout_whatever_the_batch(engine_and_template):
    """A re-issued rollout (same seed, same weights) is the same experiment: tokens and log-probs agree
    whether it ran alone or in a group."""
    engine, template = engine_and_template
    alone = _run_group(engine, template, 2, 1, seed=11, max_new=8, temperature=1.0)[0]
    grouped = _run_group(engine, template, 2, 3, seed=11, max_new=8, temperature=1.0)[0]
    assert alone.token_ids == grouped.token_ids
    lp_a = [x for x in alone.logprobs if not math.isnan(x)]
    lp_g = [x for x in grouped.logprobs if not math.isnan(x)]
    assert max(abs(a - b) for a, b in zip(lp_a, lp_g)) < 1e-4


def _traj(reward: float, group: str, failed: bool = False) -> Trajectory:
    return Trajectory(token_ids=[1, 2, 3], loss_mask=[False, True, True], logprobs=[math.nan, -1.0, -1.0],
                      versions=[-1, 0, 0], turn_starts=[1], reward=reward, group_id=group, infra_failed=failed)


def test_infra_failed_rollouts_are_excluded_from_group_statistics():
    group = TrajectoryGroup(group_id="g", trajectories=[_traj(1.0, "g"), _traj(0.0, "g"), _traj(0.0, "g", True)])
    scored = score_groups([group], "grpo", 1e-6)
    assert len(scored.trajs) == 2 and all(not t.infra_failed for t in scored.trajs)
    assert scored.advantages == pytest.approx([1.0, -1.0], abs=1e-5)  # mean 0.5, std 0.5 over the 2 valid
    assert scored.stats["infra_failed"] == 1 and scored.stats["reward_mean"] == 0.5


def test_a_session_with_tokens_no_generation_accounts_for_is_an_infra_failure(engine_and_template):
    """A generate call that raised after committing tokens leaves them without log-probs: the episode's
    trajectory is infra-failed with the reason, not a crash of the rollout worker."""
    from rl.rollout import TokenPolicy

    engine, template = engine_and_template
    task = vars(toy_tasks(1)[0])
    req = RolloutRequest(key="g/0", group_id="g", task_id=task["task_id"], seed=1, env="toy", task=task)

    async def main():
        batcher = SessionBatcher(engine, SamplingParams(temperature=1.0, max_new_tokens=4))
        policy = TokenPolicy(batcher, template, None, seed=1)
        batcher.register()
        await policy([{"role": "user", "content": task["prompt"]}])
        batcher.unregister()
        ok = policy.trajectory(req, reward=1.0)
        engine.generate([policy.session], 3, 1.0, seed=5)  # tokens committed, their Generation never returned
        lost = policy.trajectory(req, reward=1.0, verifier={"termination": "policy_error", "error": "boom"})
        policy.close()
        return ok, lost

    ok, lost = asyncio.run(main())
    assert not ok.infra_failed and sum(ok.loss_mask) > 0
    assert lost.infra_failed and not any(lost.loss_mask) and all(math.isnan(x) for x in lost.logprobs)
    assert len(lost.token_ids) == len(ok.token_ids) + 3 and "boom" in lost.verifier["error"]


def test_a_turn_whose_generate_raised_before_any_token_is_an_infra_failure(engine_and_template, monkeypatch):
    """A generate call that raised before committing a token (seen on the H200: a CUDA graph capture that
    failed) leaves its turn start at the end of the session's tokens: the trajectory is infra-failed and
    well-formed, not a ValueError that ends the RL job."""
    from rl.rollout import TokenPolicy

    engine, template = engine_and_template
    task = vars(toy_tasks(1)[0])
    req = RolloutRequest(key="g/0", group_id="g", task_id=task["task_id"], seed=1, env="toy", task=task)

    def broken(*args, **kwargs):
        raise RuntimeError("capture failed")

    async def main():
        batcher = SessionBatcher(engine, SamplingParams(temperature=1.0, max_new_tokens=4))
        policy = TokenPolicy(batcher, template, None, seed=1)
        batcher.register()
        messages = [{"role": "user", "content": task["prompt"]}]
        reply = await policy(messages)
        monkeypatch.setattr(engine, "generate", broken)
        with pytest.raises(RuntimeError, match="capture failed"):
            await policy(messages + [{"role": "assistant", "content": reply}, {"role": "user", "content": "again"}])
        batcher.unregister()
        lost = policy.trajectory(req, reward=0.0, verifier={"termination": "policy_error", "error": "capture failed"})
        policy.close()
        return lost

    lost = asyncio.run(main())
    assert lost.infra_failed and not any(lost.loss_mask)
    assert len(lost.turn_starts) == 1 and lost.turn_starts[0] < len(lost.token_ids)  # the failed turn's start dropped
    assert "generate call 2 failed" in lost.verifier["error"] and "capture failed" in lost.verifier["error"]
