"""trainer.routing_replay: rollout workers record every token's MoE experts (engine record_routing=True),
trajectories carry them (JSON round trip, packed like the tokens with -1 padding), and the learner's
forward routes by them, with and without simulated decoder replay: at the rollout's weights its
log-probs are the rollout's; after the gates change, the recorded experts are still the ones used."""

from __future__ import annotations

import asyncio
import functools
import math

import pytest
import torch

from model.moe import routing_record, stack_routing
from model.replay import simulated_forward
from rl.actors import RolloutWorker, build_model, pack_for_learner
from rl.config import JobConfig, ModelChoice, OptimConfig, RolloutConfig, TrainerConfig
from rl.learner import Learner
from rl.losses import mismatch_means, same_version_mismatch
from rl.payloads import Trajectory, pack_trajectories
from rl.rollout import RolloutRequest, toy_tasks

torch.set_num_threads(1)

DEBUG = ModelChoice(flavor="debug", overrides={"vocab_size": 4096, "engram_compressed_vocab_size": 2742,
                                               "max_seq_len": 256})  # fmt: skip
VERSION = 5
# "ced": the rollout defaults (CED prefill, prefix cache, packed caches, DSpark speculation) with simulated
# decoder replay in the learner; "full": full prefill, the plain teacher-forced forward
MODES = {"ced": ({}, True), "full": ({"prefill_mode": "full", "prefix_cache": False}, False)}


@functools.cache
def _weights() -> dict[str, torch.Tensor]:
    model, _ = build_model(DEBUG, seed=1)
    return {k: v.clone() for k, v in model.state_dict().items()}


@functools.cache
def _rollouts(mode: str) -> list[Trajectory]:
    task = vars(toy_tasks(1, n_turns=3)[0])
    reqs = [RolloutRequest(key=f"g/{m}", group_id="g", task_id="toy-0", seed=m, env="toy", task=task) for m in range(2)]
    worker = RolloutWorker(DEBUG, RolloutConfig(temperature=1.0, max_new_tokens=12, **MODES[mode][0]),
                           record_routing=True)  # fmt: skip

    async def main():
        await worker.set_weights((VERSION, _weights()))
        return await worker.rollout_group(reqs)

    return asyncio.run(main())


def _learner(mode: str, routing_replay: bool) -> Learner:
    policy, _ = build_model(DEBUG, seed=0)
    policy.load_state_dict(_weights())
    cfg = TrainerConfig(kind="rl", simulate_replay=MODES[mode][1], routing_replay=routing_replay,
                        micro_batch_tokens=256, global_batch_tokens=256, optim=OptimConfig())  # fmt: skip
    return Learner(policy, cfg)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_routing_replay_reproduces_the_rollout_logprobs(mode):
    trajs = _rollouts(mode)
    a = _learner(mode, True).model.args
    for t in trajs:
        assert t.routing is not None and t.routing.dtype == torch.int32
        assert t.routing.shape == (len(t), a.n_layers, a.n_activated_experts)
        assert bool((t.routing[-1] == -1).all())  # the last token was never fed
    learner = _learner(mode, True)
    sums = [same_version_mismatch(learner.logprobs(b), b.logprobs, b.versions, b.loss_mask, VERSION)
            for b in pack_for_learner(trajs, learner.cfg)]  # fmt: skip
    gap = mismatch_means(sums)
    assert gap["same_version_tokens"] == sum(t.n_generated for t in trajs)
    # fp32 on both sides, different kernels and orders of summation (tests/rl/test_replay_seam.py): 1e-3
    # nats is far above their rounding; forcing experts the rollout did not use moves log-probs by far more
    assert math.isfinite(gap["same_version_abs_dlogp"]) and gap["same_version_abs_dlogp"] < 1e-3, gap


@pytest.mark.parametrize("mode", sorted(MODES))
def test_recorded_experts_are_forced_after_the_weights_change(mode):
    trajs = _rollouts(mode)
    routed = {}
    for replay in (True, False):
        learner = _learner(mode, replay)
        g = torch.Generator().manual_seed(2)
        with torch.no_grad():
            for layer in learner.model.layers:
                layer.ffn.gate.weight.add_(torch.randn(layer.ffn.gate.weight.shape, generator=g))
        (batch,) = pack_for_learner(trajs, learner.cfg)
        with torch.no_grad():
            routed[replay] = stack_routing(learner.forward(batch, compute_indexer_loss=False).router_stats)
    # the generated tokens: every layer recorded them, and in the simulated plan the turn that generated
    # a token is the segment its router stats come from; the full forward: every recorded token
    recorded = batch.routing >= 0
    check = recorded & batch.loss_mask[..., None, None] if MODES[mode][1] else recorded
    assert bool(check.any())
    assert torch.equal(routed[True].to(torch.int32)[check], batch.routing[check])
    assert not torch.equal(routed[False].to(torch.int32)[check], batch.routing[check])  # the new gates route elsewhere


def test_a_ced_segment_forces_only_the_positions_its_turn_fed():
    """The engine records a token's decoder experts in the turn that fed it; a later turn's replay segment
    re-runs earlier tokens without recording them. So turn k's segment forces the positions from the
    previous turn's last generated token on, and routes the earlier ones as with nothing recorded."""
    model, _ = build_model(DEBUG, seed=1)
    a = model.eval().args
    E, W, K = a.n_encoder_layers, a.window_size, a.n_activated_experts
    S = 44
    turns = [[(18, 24), (30, 40)]]  # turn 1's segment [30 - W, 40) re-runs positions 14..22 of turn 0
    lo, fed = turns[0][1][0] - W, turns[0][0][1] - 1
    assert lo < fed
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(32, 500, (1, S), generator=g)
    routing = torch.rand(1, S, a.n_layers, a.n_routed_experts, generator=g).argsort(-1)[..., :K].sort(-1).values
    encoder_only = routing.clone()
    encoder_only[:, :, E:] = -1

    def decoder_calls(r: torch.Tensor) -> list[torch.Tensor]:
        """Each segment's decoder routing [n, n_decoder, K]: the decoder runs all segments as one
        batch, row j = segment j padded at its end (model/replay.py)."""
        with torch.no_grad(), routing_record() as record:
            simulated_forward(model, ids, turns, routing=r, compute_indexer_loss=False)
        (call,) = zip(*(record[i] for i in range(E, a.n_layers)))
        rows = torch.stack(call, dim=-2)
        return [rows[j, : t - (max(0, n - W))] for j, (n, t) in enumerate(turns[0])]

    seg0, seg1 = decoder_calls(routing)
    free0, free1 = decoder_calls(encoder_only)
    assert torch.equal(seg0, routing[0, turns[0][0][0] - W : 24, E:])  # turn 0 fed its whole segment
    assert torch.equal(seg1[fed - lo :], routing[0, fed:40, E:])
    assert torch.equal(seg1[: fed - lo], free1[: fed - lo])  # causal: the same inputs, routed afresh
    assert not torch.equal(seg1[: fed - lo], routing[0, lo:fed, E:])
    assert not torch.equal(free0, seg0)


def test_routing_travels_with_the_trajectory():
    n, L, K = 6, 3, 2
    routing = torch.arange(n * L * K, dtype=torch.int32).view(n, L, K)
    t = Trajectory(token_ids=list(range(n)), loss_mask=[False, False, True, True, False, True],
                   logprobs=[math.nan, math.nan, -0.5, -0.2, math.nan, -1.0], versions=[-1, -1, 0, 0, -1, 0],
                   turn_starts=[2, 5], routing=routing)  # fmt: skip
    back = Trajectory.from_json(t.to_json())
    assert back.routing.dtype == torch.int32 and torch.equal(back.routing, routing)
    plain = Trajectory(token_ids=[1, 2, 3], loss_mask=[False, True, True], logprobs=[math.nan, -0.1, -0.1],
                       versions=[-1, 0, 0], turn_starts=[1])  # fmt: skip
    (batch,) = pack_trajectories([t, plain], max_tokens=12)
    assert batch.routing.shape == (1, 12, L, K)
    assert torch.equal(batch.routing[0, :n], routing)
    assert bool((batch.routing[0, n:] == -1).all())  # a trajectory without routing and the padding
    assert pack_trajectories([plain], max_tokens=4)[0].routing is None
    with pytest.raises(ValueError, match="Trajectory.routing"):
        Trajectory(token_ids=[1, 2], loss_mask=[False, False], logprobs=[math.nan] * 2, versions=[-1, -1],
                   turn_starts=[], routing=routing)  # fmt: skip


def test_the_learner_refuses_batches_without_routing():
    learner = _learner("full", True)
    plain = Trajectory(token_ids=[1, 2, 3], loss_mask=[False, True, True], logprobs=[math.nan, -0.1, -0.1],
                       versions=[-1, 0, 0], turn_starts=[1])  # fmt: skip
    with pytest.raises(ValueError, match="record_routing=True"):
        learner.logprobs(pack_trajectories([plain], max_tokens=8)[0])


def test_served_rollouts_cannot_carry_routing():
    with pytest.raises(ValueError, match="rollout.agent=engine"):
        JobConfig(trainer=TrainerConfig(kind="rl", routing_replay=True), rollout=RolloutConfig(agent="server"))


@pytest.mark.ray
def test_the_async_loop_trains_with_routing_replay(tmp_path):
    """The path `flashpost-train trainer.routing_replay=true` runs: Ray rollout workers record, the
    learner replays; the same-version mismatch it logs stays at rounding level (as above)."""
    from rl.cluster import ClusterConfig, shutdown, start_or_join
    from rl.rl_loop import AsyncDriver
    from synth.taskset_sources import toy_set

    job = JobConfig(
        model=DEBUG, tasks=str(toy_set(4, 2, heldout_share=0.0)),
        trainer=TrainerConfig(kind="rl", max_steps=2, micro_batch_tokens=256, global_batch_tokens=256,
                              routing_replay=True, optim=OptimConfig(lr=1e-3, sinkhorn_lr=1e-3, muon_lr=1e-2)),
        rollout=RolloutConfig(group_size=3, groups_per_step=2, max_policy_lag=0, max_new_tokens=6, max_turns=2,
                              temperature=1.0),
    )  # fmt: skip
    handle = start_or_join(ClusterConfig(num_cpus=8, include_dashboard=False), quiet=True)
    try:
        driver = AsyncDriver(job, tmp_path, progress=False)
        try:
            history = driver.run()
        finally:
            driver.close()
    finally:
        shutdown(handle)
    assert [int(r["step"]) for r in history] == [1, 2]
    assert all(r["feature_routing_replay"] == 1.0 and r["same_version_tokens"] > 0 for r in history)
    assert all(r["same_version_abs_dlogp"] < 1e-3 for r in history), history
