"""The V4.1 inference path of rollout workers (rollout.prefill_mode / prefix_cache / packed_cache /
speculative): what each switch changes and what it must not change, the drafter version trajectories
carry, and the per-batch metrics the driver logs."""

from __future__ import annotations

import asyncio

import pytest
import torch

from rl.actors import RolloutWorker, build_engine, build_model
from rl.config import JobConfig, ModelChoice, RolloutConfig, TrainerConfig
from rl.payloads import Trajectory
from rl.rl_loop import rollout_stats
from rl.rollout import RolloutRequest, toy_tasks

torch.set_num_threads(1)

DEBUG = ModelChoice(flavor="debug", overrides={"vocab_size": 4096, "engram_compressed_vocab_size": 2742,
                                               "max_seq_len": 256})  # fmt: skip


def _group(worker: RolloutWorker, weights, version: int = 1, n: int = 3):
    task = vars(toy_tasks(1, n_turns=2)[0])
    reqs = [RolloutRequest(key=f"g/{m}", group_id="g", task_id="toy-0", seed=m, env="toy", task=task) for m in range(n)]

    async def main():
        await worker.set_weights((version, weights))
        return await worker.rollout_group(reqs)

    return asyncio.run(main())


@pytest.fixture(scope="module")
def weights():
    model, _ = build_model(DEBUG, seed=1)
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_prefix_cache_hits_change_no_token_or_logprob(weights):
    """A group's shared prompt is prefilled once: every sample restores it from the prefix cache (one
    hit each), and the episodes are the ones without the cache, token for token and log-prob for log-prob."""
    cfg = dict(temperature=1.0, max_new_tokens=10, speculative=False)
    plain = _group(RolloutWorker(DEBUG, RolloutConfig(prefix_cache=False, **cfg)), weights)
    cached = _group(RolloutWorker(DEBUG, RolloutConfig(prefix_cache=True, **cfg)), weights)
    assert [t.rollout_stats["prefix_global_hit"] for t in cached] == [1.0] * 3
    for a, b in zip(plain, cached):
        assert a.token_ids == b.token_ids
        # the restored state is the stored tensors themselves: only fp32 re-association could differ
        assert max(abs(x - y) for x, y, m in zip(a.logprobs, b.logprobs, a.loss_mask) if m) < 1e-5


def test_default_rollout_runs_the_v41_path_and_records_the_drafter_version(weights):
    worker = RolloutWorker(DEBUG, RolloutConfig(temperature=1.0, max_new_tokens=8))
    assert worker.engine.prefill_mode == "ced" and worker.engine.prefix_cache is not None
    assert worker.engine.speculative is not None and worker.engine.packed_cache
    trajs = _group(worker, weights, version=1)
    assert all(t.drafter_version == 1 for t in trajs)
    st = trajs[0].rollout_stats
    assert st["replay_segments"] == 2.0 and st["cache_bytes_per_token"] > 0 and "spec_drafted" in st
    # new policy weights with the same drafter: the drafter version stays; a changed drafter moves it
    same = {k: (v + 1e-3 if not k.startswith("mtp.") and v.is_floating_point() else v) for k, v in weights.items()}
    assert all(t.drafter_version == 1 for t in _group(worker, same, version=2, n=1))
    moved = {k: (v + 1e-3 if k.startswith("mtp.") and v.is_floating_point() else v) for k, v in same.items()}
    assert all(t.drafter_version == 3 for t in _group(worker, moved, version=3, n=1))


def test_rollout_batch_metrics_name_the_features_and_split_acceptance_by_version():
    def traj(drafter: int, version: int, drafted: float, accepted: float, hit: float) -> Trajectory:
        n = 4
        return Trajectory(token_ids=[1] * n, loss_mask=[False, True, True, True], logprobs=[0.0] * n,
                          versions=[-1] + [version] * 3, turn_starts=[1], drafter_version=drafter,
                          rollout_stats={"cache_bytes_per_token": 100.0, "replay_segments": 2.0,
                                         "prefix_global_hit": hit, "prefix_global_miss": 1.0 - hit,
                                         "spec_steps": 2.0, "spec_plain_steps": 2.0, "spec_emitted": 5.0,
                                         "spec_drafted": drafted, "spec_accepted": accepted,
                                         "spec_off_calls": float(drafter == 2)})  # fmt: skip

    job = JobConfig(trainer=TrainerConfig(kind="rl"))
    out = rollout_stats([traj(1, 1, 4, 2, 1), traj(1, 2, 4, 4, 0), traj(2, 2, 2, 0, 1)], job)
    assert out["feature_ced"] == out["feature_prefix_cache"] == out["feature_speculative"] == 1.0
    assert out["feature_simulate_replay"] == out["feature_packed_cache"] == 1.0 and out["feature_routing_replay"] == 0.0
    no_qat = JobConfig(trainer=TrainerConfig(kind="rl"), model=ModelChoice(overrides={"qat": False}))
    assert rollout_stats([], no_qat)["feature_packed_cache"] == 0.0  # what ran: dense caches (build_engine)
    assert out["prefix_hit_rate"] == pytest.approx(2 / 3) and out["cache_bytes_per_token"] == 100.0
    assert out["dspark_rollout_acceptance"] == pytest.approx(6 / 10)
    assert out["dspark_rollout_drafting_frac"] == 0.5
    assert out["dspark_rollout_off_frac"] == pytest.approx(1 / 3)  # one of the three turns ran plain
    assert out["dspark_rollout_acceptance/d1/p1"] == 0.5 and out["dspark_rollout_acceptance/d1/p2"] == 1.0
    assert out["dspark_rollout_acceptance/d2/p2"] == 0.0


def test_inference_switches_are_validated_with_the_fix_named():
    with pytest.raises(ValueError, match="prefill_mode=ced"):
        RolloutConfig(prefill_mode="full")  # the prefix cache caches CED states only
    RolloutConfig(prefill_mode="full", prefix_cache=False)
    # the learner's replay follows the rollout's prefill unless set; set against it, it is refused
    assert JobConfig(trainer=TrainerConfig(kind="rl")).trainer.simulate_replay is True
    full = RolloutConfig(prefill_mode="full", prefix_cache=False)
    ablation = JobConfig(trainer=TrainerConfig(kind="opd"), rollout=full)
    assert ablation.trainer.simulate_replay is False
    assert JobConfig(trainer=TrainerConfig(kind="sft")).trainer.simulate_replay is False
    with pytest.raises(ValueError, match="simulate_replay"):
        JobConfig(trainer=TrainerConfig(kind="rl", simulate_replay=False))


def test_packed_caches_stay_dense_without_qat():
    """Packed bytes are lossless only on the QAT grid: with qat off the default rollout keeps live caches
    and prefix banks dense instead of refusing (rollout.packed_cache's documented fallback)."""
    model, template = build_model(ModelChoice(flavor="debug", overrides={**DEBUG.overrides, "qat": False}), seed=0)
    engine = build_engine(model, template, RolloutConfig(), torch.device("cpu"))
    assert RolloutConfig().packed_cache and not engine.packed_cache and not engine.prefix_cache.packed
