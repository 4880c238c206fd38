"""RoPE/YaRN tables and the interleaved rotation (spec §3.3)."""

import math
import re

import pytest
import torch

from model.config import get_flavor
from model.rope import (
    apply_rotary_emb,
    precompute_freqs_cis,
    rope_inv_freq,
    rope_tables_for_layer,
    yarn_low_high,
)

RELEASED = dict(rope_dim=64, original_seq_len=65536, base=160000.0, factor=16, beta_fast=32, beta_slow=1)


def test_released_compressed_table_yarn_bands():
    assert yarn_low_high(64, 65536, 160000.0, 32, 1) == (15, 25)
    plain = rope_inv_freq(64, 0, 160000.0, 16, 32, 1)
    yarn = rope_inv_freq(**RELEASED)
    ratio = (yarn / plain).tolist()
    for i in range(16):
        assert ratio[i] == pytest.approx(1.0, abs=1e-6)
    for i in range(25, 32):
        assert ratio[i] == pytest.approx(1 / 16, rel=1e-6)
    for i in range(16, 25):  # linear ramp: (1 - t) + t/16 with t = (i - 15)/10
        t = (i - 15) / 10
        assert ratio[i] == pytest.approx((1 - t) + t / 16, rel=1e-5)
    assert ratio[16] == pytest.approx(0.90625, rel=1e-5) and ratio[24] == pytest.approx(0.15625, rel=1e-5)


def test_table_shape_dtype_and_angles():
    table = precompute_freqs_cis(64, 300, **{k: v for k, v in RELEASED.items() if k != "rope_dim"})
    assert table.shape == (300, 32) and table.dtype == torch.complex64
    assert torch.allclose(table.abs(), torch.ones(300, 32))
    inv = rope_inv_freq(**RELEASED)
    wrapped = torch.remainder(7 * inv + math.pi, 2 * math.pi) - math.pi
    assert torch.allclose(table[7].angle(), wrapped, atol=1e-5)
    assert torch.equal(table[0], torch.ones(32, dtype=torch.complex64))


def test_no_yarn_when_original_seq_len_zero():
    table = precompute_freqs_cis(16, 10, 0, 10000.0, 40, 32, 1)
    inv = 1.0 / (10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    assert torch.allclose(table[1].angle(), inv, atol=1e-6)


def test_rope_tables_for_layer_pick_theta_and_yarn():
    args = get_flavor("debug")
    ratio0 = next(i for i in range(args.n_total_layers) if args.compress_ratio(i) == 0)
    ratio_pos = next(i for i in range(args.n_total_layers) if args.compress_ratio(i) > 0)
    r = args.rope_head_dim
    t0, t1 = rope_tables_for_layer(args, ratio0), rope_tables_for_layer(args, ratio_pos)
    assert t0.shape == t1.shape == (args.max_seq_len, r // 2)
    base0 = rope_inv_freq(r, 0, args.rope_theta, args.rope_factor, args.beta_fast, args.beta_slow)
    yarn1 = rope_inv_freq(
        r, args.original_seq_len, args.compress_rope_theta, args.rope_factor, args.beta_fast, args.beta_slow
    )
    assert torch.allclose(t0[1].angle(), base0) and torch.allclose(t1[1].angle(), yarn1)
    # YaRN is really active in the debug flavor: the slowest pair is divided by the factor
    plain1 = rope_inv_freq(r, 0, args.compress_rope_theta, args.rope_factor, args.beta_fast, args.beta_slow)
    assert yarn1[-1].item() == pytest.approx(plain1[-1].item() / args.rope_factor, rel=1e-6)


def _table(seqlen=32, rope_dim=16):
    return precompute_freqs_cis(rope_dim, seqlen, 16, 160000.0, 4, 32, 1)


@pytest.mark.parametrize("shape", [(2, 32, 16), (2, 32, 3, 16), (2, 32, 3, 2, 16)])
def test_rotation_preserves_pair_norms_and_inverse_undoes(shape):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    f = _table()
    y = apply_rotary_emb(x, f)
    assert y.shape == x.shape and not torch.allclose(y, x)
    pair_norm = lambda t: t.unflatten(-1, (-1, 2)).norm(dim=-1)
    assert torch.allclose(pair_norm(y), pair_norm(x), atol=1e-5)
    assert torch.allclose(apply_rotary_emb(y, f, inverse=True), x, atol=1e-5)


def test_interleaved_pairs_match_explicit_formula_and_broadcast_over_heads():
    x = torch.randn(1, 32, 2, 16, generator=torch.Generator().manual_seed(1))
    f = _table()
    y = apply_rotary_emb(x, f)
    cos, sin = f.real, f.imag  # [S, 8]
    x0, x1 = x[..., 0::2], x[..., 1::2]
    c, s = cos[None, :, None], sin[None, :, None]
    assert torch.allclose(y[..., 0::2], x0 * c - x1 * s, atol=1e-6)
    assert torch.allclose(y[..., 1::2], x0 * s + x1 * c, atol=1e-6)
    # each head is rotated with the same table
    assert torch.allclose(apply_rotary_emb(x[:, :, 1], f), y[:, :, 1])


def test_only_last_rope_dims_rotate_and_dtype_kept():
    x = torch.randn(2, 32, 4, 48, dtype=torch.bfloat16)
    f = _table()
    y = apply_rotary_emb(x, f)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y[..., :32], x[..., :32])
    assert torch.equal(y[..., 32:], apply_rotary_emb(x[..., 32:], f))


def test_not_in_place_and_differentiable():
    x = torch.randn(2, 32, 16, requires_grad=True)
    x_before = x.detach().clone()
    y = apply_rotary_emb(x, _table())
    assert torch.equal(x.detach(), x_before)
    y.square().sum().backward()  # rotation is orthogonal: d|y|²/dx = 2x
    assert torch.allclose(x.grad, 2 * x_before, atol=1e-5)


def test_relative_position_property():
    f = _table(seqlen=64)
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(16, generator=g), torch.randn(16, generator=g)

    def score(m, n):
        qm = apply_rotary_emb(q.view(1, 1, 16), f[m : m + 1])
        kn = apply_rotary_emb(k.view(1, 1, 16), f[n : n + 1])
        return (qm * kn).sum().item()

    assert score(10, 3) == pytest.approx(score(47, 40), abs=1e-4)
    assert score(20, 20) == pytest.approx(score(0, 0), abs=1e-4)
    assert score(10, 3) != pytest.approx(score(10, 4), abs=1e-3)


def test_per_row_positions():
    f = _table(seqlen=64)
    x = torch.randn(2, 1, 3, 16)
    pos = torch.tensor([5, 40])
    y = apply_rotary_emb(x, f[pos].unsqueeze(1))  # [B, 1, R/2]
    assert torch.allclose(y[0:1], apply_rotary_emb(x[0:1], f[5:6]))
    assert torch.allclose(y[1:2], apply_rotary_emb(x[1:2], f[40:41]))


def test_freqs_with_singleton_batch_and_shape_errors():
    f = _table()
    x = torch.randn(3, 32, 2, 16)
    assert torch.equal(apply_rotary_emb(x, f.unsqueeze(0)), apply_rotary_emb(x, f))
    with pytest.raises(AssertionError):
        apply_rotary_emb(x[:, :31], f)
    with pytest.raises(AssertionError):
        apply_rotary_emb(x, f.unsqueeze(0).expand(2, -1, -1))


def test_the_models_real_table_rotates_as_the_complex_one_and_compiles_to_one_kernel():
    """The Transformer keeps the table's (cos, sin) view: the same rotation as the complex phasors, per-row
    positions included, and a compiled step of two rotations and their table gather is one fused kernel
    (inductor generates no code for complex ops: with the complex table each was a kernel of its own)."""
    from torch._inductor.utils import run_and_get_code

    f = _table(seqlen=64)
    real = torch.view_as_real(f)
    x = torch.randn(3, 1, 2, 16, generator=torch.Generator().manual_seed(2)).bfloat16()
    pos = torch.tensor([5, 40, 63])
    for inverse in (False, True):
        complex_rows, real_rows = f[pos][:, None], real[pos][:, None]
        assert torch.equal(apply_rotary_emb(x, real_rows, inverse), apply_rotary_emb(x, complex_rows, inverse))

    def step(x, pos):
        rows = real[pos][:, None]
        return apply_rotary_emb(apply_rotary_emb(x, rows) * 2, rows, inverse=True)

    out, (code, *_) = run_and_get_code(torch.compile(step, backend="inductor"), x, pos)
    # the compiled step may keep the first rotation in fp32 where eager rounds it to bf16: one bf16 rounding
    # (2^-9 of a pair's norm, <= sqrt(2) x the largest value; rotations keep norms) plus each side's last
    # rounding (2^-9 each) stay under 2^-6 of the largest value
    ref = step(x, pos).float()
    assert (out.float() - ref).abs().max() <= 2**-6 * ref.abs().max()
    assert not re.search(r"torch\.ops\.aten\.\w+\.\w+\(", code), "a rotation op fell back to an eager kernel"
    assert code.count("async_compile.cpp_pybinding") + code.count("async_compile.triton") == 1
