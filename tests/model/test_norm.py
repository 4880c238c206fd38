"""RMSNorm numerics (spec §3.0)."""

import torch

from model.norm import RMSNorm, rms_norm


def test_matches_formula_in_fp32():
    norm = RMSNorm(64, eps=1e-20)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 2.0, 64))
    x = torch.randn(3, 5, 64) * 7
    expected = x / x.pow(2).mean(-1, keepdim=True).sqrt() * norm.weight
    assert torch.allclose(norm(x), expected, rtol=1e-5, atol=1e-6)
    assert [n for n, _ in norm.named_parameters()] == ["weight"]


def test_bf16_in_bf16_out_with_fp32_statistics():
    x = (torch.randn(4, 256) * 1e3).to(torch.bfloat16)
    y = RMSNorm(256, eps=1e-20).to(torch.bfloat16)(x)
    assert y.dtype == torch.bfloat16
    ref = (x.float() * torch.rsqrt(x.float().square().mean(-1, keepdim=True))).to(torch.bfloat16)
    assert torch.equal(y, ref)
    # unit RMS after normalisation (up to bf16 rounding)
    assert torch.allclose(y.float().square().mean(-1), torch.ones(4), rtol=1e-2)


def test_eps_matters_only_for_tiny_inputs():
    x = torch.full((1, 8), 1e-4)
    assert torch.allclose(rms_norm(x, torch.ones(8), 1e-20), torch.ones(1, 8))
    assert rms_norm(x, torch.ones(8), 1e-6).max() < 0.1  # eps 1e-6 dominates mean(x²) = 1e-8


def test_gradients_reach_input_and_weight():
    norm = RMSNorm(16, eps=1e-20)
    x = torch.randn(2, 16, requires_grad=True)
    norm(x).sum().backward()
    assert x.grad is not None and norm.weight.grad is not None
    assert torch.isfinite(x.grad).all() and norm.weight.grad.abs().sum() > 0
