"""Data-parallel learner on CPU: 2 gloo processes, each taking its share of a global batch, give the same
per-step losses and updated weights as 1 process taking the whole batch (DeepSpeed engine of
rl/learner.py, `debug` model without Engram tables, which ZeRO refuses), for ZeRO stages 0, 1 and 2,
and both replicas end with the same weights. Micro-batches split unevenly (rank 0 gets two, rank 1
one) and, in one case, not at all (rank 1 gets none): ZeRO-2 reduces in every backward pass, so every
rank must make as many, touching the same parameters in the same order (rl/learner.py `_backward`).
A ZeRO-2 checkpoint written by both ranks (each its optimizer partition) resumes the next step exactly.

Tolerance: both runs compute the same fp32 sums in another order (per-rank partial sums, then a gloo
all-reduce, versus one accumulation over all micro-batches), ~1e-7 relative per sum. Over 3 Muon/AdamW
steps that stays below ~3e-8 relative on the losses (we allow 1e-5) and ~1e-6 on the weights at ZeRO
1/2, ~5e-5 at stage 0 where each Muon matrix is orthogonalised whole in fp32 (we allow 1e-3 x muon_lr
per step). Engram tables (stage 0) are left to tests/rl/test_learner.py: their Sinkhorn rows amplify
reordering so much that even one process with its micro-batches reordered drifts by ~1e-2 in 3 steps.
QAT is off for the same reason: a reordered sum that lands a weight on the other side of an FP4
rounding boundary moves its fake-quantised value by a whole step (on an AMD EPYC host the stage-0
run's indexer weights drifted 1.9e-3 in 3 steps with QAT on, 1.6e-6 with it off). Newton-Schulz runs
in fp32 for the same reason: DeepSpeed's "gram" iteration picks fp16 wherever oneDNN reports fp16
support (Sapphire Rapids and later Xeons: `ns_compute_dtype`), fp32 elsewhere, and in fp16 the ~1e-7
reordering differences of the gradient become whole fp16 steps (eps 9.8e-4) of the update: on such a
host the stage-0 experts drifted 2.6e-4 after one step and 4e-3 after three, the losses 2.1e-4
relative. `_fp32_newton_schulz` makes every CPU take the fp32 path this tolerance is derived for; the
test is about data parallelism, not the iteration's precision. The resume case keeps QAT and the
host's Newton-Schulz dtype: one process and its checkpoint take the same sums in the same order.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
from pathlib import Path

import pytest
import torch

from model.config import get_flavor
from model.transformer import Transformer
from rl.config import OptimConfig, TrainerConfig
from rl.payloads import Trajectory, pack_trajectories

pytestmark = pytest.mark.slow

STEPS = 3
OPTIM = OptimConfig(lr=3e-3, sinkhorn_lr=3e-3, muon_lr=0.02)
# name -> (ZeRO stage, documents): 6 documents = 3 micro-batches (2 + 1), 2 = 1 micro-batch (1 + 0)
CASES = {
    "zero0": (0, 6),
    "zero1": (1, 6),
    "zero2": (2, 6),
    "zero2_idle_rank": (2, 2),
}


def _global_batch(vocab: int, n_docs: int):
    """`n_docs` documents of 16 tokens (6 prompt, 10 generated), two to a micro-batch of 32 tokens."""
    g = torch.Generator().manual_seed(5)
    trajs = [
        Trajectory(token_ids=torch.randint(32, vocab, (16,), generator=g).tolist(),
                   loss_mask=[False] * 6 + [True] * 10, logprobs=[math.nan] * 6 + [-3.0] * 10,
                   versions=[-1] * 6 + [0] * 10, turn_starts=[6])
        for _ in range(n_docs)
    ]  # fmt: skip
    return pack_trajectories(trajs, max_tokens=32)


@contextlib.contextmanager
def _fp32_newton_schulz():
    """DeepSpeed's CPU accelerator reporting no fp16 support while inside: `ns_compute_dtype("gram")`, read at
    every Muon step, is then fp32 on every CPU (see the module docstring)."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.zero.muon.original_muon import ns_compute_dtype

    acc = get_accelerator()
    acc.is_fp16_supported = lambda: False  # an instance attribute shadows the method
    try:
        assert ns_compute_dtype("gram") == torch.float32
        yield
    finally:
        del acc.is_fp16_supported


def train(case: str, rank: int, world: int) -> dict:
    """STEPS updates of this rank's share (micro-batches i % world == rank) -> losses and weights."""
    from rl.learner import Learner

    stage, n_docs = CASES[case]
    model = Transformer(get_flavor("debug", engram_layer_ids=(), qat=False))
    model.init_weights(seed=0)
    batches = _global_batch(model.args.vocab_size, n_docs)
    mine = [b for i, b in enumerate(batches) if i % world == rank]
    learner = Learner(model, TrainerConfig(kind="sft", zero_stage=stage, optim=OPTIM))
    # DeepSpeed compiles Newton-Schulz: seconds per shape on CPU
    with torch.compiler.set_stance("force_eager"), _fp32_newton_schulz():
        losses = [learner.train_step(mine, "sft")["loss"] for _ in range(STEPS)]
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"losses": losses, "weights": weights}


def resume(rank: int, world: int, root: Path) -> dict:
    """ZeRO-2 at `world` ranks: 2 steps, save (every rank its partition), 1 more step; then a learner from
    another init loads the checkpoint and takes that step again."""
    from rl.learner import Learner

    def make(seed: int) -> Learner:
        model = Transformer(get_flavor("debug", engram_layer_ids=()))
        model.init_weights(seed=seed)
        return Learner(model, TrainerConfig(kind="sft", zero_stage=2, optim=OPTIM))

    mine = [b for i, b in enumerate(_global_batch(get_flavor("debug").vocab_size, 6)) if i % world == rank]
    with torch.compiler.set_stance("force_eager"):
        a = make(0)
        for _ in range(2):
            a.train_step(mine, "sft")
        path = a.save(root)
        expected = a.train_step(mine, "sft")["loss"]
        b = make(7)
        b.load(root)
        return {"expected": expected, "got": b.train_step(mine, "sft")["loss"], "files": sorted(os.listdir(path))}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, ranks_launcher) -> dict:
    """{case: (rank 0's results, rank 1's)} of the 2-process run, every case in one launch (imports and
    DeepSpeed's set-up cost more than the steps)."""
    out = tmp_path_factory.mktemp("dp")
    ranks_launcher(__file__, 2, [str(out)], timeout_s=500, OMP_NUM_THREADS="1")  # minutes on a loaded machine
    ranks = [torch.load(out / f"rank{r}.pt") for r in range(2)]
    return {case: (ranks[0][case], ranks[1][case]) for case in [*CASES, "resume"]}


@pytest.mark.parametrize("case", CASES)
def test_two_gloo_ranks_equal_one_process(two_ranks, case):
    torch.set_num_threads(1)
    one, (two, replica) = train(case, rank=0, world=1), two_ranks[case]
    drift = max(float((two["weights"][k] - w).abs().max()) for k, w in one["weights"].items())
    print(f"{case}: 1 process {one['losses']}, 2 processes {two['losses']}, max |dw| {drift:.2e}")
    assert one["losses"][-1] < one["losses"][0]
    torch.testing.assert_close(torch.tensor(two["losses"]), torch.tensor(one["losses"]), rtol=1e-5, atol=0)
    assert set(one["weights"]) == set(two["weights"])
    for name, w in one["weights"].items():
        torch.testing.assert_close(two["weights"][name], w, rtol=0, atol=1e-3 * OPTIM.muon_lr * STEPS, msg=name)
        assert torch.equal(replica["weights"][name], two["weights"][name]), f"replicas differ in {name}"


def test_two_rank_zero2_checkpoint_resumes_exactly(two_ranks):
    for r in two_ranks["resume"]:
        assert r["got"] == r["expected"]
    assert "optimizer-rank1.pt" in two_ranks["resume"][0]["files"]


if __name__ == "__main__":  # one rank of the 2-process run: every case in turn
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    results = {case: train(case, rank, world) for case in CASES}
    results["resume"] = resume(rank, world, Path(sys.argv[1]) / "ckpt")
    torch.save(results, Path(sys.argv[1]) / f"rank{rank}.pt")
