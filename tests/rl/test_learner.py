"""The DeepSpeed learner on the `debug` model (CPU, gloo, one process): SFT loss falls on a fixed batch,
checkpoint -> resume reproduces the following steps exactly, RL and OPD steps run end to end; a CPU
learner adds index gradients in a fixed order."""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer as Backend
from tokenizers import models

from model.config import get_flavor
from model.engram import EngramHasher
from model.transformer import Transformer
from rl.config import OptimConfig, TrainerConfig
from rl.learner import Learner, TeacherOutput
from rl.payloads import Trajectory, pack_trajectories

torch.set_num_threads(1)

ARGS = get_flavor("debug")


def _model(seed: int) -> Transformer:
    vocab = {f"<t{i}>": i for i in range(ARGS.vocab_size)}
    hasher = EngramHasher(ARGS, Backend(models.WordLevel(vocab, unk_token="<t0>")))
    m = Transformer(ARGS, engram_hasher=hasher)
    m.init_weights(seed=seed)
    return m


def _batches(n_traj: int = 2, n_prompt: int = 6, n_gen: int = 10, seed: int = 0, max_tokens: int | None = None):
    g = torch.Generator().manual_seed(seed)
    trajs = []
    for _ in range(n_traj):
        T = n_prompt + n_gen
        trajs.append(
            Trajectory(
                token_ids=torch.randint(32, ARGS.vocab_size, (T,), generator=g).tolist(),
                loss_mask=[False] * n_prompt + [True] * n_gen,
                logprobs=[math.nan] * n_prompt + (-torch.rand(n_gen, generator=g) * 4 - 2).tolist(),
                versions=[-1] * n_prompt + [0] * n_gen,
                turn_starts=[n_prompt],
            )
        )
    adv = [1.0 if i % 2 else -1.0 for i in range(n_traj)]
    return pack_trajectories(trajs, max_tokens=max_tokens or n_traj * (n_prompt + n_gen), advantages=adv)


def _cfg() -> TrainerConfig:
    return TrainerConfig(kind="sft", optim=OptimConfig(lr=3e-3, sinkhorn_lr=3e-3, muon_lr=0.02))


def test_sft_loss_falls_on_a_fixed_batch():
    learner = Learner(_model(0), _cfg())
    batch = _batches()
    table = learner.model.layers[0].engram.embed.weight
    before = table.detach().clone()
    losses = [learner.train_step(batch, "sft")["loss"] for _ in range(20)]
    assert losses[-1] < 0.5 * losses[0], losses
    assert learner.step == 20
    changed = int((table.detach() != before).any(dim=1).sum())
    assert 0 < changed < table.size(0), "Engram: only rows the batch hashed to may move"


def test_a_cpu_learner_adds_index_gradients_in_a_fixed_order():
    """The backward of advanced indexing (index_put_ with accumulate) adds into fp32 with parallel atomics
    on CPU unless deterministic algorithms are on: a million values into four rows from 2 threads gave 30
    different sums in 30 repeats when measured. A CPU learner turns that mode on for its process, so one
    batch gives the same gradients on a loaded machine as on a quiet one."""
    Learner(_model(0), _cfg())
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the parallel kernel needs two threads; the test file runs on one
    try:
        g = torch.Generator().manual_seed(0)
        values, rows = torch.randn(1 << 20, generator=g), torch.randint(0, 4, (1 << 20,), generator=g)
        sums = {tuple(torch.zeros(4).index_put_((rows,), values, accumulate=True).tolist()) for _ in range(10)}
    finally:
        torch.set_num_threads(threads)
    assert len(sums) == 1, f"{len(sums)} different sums of the same values"
    assert torch.are_deterministic_algorithms_enabled()


def test_checkpoint_resume_reproduces_the_next_steps_exactly(tmp_path):
    batch = _batches(seed=1)
    a = Learner(_model(0), _cfg())
    for _ in range(2):
        a.train_step(batch, "sft")
    path = a.save(tmp_path)
    assert (tmp_path / "latest").read_text() == path.name and not list(tmp_path.glob(".tmp*"))
    expected = [a.train_step(batch, "sft")["loss"] for _ in range(2)]
    b = Learner(_model(7), _cfg())  # different init: everything must come from the checkpoint
    b.load(tmp_path)
    assert b.step == 2
    got = [b.train_step(batch, "sft")["loss"] for _ in range(2)]
    assert got == expected


def test_rl_and_opd_steps_run_and_report(tmp_path):
    learner = Learner(_model(0), _cfg())
    batches = _batches(seed=2)
    for b in batches:
        b.old_logprobs = learner.logprobs(b)
    m = learner.train_step(batches, "rl")
    assert m["n_tokens"] == 20 and 0 <= m["clip_frac"] <= 1 and math.isfinite(m["loss"])
    assert m["mismatch_k3"] > 0  # the synthetic rollout log-probs differ from the learner's
    assert abs(m["ratio_mean"] - 1.0) < 1e-5, "train-mode forward must equal the π_prox forward"
    assert m["version_lag_mean"] == 0.0
    teacher = _model(3)
    with torch.no_grad():
        t_out = teacher(batches[0].input_ids, batches[0].doc_ids, compute_indexer_loss=False)
        s_logits = learner.model(batches[0].input_ids, batches[0].doc_ids, compute_indexer_loss=False).logits
    logp, logq = s_logits[:, :-1].log_softmax(-1), t_out.logits[:, :-1].log_softmax(-1)
    direct = (logp.exp() * (logp - logq)).sum(-1)[batches[0].loss_mask[:, 1:]].mean()
    first = learner.train_step(batches, "opd", extras=[TeacherOutput(hidden=t_out.hidden, head=teacher.head.weight)])
    assert abs(first["loss"] - float(direct)) < 1e-4 * float(direct)
    again = learner.train_step(batches, "opd", extras=[TeacherOutput(logits=t_out.logits)])
    assert first["loss"] > 0 and again["loss"] < first["loss"]


def test_zero_refuses_stage_3_and_sparse_engram_tables():
    with pytest.raises(ValueError, match="zero_stage=3"):
        Learner(_model(0), TrainerConfig(zero_stage=3))
    with pytest.raises(ValueError, match="sparse-gradient tables"):
        Learner(_model(0), TrainerConfig(zero_stage=1))


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_learner_trains_and_resumes_exactly(tmp_path, stage):
    """ZeRO 1/2 with DeepSpeed's MuonWithAuxAdam on a debug model without Engram layers: the loss falls
    and a checkpoint (weights + partitioned optimizer state) reproduces the next step exactly."""
    args = get_flavor("debug", engram_layer_ids=())

    def make(seed):
        m = Transformer(args)
        m.init_weights(seed=seed)
        return Learner(m, TrainerConfig(kind="sft", zero_stage=stage, optim=OptimConfig(lr=3e-3, muon_lr=0.02)))

    batch = _batches(seed=1)
    a = make(0)
    with torch.compiler.set_stance("force_eager"):  # DeepSpeed compiles Newton-Schulz: seconds per shape on CPU
        losses = [a.train_step(batch, "sft")["loss"] for _ in range(3)]
        assert losses[-1] < losses[0], losses
        a.save(tmp_path)
        expected = a.train_step(batch, "sft")["loss"]
        b = make(7)
        b.load(tmp_path)
        assert b.train_step(batch, "sft")["loss"] == expected


def _grads_worker(world: int, out: Path) -> None:
    """Run as a subprocess (one per rank): this rank's share of 4 documents, gradients to `out`."""
    rank = int(os.environ["RANK"])
    learner = Learner(_model(0), _cfg())
    batches = _batches(n_traj=4, seed=5, max_tokens=32)  # two rows of two documents
    mine = [b for i, b in enumerate(batches) if i % world == rank]
    metrics, _ = learner.accumulate_grads(mine, "sft")
    if rank == 0:
        grads = {n: p.grad.to_dense() for n, p in learner.model.named_parameters() if p.grad is not None}
        torch.save({"grads": grads, "loss": metrics["loss"]}, out)


@pytest.mark.slow
def test_global_token_denominator_makes_two_ranks_equal_one(tmp_path, ranks_launcher):
    """2 gloo ranks with one micro-batch each == 1 rank with both: the loss is a global token-mean."""
    for world in (1, 2):
        ranks_launcher(__file__, world, [str(world), str(tmp_path / f"{world}.pt")], timeout_s=300)
    one, two = torch.load(tmp_path / "1.pt"), torch.load(tmp_path / "2.pt")
    assert abs(one["loss"] - two["loss"]) < 1e-6
    assert set(one["grads"]) == set(two["grads"])
    for name, g in one["grads"].items():
        torch.testing.assert_close(two["grads"][name], g, atol=1e-6 * float(g.abs().max()) + 1e-9, rtol=0)


if __name__ == "__main__":
    _grads_worker(int(sys.argv[1]), Path(sys.argv[2]))
