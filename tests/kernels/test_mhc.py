"""Parity of the fused Single-Pass mHC kernels (kernels/mhc.py) with the model/mhc.py references.

The new streams and the sub-layer input are bit-exact (same fp32 op order, no FMA contraction);
the coefficients (a reduction over 4·D, then 20 Sinkhorn passes) and all gradients are compared
with tolerances. CPU runs use TRITON_INTERPRET=1 (set in tests/kernels/conftest.py); `-m gpu` on CUDA.
"""

import pytest
import torch

from kernels import mhc as km
from model.mhc import init_hc_params

EPS = {"norm_eps": 1e-20, "hc_eps": 1e-6}


def _close(a: torch.Tensor, b: torch.Tensor, rel: float) -> None:
    """max |a - b| <= rel · max |b| (+ a tiny floor), a tolerance that scales with the tensor."""
    a, b = a.double(), b.double()
    err = (a - b).abs().max().item()
    assert err <= rel * b.abs().max().item() + 1e-6, f"max err {err} vs max {b.abs().max().item()}"


def _boundary_inputs(T, D, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    p = init_hc_params(D, 4, generator=g)
    scale = p["scale"] * 10  # spread the coefficients beyond the near-identity init
    fn = p["fn"] + 0.02 * torch.randn(p["fn"].shape, generator=g)
    f = torch.randn(T, D, generator=g).to(dtype)
    res = torch.randn(T, 4, D, generator=g).to(dtype)
    post = 2 * torch.rand(T, 4, generator=g)
    comb = torch.rand(T, 4, 4, generator=g)
    pc = torch.rand(T, 4, generator=g)
    ts = [f, res, post, comb, pc, fn, scale, p["base"]]
    return [t.to(device).requires_grad_() for t in ts]


@pytest.mark.parametrize("lead", [(5,), (2, 7)])
def test_split_sinkhorn(device, lead):
    g = torch.Generator().manual_seed(0)
    mixes = (3 * torch.randn(*lead, 24, generator=g)).to(device).requires_grad_()
    scale = torch.rand(3, generator=g).add(0.5).to(device).requires_grad_()
    base = torch.randn(24, generator=g).to(device).requires_grad_()
    out = km.hc_split_sinkhorn(mixes, scale, base, 4, 20, 1e-6)
    ref = km.hc_split_sinkhorn_ref(mixes, scale, base, 4, 20, 1e-6)
    for a, b in zip(out, ref):
        assert a.shape == b.shape
        _close(a, b, 1e-5)
    gs = [torch.randn(o.shape, generator=g).to(device) for o in out]
    for a, b in zip(
        torch.autograd.grad(out, [mixes, scale, base], gs), torch.autograd.grad(ref, [mixes, scale, base], gs)
    ):
        _close(a, b, 1e-4)


@pytest.mark.parametrize("dtype,T,D", [(torch.float32, 37, 96), (torch.bfloat16, 19, 64), (torch.bfloat16, 3, 160)])
def test_post_mixes_pre(device, dtype, T, D):
    ins = _boundary_inputs(T, D, dtype, device)
    out = km.hc_post_mixes_pre(*ins, **EPS)
    ref = km.hc_post_mixes_pre_ref(*ins, **EPS)
    x_new, x_in = out[:2]
    assert x_new.dtype == x_in.dtype == dtype
    assert torch.equal(x_new, ref[0]) and torch.equal(x_in, ref[1])
    for a, b in zip(out[2:], ref[2:]):
        _close(a, b, 1e-4)
    g = torch.Generator().manual_seed(1)
    gs = [torch.randn(o.shape, generator=g).to(o.dtype).to(device) for o in out]
    grads = torch.autograd.grad(out, ins, gs)
    grads_ref = torch.autograd.grad(ref, ins, gs)
    # fp32 streams: both sides accumulate in fp32; bf16: the reference rounds its stream grads to bf16
    rel = 1e-4 if dtype == torch.float32 else 3e-2
    for a, b in zip(grads, grads_ref):
        assert a.shape == b.shape and a.dtype == b.dtype
        _close(a, b, rel)


def test_launchers_reject_bad_inputs(device):
    f, res, post, comb, pc, fn, scale, base = _boundary_inputs(6, 32, torch.float32, device)
    with pytest.raises(ValueError, match="4 streams"):
        km.hc_post_mixes_pre(f, res[:, :3], post, comb, pc, fn, scale, base, **EPS)
    with pytest.raises(ValueError, match="hc fn"):
        km.hc_post_mixes_pre(f, res, post, comb, pc, fn[:, :64], scale, base, **EPS)
    with pytest.raises(ValueError, match="residual streams"):
        km.hc_mixes_pre(res[:, :2], pc, fn, scale, base, **EPS)
    with pytest.raises(ValueError, match="hc_mult 4"):
        km.hc_split_sinkhorn(torch.zeros(3, 24, device=device), scale, base, hc_mult=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixes_pre_first_boundary(device, dtype):
    f, res, post, comb, pc, fn, scale, base = _boundary_inputs(21, 64, dtype, device)
    ins = [res, pc, fn, scale, base]
    out = km.hc_mixes_pre(*ins, **EPS)
    ref = km.hc_mixes_pre_ref(*ins, **EPS)
    assert torch.equal(out[0], ref[0])
    for a, b in zip(out[1:], ref[1:]):
        _close(a, b, 1e-4)
    g = torch.Generator().manual_seed(2)
    gs = [torch.randn(o.shape, generator=g).to(o.dtype).to(device) for o in out]
    rel = 1e-4 if dtype == torch.float32 else 3e-2
    for a, b in zip(torch.autograd.grad(out, ins, gs), torch.autograd.grad(ref, ins, gs)):
        _close(a, b, rel)


def test_partial_grads(device):
    """Only some outputs used (the others' grads materialise as zeros)."""
    ins = _boundary_inputs(9, 64, torch.float32, device)
    out = km.hc_post_mixes_pre(*ins, **EPS)
    ref = km.hc_post_mixes_pre_ref(*ins, **EPS)
    loss, loss_ref = out[1].square().sum() + out[3].sum(), ref[1].square().sum() + ref[3].sum()
    for a, b in zip(torch.autograd.grad(loss, ins), torch.autograd.grad(loss_ref, ins)):
        _close(a, b, 1e-4)
