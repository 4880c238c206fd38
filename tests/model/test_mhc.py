"""Single-Pass mHC math (spec §3.2, trap 1)."""

import torch

from model.mhc import (
    hc_coefficients,
    hc_mixes,
    hc_post,
    hc_pre,
    hc_split_sinkhorn,
    identity_pre_mix,
    init_hc_params,
    sinkhorn_normalize,
)

HC, D = 4, 32
N_MIX = (2 + HC) * HC


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _spec_split(mixes, scale, base, hc, iters, eps):
    """Literal transcription of the spec, one token at a time, with softmax and explicit loops."""
    pre = torch.sigmoid(mixes[:hc] * scale[0] + base[:hc]) + eps
    post = 2 * torch.sigmoid(mixes[hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
    logits = mixes[2 * hc :] * scale[2] + base[2 * hc :]
    comb = torch.empty(hc, hc)
    for j in range(hc):
        for k in range(hc):
            comb[j, k] = logits[hc * j + k]
    comb = torch.softmax(comb, dim=1) + eps
    comb = comb / (comb.sum(0, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(1, keepdim=True) + eps)
        comb = comb / (comb.sum(0, keepdim=True) + eps)
    return pre, post, comb


def test_split_matches_literal_spec():
    mixes = torch.randn(5, N_MIX, generator=_gen(0))
    scale, base = torch.rand(3, generator=_gen(1)) + 0.5, torch.randn(N_MIX, generator=_gen(2))
    pre, post, comb = hc_split_sinkhorn(mixes, scale, base, HC, 20, 1e-6)
    assert pre.shape == post.shape == (5, HC) and comb.shape == (5, HC, HC)
    for t in range(5):
        p, q, c = _spec_split(mixes[t], scale, base, HC, 20, 1e-6)
        assert torch.allclose(pre[t], p, atol=1e-7)
        assert torch.allclose(post[t], q, atol=1e-7)
        assert torch.allclose(comb[t], c, atol=1e-6)
    assert (pre > 0).all() and (pre < 1 + 1e-5).all() and (post > 0).all() and (post < 2).all()
    # pre is not normalised: its sum is free
    assert not torch.allclose(pre.sum(-1), torch.ones(5), atol=1e-2)


def test_sinkhorn_is_doubly_stochastic():
    # O(1) logits, as the normalised stream gives: 20 iterations reach 1e-5 on rows and columns
    mixes = torch.randn(2, 512, N_MIX, generator=_gen(3)) * 0.5
    base = torch.randn(N_MIX, generator=_gen(4)) * 0.2
    _, _, comb = hc_split_sinkhorn(mixes, torch.ones(3), base, HC, 20, 1e-6)
    assert (comb >= 0).all()
    assert (comb.sum(-1) - 1).abs().max() < 1e-5  # rows
    assert (comb.sum(-2) - 1).abs().max() < 1e-5  # columns
    assert comb.std() > 0.02  # and not trivially uniform


def test_sinkhorn_wide_logits_columns_exact_rows_converge_with_iterations():
    # With spread-out logits 20 passes leave row sums off by up to ~4e-2 (the reference's behaviour
    # too); the last step is a column pass, so columns are always normalised.
    mixes = torch.randn(2000, N_MIX, generator=_gen(17)) * 2
    row_err = []
    for iters in (20, 100, 500):
        _, _, comb = hc_split_sinkhorn(mixes, torch.ones(3), torch.zeros(N_MIX), HC, iters, 1e-6)
        assert (comb.sum(-2) - 1).abs().max() < 1e-5
        row_err.append((comb.sum(-1) - 1).abs().max().item())
    assert row_err[0] > row_err[1] > row_err[2] and row_err[2] < 1e-5


def test_comb_layout_is_row_major():
    # a huge logit at element 2hc + hc·j + k makes comb[j, k] the dominant entry of row j
    mixes = torch.zeros(1, N_MIX)
    base = torch.zeros(N_MIX)
    j, k = 1, 3
    base[2 * HC + HC * j + k] = 20.0
    _, _, comb = hc_split_sinkhorn(mixes, torch.ones(3), base, HC, 1, 1e-6)
    assert comb[0, j].argmax().item() == k


def test_mixes_use_one_rms_over_all_copies():
    x = torch.randn(2, 3, HC, D, generator=_gen(5))
    fn = torch.randn(N_MIX, HC * D, generator=_gen(6))
    flat = x.flatten(-2)
    expected = flat @ fn.T / flat.pow(2).mean(-1, keepdim=True).sqrt()
    assert torch.allclose(hc_mixes(x, fn, 1e-20), expected, rtol=1e-5, atol=1e-5)
    # scale-invariant as a whole, but NOT per copy (a per-copy norm would be invariant here too)
    assert torch.allclose(hc_mixes(3 * x, fn, 1e-20), hc_mixes(x, fn, 1e-20), rtol=1e-4, atol=1e-5)
    x2 = x.clone()
    x2[..., 1, :] *= 5
    per_copy = lambda t: t / t.pow(2).mean(-1, keepdim=True).sqrt()
    assert torch.allclose(per_copy(x2), per_copy(x), atol=1e-5)
    assert not torch.allclose(hc_mixes(x2, fn, 1e-20), hc_mixes(x, fn, 1e-20), atol=1e-2)
    assert hc_mixes(x.bfloat16(), fn, 1e-20).dtype == torch.float32


def test_hc_pre_weighted_sum_and_dtype():
    x = torch.randn(2, 3, HC, D, generator=_gen(7)).bfloat16()
    pre = torch.rand(2, 3, HC, generator=_gen(8))
    y = hc_pre(x, pre)
    assert y.dtype == torch.bfloat16 and y.shape == (2, 3, D)
    expected = (pre[..., None] * x.float()).sum(-2).bfloat16()
    assert torch.equal(y, expected)
    one_hot = identity_pre_mix(2, 3, HC)
    assert one_hot.dtype == torch.float32 and one_hot.shape == (2, 3, HC)
    assert torch.equal(hc_pre(x, one_hot), x[..., 0, :])


def test_hc_post_applies_comb_transposed():
    f = torch.randn(2, 3, D, generator=_gen(9))
    res = torch.randn(2, 3, HC, D, generator=_gen(10))
    post = torch.rand(2, 3, HC, generator=_gen(11)) * 2
    comb = torch.rand(2, 3, HC, HC, generator=_gen(12))  # deliberately not symmetric
    out = hc_post(f, res, post, comb)
    expected = torch.empty_like(res)
    for b in range(2):
        for s in range(3):
            for k in range(HC):
                acc = post[b, s, k] * f[b, s]
                for j in range(HC):
                    acc = acc + comb[b, s, j, k] * res[b, s, j]
                expected[b, s, k] = acc
    assert torch.allclose(out, expected, atol=1e-5)
    wrong = post[..., None] * f[..., None, :] + torch.einsum("...kj,...jd->...kd", comb, res)
    assert not torch.allclose(out, wrong, atol=1e-3)
    assert hc_post(f.bfloat16(), res.bfloat16(), post, comb).dtype == torch.bfloat16


def test_init_is_near_plain_residual():
    p = init_hc_params(D, HC, generator=_gen(13))
    assert p["fn"].shape == (N_MIX, HC * D) and p["base"].shape == (N_MIX,) and p["scale"].shape == (3,)
    assert all(t.dtype == torch.float32 for t in p.values())
    x = torch.randn(4, 8, HC, D, generator=_gen(14))
    pre, post, comb = hc_coefficients(
        x, p["fn"], p["scale"], p["base"], norm_eps=1e-20, hc_mult=HC, iters=20, hc_eps=1e-6
    )
    assert torch.allclose(pre, torch.full_like(pre, 1 / HC), atol=0.1)
    assert abs(pre.mean().item() - 1 / HC) < 0.01
    assert torch.allclose(post, torch.ones_like(post), atol=0.15)
    assert (torch.diagonal(comb, dim1=-2, dim2=-1) > 0.9).all()


def test_gradients_flow_to_all_parameters():
    p = {k: v.requires_grad_() for k, v in init_hc_params(D, HC, generator=_gen(15)).items()}
    x = torch.randn(2, 5, HC, D, generator=_gen(16), requires_grad=True)
    pre, post, comb = hc_coefficients(
        x, p["fn"], p["scale"], p["base"], norm_eps=1e-20, hc_mult=HC, iters=20, hc_eps=1e-6
    )
    f = torch.tanh(hc_pre(x, pre))  # a stand-in sub-layer
    out = hc_post(f, x, post, comb)
    (out * torch.randn_like(out)).sum().backward()
    for name, t in [*p.items(), ("x", x)]:
        assert t.grad is not None and torch.isfinite(t.grad).all(), name
        assert t.grad.abs().sum() > 0, name


def _composed_sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """The plain torch composition `sinkhorn_normalize` replaces, differentiated by autograd."""
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def test_sinkhorn_normalize_values_exact_and_gradient_hand_written():
    g = torch.Generator().manual_seed(0)
    comb = torch.rand(7, HC, HC, generator=g, dtype=torch.float64) + 0.05
    # the hand-written backward is the exact derivative: gradcheck in float64
    assert torch.autograd.gradcheck(lambda c: sinkhorn_normalize(c, 4, 1e-6), (comb.requires_grad_(),))
    # fp32: the same forward ops (bit-identical values); the gradient differs from autograd's only in
    # rounding order (a few ulp per pass over 39 passes: 1e-5 relative bounds it with margin)
    c32 = (torch.rand(64, HC, HC, generator=g) * 3 + 0.01).requires_grad_()
    w = torch.randn(64, HC, HC, generator=g)
    want = _composed_sinkhorn(c32, 20, 1e-6)
    (gw,) = torch.autograd.grad((want * w).sum(), c32)
    got = sinkhorn_normalize(c32, 20, 1e-6)
    (gg,) = torch.autograd.grad((got * w).sum(), c32)
    assert torch.equal(got, want)
    torch.testing.assert_close(gg, gw, rtol=1e-5, atol=1e-6)
    for hc in (2, 4):  # the model's widths: the same values with hc = 2 (tiny_demo) and 4 (released)
        c = torch.rand(256, hc, hc, generator=g) * torch.rand(256, 1, 1, generator=g) * 10
        assert torch.equal(sinkhorn_normalize(c, 20, 1e-6), _composed_sinkhorn(c, 20, 1e-6))
