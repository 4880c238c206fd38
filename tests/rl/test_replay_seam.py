"""trainer.simulate_replay: the learner's π_prox of a multi-turn rollout from the CED engine
(rollout.prefill_mode=ced) matches the rollout's own log-probs, through model/replay.py; the plain
full forward does not (decoder replay truncates local attention per turn)."""

from __future__ import annotations

import asyncio
import math

import torch

from model.engine import InferenceEngine
from rl.actors import build_model, pack_for_learner
from rl.config import ModelChoice, OptimConfig, TrainerConfig
from rl.learner import Learner
from rl.rollout import RolloutRequest, SamplingParams, SessionBatcher, run_toy_episode, toy_tasks

torch.set_num_threads(1)

DEBUG = ModelChoice(flavor="debug", overrides={"vocab_size": 4096, "engram_compressed_vocab_size": 2742,
                                               "max_seq_len": 256, "qat": False})  # fmt: skip


def _ced_rollouts(model, template):
    engine = InferenceEngine(model, template, prefill_mode="ced")
    task = vars(toy_tasks(1, n_turns=3)[0])
    reqs = [RolloutRequest(key=f"g/{m}", group_id="g", task_id="toy-0", seed=m, env="toy", task=task) for m in range(2)]

    async def main():
        batcher = SessionBatcher(engine, SamplingParams(temperature=1.0, max_new_tokens=12))
        return await asyncio.gather(*(run_toy_episode(r, batcher, template) for r in reqs))

    return asyncio.run(main())


def _max_gap(learner: Learner, trajs) -> float:
    gap = 0.0
    for b in pack_for_learner(trajs, learner.cfg):
        prox = learner.logprobs(b)
        gap = max(gap, float((prox - b.logprobs).abs()[b.loss_mask].max()))
    return gap


def test_simulated_replay_reproduces_ced_rollout_logprobs():
    model, template = build_model(DEBUG, seed=1)
    trajs = _ced_rollouts(model, template)
    assert all(len(t.turn_starts) == 3 and t.turn_starts[-1] > model.args.window_size for t in trajs)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    gaps = {}
    for replay in (True, False):
        policy, _ = build_model(DEBUG, seed=0)
        policy.load_state_dict(weights)
        cfg = TrainerConfig(kind="rl", simulate_replay=replay, micro_batch_tokens=256, global_batch_tokens=256,
                            optim=OptimConfig())  # fmt: skip
        gaps[replay] = _max_gap(Learner(policy, cfg), trajs)
    assert math.isfinite(gaps[True]) and gaps[True] < 1e-3, gaps
    assert gaps[False] > 10 * gaps[True], gaps
