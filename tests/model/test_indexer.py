"""Indexer: the deterministic top-k tie rule, candidate blocks (pinning, -inf drop) and scoring."""

import torch
import torch.nn.functional as F

from model.attention import build_incremental_layout, build_packed_layout
from model.config import get_flavor
from model.indexer import Indexer, select_candidate_blocks, topk_indices


def test_topk_all_zero_scores_newest_positions_win():
    vals, idx = topk_indices(torch.zeros(3, 10), 4)
    assert idx.tolist() == [[9, 8, 7, 6]] * 3
    assert (vals == 0).all()


def test_topk_ties_break_to_larger_position_and_scores_still_rule():
    scores = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 2.0])
    _, idx = topk_indices(scores, 4)
    assert idx.tolist() == [5, 2, 0, 4]


def test_topk_k_larger_than_n_and_neg_inf_last():
    scores = torch.tensor([[-torch.inf, 3.0, -torch.inf]])
    vals, idx = topk_indices(scores, 8)
    assert idx.tolist() == [[1, 2, 0]]
    assert vals[0, 0] == 3 and torch.isinf(vals[0, 1:]).all()


def _sorted_topk(scores, k):
    """The tie rule written as a stable descending sort of the position-reversed scores."""
    n = scores.size(-1)
    values, rev = torch.sort(scores.flip(-1), dim=-1, descending=True, stable=True)
    return values[..., : min(k, n)], (n - 1) - rev[..., : min(k, n)]


def test_topk_equals_the_stable_sort_with_ties_signed_zeros_inf_and_nan():
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        # ReLU'd, head-weighted scores: many exact zeros of both signs, repeated values, -inf masks
        scores = (torch.randn(3, 40, 97, generator=g).relu() * torch.randn(3, 40, 1, generator=g)).round(decimals=1)
        scores[:, :, 60:] = -torch.inf
        scores[0, :5, 3] = float("nan")
        scores[1, :, :50] = -0.0
        scores = scores.to(dtype)
        assert (scores == 0).sum() > 1000 and torch.signbit(scores[scores == 0]).any()
        for k in (1, 32, 97, 200):
            want_v, want_i = _sorted_topk(scores, k)
            got_v, got_i = topk_indices(scores, k)
            assert torch.equal(got_i, want_i), (dtype, k)
            assert got_v.dtype == dtype and torch.equal(got_v.nan_to_num(7.0), want_v.nan_to_num(7.0))


def _reference_candidates(logits, compress_lens, topk_blocks, block_size):
    """model_reference §3.7 written directly (contiguous blocks), with distinct scores."""
    width = logits.size(-1)
    scores = F.pad(logits, (0, -width % block_size), value=-torch.inf)
    scores = scores.unflatten(-1, (-1, block_size)).amax(dim=-1)
    nb = scores.size(-1)
    last = (compress_lens - 1) // block_size
    scores = scores.masked_fill((torch.arange(nb) == last) & (compress_lens > 0), torch.inf)
    top = scores.topk(min(topk_blocks, nb), dim=-1)
    keep = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, top.indices, top.values > -torch.inf)
    return keep.repeat_interleave(block_size, dim=-1)[..., :width]


def test_candidate_blocks_match_reference_on_distinct_scores():
    torch.manual_seed(0)
    G, bs = 23, 4
    S = G
    lens = (torch.arange(S) + 1).unsqueeze(-1)  # query s sees groups < s+1
    logits = torch.randn(2, S, G).masked_fill(torch.arange(G) >= lens, -torch.inf)
    block_id = (torch.arange(G) // bs).expand(2, G)
    newest = (lens.squeeze(-1) - 1).expand(2, S)
    for topk_blocks in (1, 2, 3, 10):
        got = select_candidate_blocks(logits, block_id, -(-G // bs), newest, topk_blocks)
        want = _reference_candidates(logits, lens, topk_blocks, bs)
        assert torch.equal(got, want), topk_blocks


def test_candidate_blocks_pin_newest_and_drop_unreachable():
    # 10 groups, blocks [0-3] [4-7] [8-9]; query sees groups 0..8 (newest 8, in the partial block 2)
    scores = torch.full((1, 2, 10), -torch.inf)
    scores[0, 0, :9] = torch.tensor([5.0, 0, 0, 0, 1, 1, 1, 1, -3])
    scores[0, 1, :2] = torch.tensor([0.5, 0.1])  # second query sees only groups 0, 1
    block_id = (torch.arange(10) // 4).unsqueeze(0)
    newest = torch.tensor([[8, 1]])
    keep = select_candidate_blocks(scores, block_id, 3, newest, topk_blocks=2)
    # query 0: pinned block 2 (score -3 would lose) + best block 0; block 1 (score 1) dropped
    assert keep[0, 0].tolist() == [True] * 4 + [False] * 4 + [True] * 2
    # query 1: only block 0 reachable; the second pick is -inf and is dropped
    assert keep[0, 1].tolist() == [True] * 4 + [False] * 6


def test_candidate_blocks_restart_per_document():
    # docs of 6 and 5 tokens, ratio 1, blocks of 4: the second doc's blocks start at its first group
    doc = torch.tensor([[0] * 6 + [1] * 5])
    gl = build_packed_layout(doc, 4, (1,), 4).groups[1]
    assert gl.block_id[0].tolist() == [0, 0, 0, 0, 1, 1, 2, 2, 2, 2, 3]
    assert gl.newest[0].tolist() == list(range(6)) + list(range(6, 11))


def _indexer(layer_id=None, **over):
    args = get_flavor("debug", **over)
    layer_id = args.kv_source_layers[0] if layer_id is None else layer_id
    torch.manual_seed(0)
    idx = Indexer(args, layer_id)
    for p in idx.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return args, idx


def _inputs(args, B, S, G):
    """x, qr, index keys and identity rope phasors for a direct Indexer call."""
    return (
        torch.randn(B, S, args.dim),
        torch.randn(B, S, args.q_lora_rank),
        torch.randn(B, G, args.index_head_dim),
        torch.ones(B, S, args.rope_head_dim // 2, dtype=torch.complex64),
    )


def test_indexer_scores_follow_relu_weighted_formula():
    args, idx = _indexer()
    B, S, G = 2, 5, 7
    x = torch.randn(B, S, args.dim)
    qr = torch.randn(B, S, args.q_lora_rank)
    k = torch.randn(B, G, args.index_head_dim)
    freqs = torch.polar(torch.ones(B, S, args.rope_head_dim // 2), torch.rand(B, S, args.rope_head_dim // 2))
    got = idx.scores(x, qr, k, freqs, qat=False)
    from model.rope import apply_rotary_emb

    q = apply_rotary_emb(idx.wq_b(qr).view(B, S, args.index_n_heads, args.index_head_dim), freqs)
    w = idx.weights_proj(x) * args.index_head_dim**-0.5 * args.index_n_heads**-0.5
    want = torch.zeros(B, S, G)
    for h in range(args.index_n_heads):
        want += (q[:, :, h] @ k.transpose(1, 2)).relu() * w[:, :, h, None]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_indexer_all_zero_scores_select_newest_visible_groups():
    args, idx = _indexer()
    torch.nn.init.zeros_(idx.wq_b.weight)  # every score is relu(0) * w = 0: all ties
    B, S, G = 1, 12, 12
    gl = build_incremental_layout(B, 0, S, args.window_size, 0, (1,), 4, torch.device("cpu")).groups[1]
    out = idx(*_inputs(args, B, S, G), gl.visible, qat=True)
    k = args.index_topk
    for s in range(S):
        want = sorted(range(max(0, s + 1 - k), s + 1))
        row = out.topk_idxs[0, s].tolist()
        assert [i for i in row if i >= 0] == want, (s, row)
        assert row.count(-1) == k - len(want)


def test_reindex_layer_scores_only_inside_candidates():
    args = get_flavor("debug")
    reindex = [i for i in range(args.n_layers) if args.layer_role(i) == "reindex"][0]
    _, idx = _indexer(reindex)
    assert idx.uses_candidates and not idx.owns_k
    B, S, G = 1, 6, 6
    visible = torch.ones(B, S, G, dtype=torch.bool)
    cand = torch.zeros(B, S, G, dtype=torch.bool)
    cand[..., 1] = cand[..., 4] = True
    out = idx(*_inputs(args, B, S, G), visible, qat=False, candidates_BSG=cand)
    for s in range(S):
        assert sorted(i for i in out.topk_idxs[0, s].tolist() if i >= 0) == [1, 4]


def test_training_scores_chunked_exact_and_gathered_close():
    """The torch training path: `causal_index_scores` has the dense reference's mask exactly and its
    values up to fp32 summation order (the same einsums on slices of queries and groups, which the CPU
    BLAS may run with another kernel: seen 1 ulp apart on one Xeon); `gathered_index_scores` equals it
    at the picks and gives the same gradients up to fp32 summation order (dot products of 16-64 terms,
    sums of 4 heads: 1e-5 relative bounds the reassociation with margin)."""
    from model.indexer import causal_index_scores, gathered_index_scores, index_scores_ref

    g = torch.Generator().manual_seed(0)
    B, S, I, D = 2, 300, 4, 32
    doc = torch.tensor([[0] * 130 + [1] * 170, [0] * 300])
    gl = build_packed_layout(doc, 16, (2,), 4).groups[2]
    G = gl.visible.size(-1)
    q = torch.randn(B, S, I, D, generator=g, requires_grad=True)
    k = torch.randn(B, G, D, generator=g, requires_grad=True)
    w = torch.randn(B, S, I, generator=g, requires_grad=True)
    dense = index_scores_ref(q, k, w, gl.visible)
    seen = dense.detach() > -torch.inf
    for chunk in (1, 7, 128, S):  # chunk 1: the first queries see 0-1 groups (the narrowest ranges)
        scores = causal_index_scores(q, k, w, gl.visible, chunk=chunk)
        assert torch.equal(scores > -torch.inf, seen), chunk
        torch.testing.assert_close(scores[seen], dense.detach()[seen], rtol=1e-5, atol=1e-5, msg=f"chunk {chunk}")
    _, idx = topk_indices(dense.detach(), 8)
    idx = torch.where(dense.detach().gather(-1, idx) > -torch.inf, idx, -1)
    valid = idx >= 0
    got = gathered_index_scores(q, k, w, idx)
    want = dense.gather(-1, idx.clamp(min=0))
    torch.testing.assert_close(got[valid], want[valid], rtol=1e-5, atol=1e-5)
    weight = torch.randn(B, S, 8, generator=g) * valid
    grads_got = torch.autograd.grad((got.masked_fill(~valid, 0) * weight).sum(), (q, k, w))
    grads_want = torch.autograd.grad((want.masked_fill(~valid, 0) * weight).sum(), (q, k, w))
    for a, b in zip(grads_got, grads_want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
