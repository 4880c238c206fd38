"""The batched Muon and foreach AdamW steps of rl/optim.py against DeepSpeed's per-tensor updates
(`muon_update`, `adam_update`), kept here as the reference: matrices of several shapes in one family
(wide, tall, square, one row), per-head projections next to whole matrices of the same block shape, a
matrix without a gradient, weight decay, a resume from the optimiser's state dict half-way, and
non-finite gradients confined to their own matrix.

Tolerance: with Newton-Schulz in fp32 (every CPU is made to take that path, `_ns_dtype`) the two
runs take the same iterates, differing only in rounding: one baddbmm (one rounding) where DeepSpeed
rounds b·A, c·A@A and their sum separately, and bmm over the stack instead of one mm per matrix (another
summation order). Measured, the updates (entries up to ~0.5) then differ by ~1.5e-6; we allow 1e-4 per
entry (x lr on the weights), still far below what a semantic slip moves (a wrong scale, head split,
transposition or momentum blend changes entries by 1e-2 or more). Momentum buffers are the same
elementwise lerps of the same gradients: fp32 default tolerance. In a half-precision compute dtype the
single rounding makes the batched update closer to the fp32 iteration than DeepSpeed's own (about half
its distance, measured); the test asks for no farther.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn

from rl.config import OptimConfig
from rl.optim import FamilyOptimizer, muon_bucket_update

pytestmark = pytest.mark.numerics
torch.set_num_threads(1)

# (rows, cols, heads): buckets (12,16)x3, (16,12)x2 tall, (16,16) square, (8,16) per-head x4 and x3 and
# whole, (1,20) one row
SHAPES = [(12, 16, None)] * 3 + [(16, 12, None)] * 2 + [(16, 16, None), (32, 16, 4), (8, 16, None), (24, 16, 3),
                                                        (1, 20, None)]  # fmt: skip
UPDATE_ATOL = 1e-4


@contextlib.contextmanager
def _ns_dtype(fp16: bool, bf16: bool):
    """DeepSpeed's CPU accelerator reporting these half-precision supports while inside: `ns_compute_dtype`
    ("gram": fp16 where supported, "standard": bf16), read by both implementations at every step."""
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    acc.is_fp16_supported, acc.is_bf16_supported = (lambda: fp16), (lambda: bf16)  # instance attributes shadow
    try:
        yield
    finally:
        del acc.is_fp16_supported, acc.is_bf16_supported


def _reference_muon_step(params, heads, bufs, cfg: OptimConfig, lr: float) -> None:
    """The per-matrix path the batched one replaced: DeepSpeed's `muon_update`, one call per matrix."""
    from deepspeed.runtime.zero.muon.original_muon import muon_update

    for p, h, buf in zip(params, heads, bufs):
        if p.grad is None:
            continue
        with torch.compiler.set_stance("force_eager"):
            u = muon_update(p.grad.clone(), buf, beta=cfg.momentum, ns_steps=cfg.ns_steps, ns_method=cfg.ns_method,
                            num_heads=h)  # fmt: skip
        p.mul_(1 - lr * cfg.weight_decay)
        p.add_(u.reshape(p.shape).to(p.dtype), alpha=-lr)


def _muon_pair(cfg: OptimConfig, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ours = [nn.Parameter(torch.randn(r, c, generator=g) * 0.1) for r, c, _ in SHAPES]
    ref = [nn.Parameter(p.detach().clone()) for p in ours]
    heads = [h for _, _, h in SHAPES]
    opt = FamilyOptimizer({"muon": [(f"m{i}.weight", p) for i, p in enumerate(ours)]}, cfg)
    opt.param_groups[0]["num_heads"] = list(heads)
    return opt, ours, ref, heads, g


@pytest.mark.parametrize("method", ["gram", "standard"])
def test_batched_muon_equals_deepspeeds_per_matrix_update_and_resumes(method):
    cfg = OptimConfig(muon_lr=0.05, weight_decay=0.1, ns_method=method)
    opt, ours, ref, heads, g = _muon_pair(cfg)
    ref_bufs = [torch.zeros_like(p) for p in ref]
    with torch.no_grad(), _ns_dtype(fp16=False, bf16=False):
        for step in range(4):
            for i, (p, q) in enumerate(zip(ours, ref)):
                grad = None if (step == 1 and i == 4) else torch.randn(p.shape, generator=g)
                p.grad, q.grad = grad, None if grad is None else grad.clone()
            if step == 2:  # resume: a fresh optimiser from the saved state (as if read from disk)
                state = copy.deepcopy(opt.state_dict())
                opt = FamilyOptimizer({"muon": [(f"m{i}.weight", p) for i, p in enumerate(ours)]}, cfg)
                opt.load_state_dict(state)
                assert opt.param_groups[0]["num_heads"] == heads
            before = [p.detach().clone() for p in ours]
            opt.step()
            _reference_muon_step(ref, heads, ref_bufs, cfg, cfg.muon_lr)
            for i, (p, q, buf) in enumerate(zip(ours, ref, ref_bufs)):
                torch.testing.assert_close(p, q, rtol=0, atol=cfg.muon_lr * UPDATE_ATOL, msg=f"step {step} m{i}")
                torch.testing.assert_close(opt.state[p]["momentum_buffer"], buf, msg=f"step {step} m{i}")
                assert opt.state[p]["momentum_buffer"].shape == p.shape  # the per-parameter state layout
            assert torch.equal(ours[4], before[4]) if step == 1 else not torch.equal(ours[4], before[4])


def test_non_finite_gradients_stay_in_their_own_matrix():
    """A NaN in one head of a per-head matrix, an inf in one of three same-shape matrices: those two keep
    their momentum and get DeepSpeed's non-finite updates (per head: the orthogonalised blend, whose other
    heads stay finite; whole: the blend), every other matrix in their buckets updates as DeepSpeed's."""
    cfg = OptimConfig(muon_lr=0.05, ns_method="gram")
    opt, ours, ref, heads, g = _muon_pair(cfg, seed=1)
    ref_bufs = [torch.zeros_like(p) for p in ref]
    with torch.no_grad(), _ns_dtype(fp16=False, bf16=False):
        for p, q in zip(ours, ref):
            p.grad = torch.randn(p.shape, generator=g)
            q.grad = p.grad.clone()
        ours[6].grad[9, 3] = ref[6].grad[9, 3] = float("nan")  # head 1 of the per-head (32,16)
        ours[1].grad[0, 0] = ref[1].grad[0, 0] = float("inf")  # one of the three (12,16)
        opt.step()
        _reference_muon_step(ref, heads, ref_bufs, cfg, cfg.muon_lr)
    assert ours[6].view(4, 8, 16)[[0, 2, 3]].isfinite().all() and not ours[6].view(4, 8, 16)[1].isfinite().any()
    for i, (p, q, buf) in enumerate(zip(ours, ref, ref_bufs)):
        finite = i not in (1, 6)
        assert bool(p.isfinite().all()) == finite, i
        torch.testing.assert_close(p, q, rtol=0, atol=cfg.muon_lr * UPDATE_ATOL, equal_nan=True, msg=f"m{i}")
        torch.testing.assert_close(opt.state[p]["momentum_buffer"], buf, msg=f"m{i}")
        if not finite:  # the momentum of a non-finite step is kept (here: still zero)
            assert not opt.state[p]["momentum_buffer"].any()


@pytest.mark.parametrize("method,fp16,bf16", [("gram", True, False), ("standard", False, True)])
def test_half_precision_newton_schulz_is_no_farther_from_fp32_than_deepspeeds(method, fp16, bf16):
    """In fp16 ("gram") or bf16 ("standard") the two differ by half-precision rounding; the batched update
    must be at least as close to the fp32 iteration as DeepSpeed's own half-precision run."""
    g = torch.Generator().manual_seed(2)
    for rows, cols, heads in [(64, 128, None), (128, 64, None), (64, 64, None), (128, 32, 4)]:
        grads = [torch.randn(rows, cols, generator=g) for _ in range(4)]
        moms = [torch.randn(rows, cols, generator=g) * 0.1 for _ in range(4)]
        with _ns_dtype(fp16=False, bf16=False):
            exact = _deepspeed_updates(grads, moms, method, heads)
        with _ns_dtype(fp16=fp16, bf16=bf16):
            ds, ours = _deepspeed_updates(grads, moms, method, heads), _batched_updates(grads, moms, method, heads)
        ds_err, our_err = (ds - exact).norm() / exact.norm(), (ours - exact).norm() / exact.norm()
        assert 0 < ds_err < 0.1 and our_err <= ds_err, (rows, cols, heads, float(our_err), float(ds_err))


def _deepspeed_updates(grads, moms, method: str, heads: int | None) -> torch.Tensor:
    from deepspeed.runtime.zero.muon.original_muon import muon_update

    with torch.compiler.set_stance("force_eager"):
        return torch.stack([
            muon_update(x.clone(), m.clone(), beta=0.95, ns_steps=5, ns_method=method, num_heads=heads)
            for x, m in zip(grads, moms)
        ])  # fmt: skip


def _batched_updates(grads, moms, method: str, heads: int | None) -> torch.Tensor:
    rows, cols = grads[0].shape
    r = rows // (heads or 1)
    G = torch.cat([x.reshape(-1, r, cols) for x in grads])
    M = torch.cat([m.reshape(-1, r, cols) for m in moms])
    finite = torch.ones(G.size(0), dtype=torch.bool)
    return muon_bucket_update(G, M, finite, 0.95, 5, method, heads is not None)[1].reshape(len(grads), rows, cols)


def test_foreach_adamw_equals_deepspeeds_adam_update_per_tensor():
    """Tensors of several shapes; one lacks a gradient for a step, so the family holds two step counts."""
    from deepspeed.runtime.zero.muon.original_muon import adam_update

    cfg = OptimConfig(lr=1e-2, weight_decay=0.1)
    g = torch.Generator().manual_seed(3)
    ours = [nn.Parameter(torch.randn(s, generator=g)) for s in [(8,), (3,), (2, 5), (), (7,)]]
    ref = [nn.Parameter(p.detach().clone()) for p in ours]
    opt = FamilyOptimizer({"adamw": [(f"a{i}", p) for i, p in enumerate(ours)]}, cfg)
    ref_state = [{"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p), "step": 0} for p in ref]
    with torch.no_grad():
        for step in range(4):
            for i, (p, q) in enumerate(zip(ours, ref)):
                grad = None if (step == 1 and i == 2) else torch.randn(p.shape, generator=g)
                p.grad, q.grad = grad, None if grad is None else grad.clone()
            opt.step()
            for q, st in zip(ref, ref_state):
                if q.grad is None:
                    continue
                st["step"] += 1
                u = adam_update(q.grad, st["exp_avg"], st["exp_avg_sq"], st["step"], (cfg.beta1, cfg.beta2), cfg.eps)
                q.mul_(1 - cfg.lr * cfg.weight_decay)
                q.add_(u, alpha=-cfg.lr)
            for i, (p, q, st) in enumerate(zip(ours, ref, ref_state)):
                torch.testing.assert_close(p, q, msg=f"step {step} a{i}")
                assert opt.state[p]["step"] == st["step"]
                torch.testing.assert_close(opt.state[p]["exp_avg_sq"], st["exp_avg_sq"])
    assert sorted(opt.state[p]["step"] for p in ours) == [3, 4, 4, 4, 4]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("method", ["gram", "standard"])
def test_compiled_muon_on_cuda_equals_the_eager_steps(method):
    """Off the CPU `compile_muon` (the default) runs each bucket through torch.compile: the same steps as
    eager within the rounding of a fused half-precision Newton-Schulz, and the same momentum (fp32 lerps).
    Tolerance: in bf16 ("standard" on an H200) DeepSpeed's own muon_update, compiled against eager, moves
    an update's entries (up to ~0.75) by 0.03 (measured); over three steps we allow 0.1 x lr per entry, a
    fifth of an update, where a wrong scale, head split or transposition moves entries by the whole update."""
    runs = []
    for compiled in (False, True):
        cfg = OptimConfig(muon_lr=0.05, weight_decay=0.1, ns_method=method, compile_muon=compiled)
        opt, ours, _, _, g = _muon_pair(cfg)
        for p in ours:
            p.data = p.data.cuda()
        opt = FamilyOptimizer({"muon": [(f"m{i}.weight", p) for i, p in enumerate(ours)]}, cfg)
        opt.param_groups[0]["num_heads"] = [h for _, _, h in SHAPES]
        with torch.no_grad():
            for _ in range(3):
                for p in ours:
                    p.grad = torch.randn(p.shape, generator=g).cuda()
                opt.step()
        runs.append((ours, opt))
    (eager, opt_e), (comp, opt_c) = runs
    for i, (p, q) in enumerate(zip(eager, comp)):
        torch.testing.assert_close(q, p, rtol=0, atol=0.05 * 0.1, msg=lambda m, i=i: f"m{i}: {m}")
        torch.testing.assert_close(opt_c.state[q]["momentum_buffer"], opt_e.state[p]["momentum_buffer"],
                                   msg=lambda m, i=i: f"m{i}: {m}")  # fmt: skip
