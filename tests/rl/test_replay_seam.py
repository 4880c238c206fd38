"""trainer.simulate_replay: the learner's log-probs of multi-turn rollouts from a rollout worker with the
default V4.1 inference path (CED prefill, prefix cache, packed caches under QAT, DSpark speculation)
match the rollout's own log-probs, through model/replay.py; the plain full forward does not (decoder
replay truncates local attention per turn). The number compared is the one the learner logs every step
(same_version_*)."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from rl.actors import RolloutWorker, build_model, pack_for_learner
from rl.config import ModelChoice, OptimConfig, RolloutConfig, TrainerConfig
from rl.learner import Learner
from rl.losses import mismatch_means, same_version_mismatch
from rl.rollout import RolloutRequest, toy_tasks

torch.set_num_threads(1)

DEBUG = ModelChoice(flavor="debug", overrides={"vocab_size": 4096, "engram_compressed_vocab_size": 2742,
                                               "max_seq_len": 256})  # fmt: skip
VERSION = 5


def _rollouts(choice: ModelChoice, weights, rollout: RolloutConfig):
    task = vars(toy_tasks(1, n_turns=3)[0])
    reqs = [RolloutRequest(key=f"g/{m}", group_id="g", task_id="toy-0", seed=m, env="toy", task=task) for m in range(2)]
    worker = RolloutWorker(choice, rollout)

    async def main():
        await worker.set_weights((VERSION, weights))
        return await worker.rollout_group(reqs)

    return asyncio.run(main())


def _mismatch(learner: Learner, trajs) -> dict[str, float]:
    sums = []
    for b in pack_for_learner(trajs, learner.cfg):
        sums.append(same_version_mismatch(learner.logprobs(b), b.logprobs, b.versions, b.loss_mask, VERSION))
    return mismatch_means(sums)


@pytest.mark.parametrize("qat", [False, True])
def test_simulated_replay_reproduces_the_default_rollout_logprobs(qat):
    choice = ModelChoice(flavor="debug", overrides={**DEBUG.overrides, "qat": qat})
    model, _ = build_model(choice, seed=1)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    # the rollout defaults: CED prefill, prefix cache, packed caches (dense with qat off), DSpark speculation
    trajs = _rollouts(choice, weights, RolloutConfig(temperature=1.0, max_new_tokens=12))
    assert all(len(t.turn_starts) == 3 and t.turn_starts[-1] > model.args.window_size for t in trajs)
    assert all(t.rollout_stats["prefix_global_hit"] == 1.0 and "spec_drafted" in t.rollout_stats for t in trajs)
    gaps = {}
    for replay in (True, False):
        policy, _ = build_model(choice, seed=0)
        policy.load_state_dict(weights)
        cfg = TrainerConfig(kind="rl", simulate_replay=replay, micro_batch_tokens=256, global_batch_tokens=256,
                            optim=OptimConfig())  # fmt: skip
        gaps[replay] = _mismatch(Learner(policy, cfg), trajs)
    n = sum(t.n_generated for t in trajs)
    assert gaps[True]["same_version_tokens"] == gaps[False]["same_version_tokens"] == n
    # fp32 on both sides, different kernels and orders of summation: 1e-3 nats is far above their rounding
    # and far below what a different execution plan (full attention where the engine replayed) gives
    assert math.isfinite(gaps[True]["same_version_abs_dlogp"]) and gaps[True]["same_version_abs_dlogp"] < 1e-3, gaps
    assert gaps[False]["same_version_abs_dlogp"] > 10 * gaps[True]["same_version_abs_dlogp"], gaps
    assert gaps[False]["same_version_k3"] > 10 * gaps[True]["same_version_k3"], gaps

