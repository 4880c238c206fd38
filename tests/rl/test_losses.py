"""Losses against direct computations: OPD value and gradient vs autograd through full softmaxes,
decoupled PPO reducing to plain PPO when rollout and learner log-probs agree, IS modes, SFT masking."""

from __future__ import annotations

import torch

from model.moe import sequence_balance_loss
from rl.config import PolicyLossConfig
from rl.losses import balance_terms, opd_reverse_kl, policy_loss, sft_loss, token_logprobs

torch.set_num_threads(1)


def _direct_kl(s_logits: torch.Tensor, t_logits: torch.Tensor) -> torch.Tensor:
    logp, logq = s_logits.log_softmax(-1), t_logits.detach().log_softmax(-1)
    return (logp.exp() * (logp - logq)).sum(-1)


def test_opd_matches_full_vocabulary_autograd_from_logits():
    g = torch.Generator().manual_seed(0)
    s = (torch.randn(2, 5, 37, generator=g, dtype=torch.float64) * 3).requires_grad_()
    t = torch.randn(2, 5, 37, generator=g, dtype=torch.float64) * 3
    mask = torch.rand(2, 5, generator=g) > 0.3
    loss, D = opd_reverse_kl(s, t, mask, chunk_size=8)  # 37 = 4 full chunks + a ragged one
    ref_D = _direct_kl(s, t)[mask]
    ref = ref_D.sum() / mask.sum()
    torch.testing.assert_close(D, ref_D, atol=1e-6, rtol=0)
    torch.testing.assert_close(loss, ref, atol=1e-6, rtol=0)
    (g_chunked,) = torch.autograd.grad(loss, s)
    s2 = s.detach().clone().requires_grad_()
    (g_direct,) = torch.autograd.grad(_direct_kl(s2, t)[mask].sum() / mask.sum(), s2)
    torch.testing.assert_close(g_chunked, g_direct, atol=1e-6, rtol=0)


def test_opd_from_hidden_states_and_heads_matches_direct():
    g = torch.Generator().manual_seed(1)
    N, D_s, D_t, V = 6, 8, 10, 29
    h = torch.randn(N, D_s, generator=g, dtype=torch.float64).requires_grad_()
    W = torch.randn(V, D_s, generator=g, dtype=torch.float64).requires_grad_()
    th = torch.randn(N, D_t, generator=g, dtype=torch.float64)
    TW = torch.randn(V, D_t, generator=g, dtype=torch.float64).requires_grad_()  # must get no gradient
    mask = torch.ones(N, dtype=torch.bool)
    mask[2] = False
    loss, _ = opd_reverse_kl(h, th, mask, chunk_size=7, student_head=W, teacher_head=TW)
    gh, gW = torch.autograd.grad(loss, (h, W))
    h2, W2 = h.detach().clone().requires_grad_(), W.detach().clone().requires_grad_()
    ref = _direct_kl(h2 @ W2.T, th @ TW.detach().T)[mask].mean()
    rh, rW = torch.autograd.grad(ref, (h2, W2))
    torch.testing.assert_close(loss, ref, atol=1e-6, rtol=0)
    torch.testing.assert_close(gh, rh, atol=1e-6, rtol=0)
    torch.testing.assert_close(gW, rW, atol=1e-6, rtol=0)
    assert TW.grad is None


def test_opd_is_zero_when_student_equals_teacher():
    x = torch.randn(3, 4, 50)
    loss, D = opd_reverse_kl(x.clone().requires_grad_(), x, torch.ones(3, 4, dtype=torch.bool), chunk_size=16)
    assert float(loss.detach().abs()) < 1e-5 and D.detach().abs().max() < 1e-5


def _ppo_reference(logp_new, logp_old, adv, mask, eps_low=0.2, eps_high=0.28):
    r = (logp_new - logp_old).exp()
    obj = torch.minimum(r * adv, r.clamp(1 - eps_low, 1 + eps_high) * adv)
    return -(obj * mask).sum() / mask.sum()


def _rl_inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    shape = (3, 11)
    old = -torch.rand(shape, generator=g) * 3
    new = (old + 0.4 * torch.randn(shape, generator=g)).requires_grad_()
    adv = torch.randn(shape, generator=g)
    mask = torch.rand(shape, generator=g) > 0.25
    return new, old, adv, mask


def test_is_correction_is_exact_when_rollout_and_learner_agree():
    new, old, adv, mask = _rl_inputs()
    for mode in ("token_tis", "mask"):
        loss, m = policy_loss(new, old, old.clone(), adv, mask, PolicyLossConfig(is_mode=mode))
        ref = _ppo_reference(new, old, adv, mask)
        torch.testing.assert_close(loss, ref, atol=1e-7, rtol=0)
        assert m["is_weight_mean"] == 1.0 and m["is_weight_min"] == 1.0 and m["is_weight_max"] == 1.0
        assert m["mismatch_k1"] == 0.0 and m["mismatch_k3"] == 0.0 and m["is_masked_frac"] == 0.0
        (g1,) = torch.autograd.grad(loss, new)
        (g2,) = torch.autograd.grad(_ppo_reference(new, old, adv, mask), new)
        torch.testing.assert_close(g1, g2)


def test_truncated_and_masked_importance_weights():
    new, prox, adv, mask = _rl_inputs(1)
    behaviour = prox - torch.linspace(-1.5, 1.5, prox.numel()).view_as(prox)  # w = exp(linspace)
    w = (prox - behaviour).exp()
    cfg = PolicyLossConfig(is_mode="token_tis", is_cap=2.0)
    loss, m = policy_loss(new, prox, behaviour, adv, mask, cfg)
    r = (new - prox).exp()
    obj = torch.minimum(r * adv, r.clamp(0.8, 1.28) * adv)
    ref = -(w.clamp(max=2.0) * obj * mask).sum() / mask.sum()
    torch.testing.assert_close(loss, ref)
    assert 0 < m["is_truncated_frac"] < 1 and m["mismatch_k3"] > 0
    cfg = PolicyLossConfig(is_mode="mask", is_band_low=0.5, is_band_high=2.0)
    loss, m = policy_loss(new, prox, behaviour, adv, mask, cfg)
    keep = (w >= 0.5) & (w <= 2.0)
    ref = -(w * obj * mask * keep).sum() / mask.sum()  # masked tokens stay in the denominator
    torch.testing.assert_close(loss, ref)
    assert abs(m["is_masked_frac"] - float((~keep & mask).sum() / mask.sum())) < 1e-6


def test_clip_fraction_dual_clip_and_global_denominator():
    new, old, adv, mask = _rl_inputs(2)
    loss, m = policy_loss(new, old, old, adv, mask, PolicyLossConfig(), denominator=100.0)
    torch.testing.assert_close(loss * 100.0, _ppo_reference(new, old, adv, mask) * mask.sum())
    r = (new - old).exp()
    expected = (((r.clamp(0.8, 1.28) * adv) < (r * adv)) & mask).sum() / mask.sum()
    assert abs(m["clip_frac"] - float(expected)) < 1e-6
    big = old + 3.0  # ratio e^3 with negative advantages: the dual clip bounds the loss at c·|A|
    neg = -adv.abs() - 0.1
    loss, m = policy_loss(big, old, old, neg, mask, PolicyLossConfig(dual_clip=3.0))
    torch.testing.assert_close(loss, -(3.0 * neg * mask).sum() / mask.sum())
    assert m["dual_clip_frac"] == 1.0


def test_kl_to_reference_k3():
    new, old, adv, mask = _rl_inputs(3)
    ref_lp = old - 0.3
    base, _ = policy_loss(new, old, old, adv, mask, PolicyLossConfig())
    with_kl, m = policy_loss(new, old, old, adv, mask, PolicyLossConfig(kl_coef=0.1), logp_ref=ref_lp)
    d = ref_lp - new
    k3 = ((d.exp() - d - 1) * mask).sum() / mask.sum()
    torch.testing.assert_close(with_kl - base, 0.1 * k3)


def test_sft_loss_is_masked_next_token_cross_entropy():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 6, 13, generator=g)
    ids = torch.randint(0, 13, (2, 6), generator=g)
    mask = torch.tensor([[0, 0, 1, 1, 0, 1], [0, 1, 1, 1, 1, 1]], dtype=torch.bool)
    ce = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 13), ids[:, 1:].reshape(-1), reduction="none")
    ref = (ce.view(2, 5) * mask[:, 1:]).sum() / mask.sum()
    torch.testing.assert_close(sft_loss(logits, ids, mask), ref)
    torch.testing.assert_close(sft_loss(logits, ids, mask, denominator=50.0), ref * mask.sum() / 50.0)
    assert token_logprobs(logits, ids)[:, 0].eq(0).all()


def test_balance_terms_sum_the_model_loss_over_layers():
    from model.moe import RouterStats

    g = torch.Generator().manual_seed(0)
    stats = []
    for _ in range(3):
        scores = torch.rand(2, 7, 4, generator=g)
        topk = scores.topk(2, dim=-1).indices.sort(-1).values
        counts = torch.bincount(topk.flatten(), minlength=4)
        stats.append(RouterStats(counts=counts, mean_prob=scores.mean((0, 1)), topk_idx=topk, scores=scores))
    total, counts = balance_terms(stats, alpha=0.01)
    ref = sum(sequence_balance_loss(s.scores, s.topk_idx, 4, 2, 0.01) for s in stats)
    torch.testing.assert_close(total, ref)
    assert len(counts) == 3 and int(counts[0].sum()) == 2 * 7 * 2
