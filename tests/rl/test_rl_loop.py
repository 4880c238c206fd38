"""The asynchronous RL/OPD drivers and the SFT driver on real Ray actors and a real DeepSpeed learner
(debug model with the default tokenizer's vocabulary, toy task family, CPU): a killed rollout worker
loses no trajectory, stop + resume reproduces the next loss exactly and trains every group once
(in-flight groups re-issued exactly once), no trained token lags more than max_policy_lag, SFT loss
falls on demonstrations, OPD lowers the reverse KL to its teacher."""

from __future__ import annotations

import os
import signal

import pytest

from rl.cluster import ClusterConfig, shutdown, start_or_join
from rl.config import JobConfig, ModelChoice, OptimConfig, RolloutConfig, TrainerConfig
from rl.rl_loop import AsyncDriver, Hooks, run_async
from rl.sft_loop import run_supervised
from synth.taskset_sources import toy_set

pytestmark = pytest.mark.ray

DEBUG = ModelChoice(flavor="debug", overrides={"vocab_size": 4096, "engram_compressed_vocab_size": 2742,
                                               "max_seq_len": 256})  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def ray_local():
    handle = start_or_join(ClusterConfig(num_cpus=8, include_dashboard=False), quiet=True)
    yield handle
    shutdown(handle)


def _job(kind: str, steps: int, lag: int, workers: int = 1, lr: float = 1e-3, **rollout) -> JobConfig:
    optim = OptimConfig(lr=lr, sinkhorn_lr=lr, muon_lr=lr * 10)
    return JobConfig(
        model=DEBUG, tasks=str(toy_set(4, 2, heldout_share=0.0)),
        trainer=TrainerConfig(kind=kind, max_steps=steps, micro_batch_tokens=256, global_batch_tokens=256,
                              checkpoint_every=2, optim=optim, batch_size=4),
        rollout=RolloutConfig(**{"n_workers": workers, "group_size": 3, "groups_per_step": 2, "max_policy_lag": lag,
                                 "max_new_tokens": 6, "max_turns": 2, "temperature": 1.0, **rollout}),
    )  # fmt: skip


def _accounted(driver: AsyncDriver) -> None:
    """Every started group is trained exactly once, or still buffered or in flight: none lost, none twice."""
    started = {f"g{g:06d}" for g in range(driver.next_group)}
    trained = driver.trained
    assert len(trained) == len(set(trained)), "a group was trained twice"
    pending = {k for _, k, _ in driver.buffer.ready} | set(driver.buffer.in_flight)
    assert set(trained) | pending == started and not set(trained) & pending


def test_killed_rollout_worker_loses_no_trajectory_and_lag_stays_bounded(tmp_path):
    import ray

    killed = {}

    def kill_worker_0(version: int, driver: AsyncDriver) -> None:
        if version == 1:
            driver.admit()  # start the groups this version allows now, so the kill hits them mid-rollout
            killed["pid"] = ray.get(driver.workers[0].pid.remote())
            killed["in_flight"] = sum(1 for _, w in driver.in_flight.values() if w == 0)
            os.kill(killed["pid"], signal.SIGKILL)

    driver = AsyncDriver(_job("rl", 3, lag=1, workers=2), tmp_path, hooks=Hooks(on_step=kill_worker_0),
                         progress=False)  # fmt: skip
    try:
        history = driver.run()
        new_pid = ray.get(driver.workers[0].pid.remote())
    finally:
        driver.close()
    assert [int(r["step"]) for r in history] == [1, 2, 3]
    assert killed["in_flight"] > 0, "the kill should hit a worker with groups in flight"
    assert new_pid != killed["pid"] and driver.n_replaced == 1
    assert len(driver.trained) == 3 * 2
    _accounted(driver)
    assert max(r["policy_lag_max"] for r in history) <= 1
    assert any(r["policy_lag_max"] == 1 for r in history[1:]), "asynchronous steps should train lagged tokens"


def test_stop_and_resume_reproduces_the_next_loss_exactly(tmp_path):
    """Synchronous (max_policy_lag 0): 3 steps straight == 2 steps, stop, resume, 1 step. Without DSpark
    speculation: its draft lengths follow a cost model measured in wall time, so a re-run samples from the
    same distribution but not the same draws (model/engine.py generate_speculative)."""
    straight = run_async(_job("rl", 3, lag=0, speculative=False), tmp_path / "a", progress=False)
    run_async(_job("rl", 2, lag=0, speculative=False), tmp_path / "b", progress=False)
    resumed = run_async(_job("rl", 3, lag=0, speculative=False), tmp_path / "b", progress=False)
    assert [int(r["step"]) for r in resumed] == [3]
    for key in ("loss", "n_tokens", "reward_mean", "mismatch_k3"):
        assert resumed[0][key] == straight[2][key], key
    assert max(r["policy_lag_max"] for r in straight) == 0
    # synchronous: every token was sampled at the learner's weights, so the mismatch is measured each step,
    # and the simulated replay (on by default, as CED prefill is) keeps it at rounding level
    assert all(r["feature_ced"] == r["feature_simulate_replay"] == r["feature_prefix_cache"] == 1.0 for r in straight)
    assert all(r["same_version_tokens"] > 0 and r["same_version_abs_dlogp"] < 1e-3 for r in straight), straight


def test_resume_reissues_in_flight_groups_exactly_once(tmp_path):
    """Asynchronous (max_policy_lag 1): the checkpoint at step 2 holds in-flight groups; the resumed run
    issues each of them once, and every group is trained once across both runs. On the plain inference
    path and a plain learner forward (full prefill, no simulated replay), where a debug rollout group takes
    longer than a learner step, so the last checkpoint catches groups in flight; with the V4.1 defaults the
    groups were already buffered by then (the relative speeds differ; what resume does with them does not)."""
    plain = dict(prefill_mode="full", prefix_cache=False, packed_cache=False, speculative=False)
    first = AsyncDriver(_job("rl", 2, lag=1, **plain), tmp_path, progress=False)
    try:
        first.run()
    finally:
        first.close()
    pending = set(first.buffer.in_flight)
    assert pending, "the checkpoint should hold in-flight groups"
    second = AsyncDriver(_job("rl", 4, lag=1, **plain), tmp_path, progress=False)
    try:
        second.run()
    finally:
        second.close()
    assert set(second.reissued_on_resume) == pending
    assert all(second.issued[k] == 1 for k in pending)
    assert second.trained[:4] == first.trained
    _accounted(second)


def test_sft_loss_falls_then_opd_lowers_reverse_kl_to_the_sft_teacher(tmp_path):
    history = run_supervised(_job("sft", 8, lag=0, lr=3e-3), tmp_path / "sft", progress=False)
    losses = [r["loss"] for r in history]
    assert sum(losses[-2:]) < 0.6 * sum(losses[:2]), losses
    assert all(r["dspark_loss"] > 0 for r in history), "the DSpark term trains along SFT"
    # the SFT'd model is the teacher; the student starts from the same random init the SFT started from
    teacher_path = tmp_path / "sft" / "checkpoints" / "step-00000008" / "model.safetensors"
    job = _job("opd", 6, lag=0, lr=3e-3, group_size=2)
    job.trainer.teacher_checkpoint = str(teacher_path)
    first_samples = []
    hooks = Hooks(on_step=lambda v, d: first_samples.extend(t for g in d.last_batch for t in g.trajectories) if v == 1
                  else None)  # fmt: skip
    run_async(job, tmp_path / "opd", progress=False, hooks=hooks)
    # reverse KL on the student's first samples, full vocabulary, before and after OPD
    before = _reverse_kl(first_samples, teacher_path, None)
    after = _reverse_kl(first_samples, teacher_path, tmp_path / "opd" / "checkpoints" / "step-00000006")
    assert after < 0.7 * before, (before, after)


def _reverse_kl(trajs, teacher_path, student_step) -> float:
    import torch

    from model.checkpoint import load_checkpoint
    from rl.actors import build_model
    from rl.losses import opd_reverse_kl
    from rl.payloads import pack_trajectories

    student, _ = build_model(DEBUG, seed=0)
    teacher, _ = build_model(DEBUG, seed=0)
    load_checkpoint(teacher, teacher_path)
    if student_step is not None:
        load_checkpoint(student, student_step / "model.safetensors")
    total, n = 0.0, 0
    with torch.no_grad():
        for b in pack_trajectories(trajs, max_tokens=256):
            s = student(b.input_ids, b.doc_ids, compute_indexer_loss=False).logits
            t = teacher(b.input_ids, b.doc_ids, compute_indexer_loss=False).logits
            _, D = opd_reverse_kl(s[:, :-1], t[:, :-1], b.loss_mask[:, 1:])
            total, n = total + float(D.sum()), n + D.numel()
    return total / n
