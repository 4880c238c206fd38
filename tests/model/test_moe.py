"""MoE routing, experts and balancing rules (spec §3.11, trap 8)."""

import math

import pytest
import torch
import torch.nn.functional as F

from model.config import get_flavor
from model.moe import MoE, RouterStats, sequence_balance_loss, update_expert_bias


def _args(**overrides):
    base = dict(dim=64, moe_inter_dim=32, n_routed_experts=8, n_activated_experts=3, route_scale=1.5)
    return get_flavor("debug", **{**base, **overrides})


def _moe(seed=0, **overrides) -> MoE:
    torch.manual_seed(seed)
    return MoE(_args(**overrides))


def _x(*shape, seed=1, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def test_official_parameter_names_and_frozen_biases():
    moe = _moe(vision_n_layers=1)
    names = dict(moe.named_parameters())
    for n in ["gate.weight", "gate.bias", "gate.bias_vl", "experts.0.w1.weight", "experts.7.w2.weight",
              "experts.3.w3.weight", "shared_experts.w1.weight", "shared_experts.w2.weight",
              "shared_experts.w3.weight"]:  # fmt: skip
        assert n in names, n
    assert not any("experts.8." in n or n.endswith(".bias") and "gate" not in n for n in names)
    assert names["experts.0.w1.weight"].shape == (32, 64) and names["experts.0.w2.weight"].shape == (64, 32)
    assert names["gate.bias"].dtype == torch.float32 and not names["gate.bias"].requires_grad
    assert "gate.bias_vl" not in dict(_moe(vision_n_layers=0).named_parameters())


@pytest.mark.parametrize("score_func", ["sqrtsoftplus", "softmax", "sigmoid"])
def test_weights_sum_to_route_scale(score_func):
    moe = _moe(score_func=score_func)
    w, idx, scores = moe.gate(_x(50, 64))
    assert w.dtype == torch.float32 and idx.shape == (50, 3)
    assert torch.allclose(w.sum(-1), torch.full((50,), 1.5), atol=1e-6)
    assert (idx.diff(dim=-1) > 0).all()  # distinct, ascending
    # selection is the top-3 of the unbiased scores when the bias is zero
    assert torch.equal(idx, scores.topk(3, dim=-1).indices.sort(-1).values)


def test_sqrtsoftplus_scores_and_unnormalised_single_expert():
    moe = _moe(n_activated_experts=1)
    x = _x(20, 64)
    w, idx, scores = moe.gate(x)
    expected = F.softplus(x @ moe.gate.weight.T).sqrt()
    assert torch.allclose(scores, expected, atol=1e-6)
    # k = 1: no normalisation, just route_scale times the raw score
    assert torch.allclose(w[:, 0], 1.5 * scores.gather(1, idx)[:, 0])


def test_bias_changes_selection_but_not_weights():
    moe = _moe()
    x = _x(40, 64)
    w0, idx0, scores = moe.gate(x)
    with torch.no_grad():
        moe.gate.bias[5] = 100.0
    w1, idx1, _ = moe.gate(x)
    assert (idx1 == 5).any(-1).all() and not (idx0 == 5).any(-1).all()
    # weights are the unbiased scores of the chosen experts, normalised, times route_scale
    chosen = scores.gather(1, idx1)
    assert torch.allclose(w1, 1.5 * chosen / chosen.sum(-1, keepdim=True), atol=1e-6)


def test_image_tokens_use_bias_vl():
    moe = _moe(vision_n_layers=1)
    with torch.no_grad():
        moe.gate.bias[1], moe.gate.bias[6] = 100.0, -100.0
        moe.gate.bias_vl[6], moe.gate.bias_vl[1] = 100.0, -100.0
    x = _x(2, 10, 64)
    mask = torch.zeros(2, 10, dtype=torch.bool)
    mask[0, 3:7] = True
    _, stats = moe(x, mask)
    idx = stats.topk_idx
    assert idx.shape == (2, 10, 3)
    assert (idx[mask] == 6).any(-1).all() and not (idx[mask] == 1).any(-1).any()
    assert (idx[~mask] == 1).any(-1).all() and not (idx[~mask] == 6).any(-1).any()
    # without a mask everything is text
    _, stats = moe(x)
    assert (stats.topk_idx == 1).any(-1).all()


def test_swiglu_clamps_up_both_sides_gate_only_above():
    moe = _moe(dim=32, moe_inter_dim=32, swiglu_limit=10.0)
    expert = moe.experts[0]
    with torch.no_grad():
        for lin in (expert.w1, expert.w3, expert.w2):
            lin.weight.copy_(torch.eye(32))
    g = torch.tensor([30.0, -30.0, 30.0, 2.0])
    u = torch.tensor([30.0, 1.0, -30.0, 3.0])
    x1 = torch.zeros(1, 32)
    # w1 = w3 = identity means gate == up == x, so drive them through separate experts' halves
    with torch.no_grad():
        expert.w1.weight.zero_()
        expert.w3.weight.zero_()
        expert.w1.weight[:4, :4] = torch.eye(4)
        expert.w3.weight[:4, 4:8] = torch.eye(4)
    x1[0, :4], x1[0, 4:8] = g, u
    h = expert(x1)[0, :4]
    expected = F.silu(torch.tensor([10.0, -30.0, 10.0, 2.0])) * torch.tensor([10.0, 1.0, -10.0, 3.0])
    assert torch.allclose(h, expected, rtol=1e-5, atol=1e-12)
    # a gate clamped from below too would give silu(-10)·1 = -4.5e-4 instead of ~-2.8e-12
    assert abs(h[1].item()) < 1e-10
    # the routing weight multiplies before w2 (linear here, so just a scale)
    assert torch.allclose(expert(x1, torch.tensor([[0.25]]))[0, :4], 0.25 * expected, rtol=1e-5)


def _naive_moe(moe: MoE, x_TD: torch.Tensor) -> torch.Tensor:
    """Per-token loop over the selected experts (the definition)."""
    w, idx, _ = moe.gate(x_TD)
    out = []
    for t in range(x_TD.size(0)):
        acc = moe.shared_experts(x_TD[t : t + 1]).float()
        for k in range(idx.size(1)):
            acc = acc + moe.experts[int(idx[t, k])](x_TD[t : t + 1], w[t, k].view(1, 1)).float()
        out.append(acc.to(x_TD.dtype))
    return torch.cat(out)


def test_grouped_equals_naive_per_token_loop():
    moe = _moe(swiglu_limit=10.0)
    x = _x(3, 7, 64) * 3
    y, stats = moe(x)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert torch.allclose(y.view(-1, 64), _naive_moe(moe, x.view(-1, 64)), atol=1e-5)
    assert stats.counts.sum().item() == 3 * 7 * 3
    assert torch.allclose(stats.mean_prob.sum(), torch.tensor(1.0))


def _reference_moe(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """The official MoE.forward loop (expert by expert, y[idx] += ...)."""
    x_TD = x.view(-1, moe.dim)
    weights, indices, _ = moe.gate(x_TD)
    y = torch.zeros_like(x_TD, dtype=torch.float32)
    for i in range(moe.n_routed_experts):
        idx, top = torch.where(indices == i)
        if idx.numel():
            y[idx] += moe.experts[i](x_TD[idx], weights[idx, top, None])
    y += moe.shared_experts(x_TD)
    return y.type_as(x).view(x.shape)


def test_bf16_bit_identical_to_reference_loop():
    moe = _moe(swiglu_limit=10.0).to(torch.bfloat16)
    x = _x(2, 16, 64, dtype=torch.bfloat16)
    y, _ = moe(x)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, _reference_moe(moe, x))


def test_dense_experts_of_a_compiled_forward_equal_the_loop():
    """`_experts_dense` (impl=torch under torch.compile: no host sync) gives the loop's slot outputs."""
    moe = _moe(swiglu_limit=10.0)
    x_TD = _x(5, 64) * 3
    weights_TK, idx_TK, _ = moe.gate(x_TD)
    expert_N = idx_TK.flatten()
    counts_E = torch.bincount(expert_N, minlength=moe.n_routed_experts)
    with torch.no_grad():
        loop = moe._experts_loop(x_TD, weights_TK, expert_N, counts_E)
        dense = moe._experts_dense(x_TD, weights_TK, idx_TK)
    torch.testing.assert_close(dense, loop, rtol=1e-5, atol=1e-5)  # GEMM row blocking: rounding


def test_gradients_reach_gate_and_selected_experts_not_bias():
    moe = _moe()
    x = _x(4, 6, 64).requires_grad_()
    y, stats = moe(x)
    loss = (y * _x(4, 6, 64, seed=9)).sum() + sequence_balance_loss(stats.scores, stats.topk_idx, 8, 3, 0.01)
    loss.backward()
    assert moe.gate.weight.grad is not None and moe.gate.weight.grad.abs().sum() > 0
    assert moe.gate.bias.grad is None
    used = stats.counts > 0
    for e in range(8):
        g = moe.experts[e].w2.weight.grad
        assert (g is not None and g.abs().sum() > 0) == bool(used[e])
    assert moe.shared_experts.w1.weight.grad.abs().sum() > 0 and x.grad.abs().sum() > 0


def test_dspark_expert_counts():
    args = _args()
    moe = MoE(args, 4, 1)
    assert len(moe.experts) == 4 and moe.gate.weight.shape == (4, 64) and moe.gate.topk == 1
    assert len(MoE(args, 0, None).experts) == args.n_routed_experts
    y, stats = moe(_x(5, 64))
    assert y.shape == (5, 64) and isinstance(stats, RouterStats) and stats.topk_idx.shape == (5, 1)


def test_balance_loss_is_minimised_by_uniform_routing():
    E, K, S = 8, 2, 64
    # uniform: every expert picked equally often and equal mean probability
    uniform_scores = torch.ones(1, S, E)
    uniform_idx = torch.stack([torch.arange(S) % E, (torch.arange(S) + 1) % E], -1).unsqueeze(0)
    l_uniform = sequence_balance_loss(uniform_scores, uniform_idx, E, K, alpha=0.1)
    assert l_uniform.item() == pytest.approx(0.1, rel=1e-6)
    # collapsed: all tokens prefer experts 0 and 1
    collapsed = torch.full((1, S, E), 0.1)
    collapsed[..., :2] = 10.0
    l_collapsed = sequence_balance_loss(collapsed, collapsed.topk(K, -1).indices, E, K, alpha=0.1)
    assert l_collapsed.item() > 3 * l_uniform.item()
    # random routing is in between, and the gradient pushes the loaded experts' scores down
    scores = torch.rand(2, S, E, generator=torch.Generator().manual_seed(0)).requires_grad_()
    idx = scores.topk(K, -1).indices
    loss = sequence_balance_loss(scores, idx, E, K, alpha=0.1)
    assert l_uniform.item() <= loss.item() < l_collapsed.item()
    loss.backward()
    load = torch.zeros(2, E).scatter_add_(1, idx.flatten(1), torch.ones(2, S * K))
    busiest, idlest = load.argmax(-1), load.argmin(-1)
    g = scores.grad.sum(1)
    assert (g.gather(1, busiest[:, None]) > g.gather(1, idlest[:, None])).all()


def test_balance_loss_is_per_sequence_and_respects_mask():
    E, K, S = 4, 1, 8
    # sequence 0 uses only expert 0, sequence 1 only expert 1: balanced over the batch, not per sequence
    scores = torch.full((2, S, E), 0.01)
    scores[0, :, 0] = scores[1, :, 1] = 1.0
    idx = scores.topk(K, -1).indices
    loss = sequence_balance_loss(scores, idx, E, K, alpha=1.0)
    p0 = 1.0 / (1.0 + 3 * 0.01)
    assert loss.item() == pytest.approx(E * p0, rel=1e-5)  # f_0 = E/K, P_0 = p0 per sequence
    # masked (padding) tokens do not count
    mask = torch.ones(2, S, dtype=torch.bool)
    padded = torch.cat([scores, torch.ones(2, 3, E)], 1)
    padded_idx = torch.cat([idx, torch.full((2, 3, K), 3)], 1)
    mask = torch.cat([mask, torch.zeros(2, 3, dtype=torch.bool)], 1)
    assert sequence_balance_loss(padded, padded_idx, E, K, 1.0, mask).item() == pytest.approx(loss.item())


def test_bias_update_moves_load_toward_uniform():
    moe = _moe(n_activated_experts=2)
    with torch.no_grad():  # a skewed router: expert 0 and 1 win for most tokens
        moe.gate.weight[:2] += 0.5 * moe.gate.weight[:2].sign()
        moe.gate.weight[:2] += torch.randn(2, 64) * 0.3
    x = _x(512, 64, seed=3)

    def route():
        _, idx, scores = moe.gate(x)
        counts = torch.bincount(idx.flatten(), minlength=8).float()
        return (counts.max() / counts.mean()).item(), counts, scores

    with torch.no_grad():
        first, counts, scores0 = route()
        history = [first]
        for _ in range(60):
            update_expert_bias(moe.gate.bias, counts, rate=0.01)
            ratio, counts, scores = route()
            history.append(ratio)
    assert torch.equal(scores, scores0)  # the bias never touches scores, hence weights
    assert first > 1.5  # the skew is real
    assert history[-1] < 0.6 * history[0]
    assert min(history[-10:]) < 1.3
    # and the full MoE reports the same counts the gate produced
    _, stats = moe(x)
    assert torch.equal(stats.counts.float(), route()[1])


def test_update_expert_bias_sign_rule():
    bias = torch.zeros(4)
    out = update_expert_bias(bias, torch.tensor([10, 2, 6, 6]), rate=0.5)
    assert out is bias and bias.tolist() == [-0.5, 0.5, 0.0, 0.0]
    assert math.isclose(bias.sum().item(), 0.0)
