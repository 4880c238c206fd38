"""sparse_attn_ref (sink, invalid rows), window indices, and the per-call layouts."""

import math

import pytest
import torch

from model.attention import (
    IndexerOutput,
    build_incremental_layout,
    build_packed_layout,
    indexer_alignment_loss,
    sparse_attn_probs_ref,
    sparse_attn_ref,
    window_topk_idxs,
    windowed_sparse_attn,
)

CPU = torch.device("cpu")


def _naive(q, kv, sink, idxs, scale):
    B, M, H, D = q.shape
    out = torch.zeros(B, M, H, D, dtype=torch.float64)
    for b in range(B):
        for m in range(M):
            sel = [i for i in idxs[b, m].tolist() if i >= 0]
            for h in range(H):
                if not sel:
                    continue
                ls = [scale * float(q[b, m, h].double() @ kv[b, i].double()) for i in sel]
                den = sum(math.exp(v) for v in ls) + math.exp(float(sink[h]))
                for v, i in zip(ls, sel):
                    out[b, m, h] += math.exp(v) / den * kv[b, i].double()
    return out


@pytest.mark.numerics
def test_sparse_attn_matches_naive_with_sink_and_invalid_rows():
    torch.manual_seed(0)
    B, M, H, N, D, K = 2, 3, 4, 9, 16, 5
    q, kv = torch.randn(B, M, H, D), torch.randn(B, N, D)
    sink = torch.randn(H)
    idxs = torch.randint(0, N, (B, M, K))
    idxs[0, 1, 2:] = -1
    idxs[1, 2] = -1  # no valid index at all -> zeros
    idxs[1, 0, 1] = idxs[1, 0, 0]  # duplicates count twice, as in the reference (no dedup)
    got = sparse_attn_ref(q, kv, sink, idxs, 0.25)
    # fp32 against fp64: each output is a softmax-weighted mean of randn rows (|v| < ~4), so its fp32
    # rounding is a few ulp of 4, ~1e-6 at most, whichever kernels sum it (measured <= 6.7e-7 under
    # ATEN_CPU_CAPABILITY=default/avx2/avx512 and MKL AVX2, against the former atol 1e-6)
    torch.testing.assert_close(got.double(), _naive(q, kv, sink, idxs, 0.25), rtol=1e-5, atol=4e-6)
    assert (got[1, 2] == 0).all()


def test_sink_is_unscaled_and_only_in_denominator():
    q, kv = torch.ones(1, 1, 1, 4), torch.full((1, 1, 4), 0.5)
    idxs = torch.zeros(1, 1, 1, dtype=torch.long)
    scale, sink = 0.1, torch.tensor([1.3])
    l = scale * 2.0
    want = math.exp(l) / (math.exp(l) + math.exp(1.3)) * 0.5
    torch.testing.assert_close(sparse_attn_ref(q, kv, sink, idxs, scale), torch.full((1, 1, 1, 4), want))
    p = sparse_attn_probs_ref(q, kv, sink, idxs, scale)
    assert abs(float(p) - want / 0.5) < 1e-6


def test_sparse_attn_gradients_flow_to_q_kv_and_sink():
    torch.manual_seed(1)
    q = torch.randn(1, 4, 2, 8, requires_grad=True)
    kv = torch.randn(1, 6, 8, requires_grad=True)
    sink = torch.zeros(2, requires_grad=True)
    idxs = torch.tensor([[[0, 1, -1], [2, 3, 4], [-1, -1, -1], [5, 0, 1]]])
    sparse_attn_ref(q, kv, sink, idxs, 0.3).square().sum().backward()
    assert q.grad.abs().sum() > 0 and kv.grad.abs().sum() > 0 and sink.grad.abs().sum() > 0
    assert torch.isfinite(q.grad).all() and (q.grad[0, 2] == 0).all()


def test_window_idxs_prefill_match_reference_sets():
    W, S = 4, 7
    idx = window_topk_idxs(torch.arange(S)[None], torch.zeros(1, S, dtype=torch.long), W)[0]
    for s in range(S):  # reference: max(0, s-W+1) .. s
        assert sorted(i for i in idx[s].tolist() if i >= 0) == list(range(max(0, s - W + 1), s + 1))


def test_window_idxs_stop_at_document_start_and_shift_by_base():
    doc = torch.tensor([[5, 5, 5, 9, 9]])
    lay = build_packed_layout(doc, 3, (), 1)
    assert lay.win_idxs[0].tolist() == [[-1, -1, 0], [-1, 0, 1], [0, 1, 2], [-1, -1, 3], [-1, 3, 4]]
    assert lay.q_pos[0].tolist() == [0, 1, 2, 0, 1]
    inc = build_incremental_layout(1, 10, 2, 3, 8, (), 1, CPU)  # window rows start at token 8
    assert inc.win_idxs[0].tolist() == [[0, 1, 2], [1, 2, 3]]


def test_incremental_layout_equals_packed_layout_rows():
    S, W, bs = 11, 4, 2
    full = build_packed_layout(torch.zeros(1, S, dtype=torch.long), W, (1, 2), bs)
    for start, n in ((0, 3), (3, 1), (4, 4), (8, 3), (5, 6)):
        inc = build_incremental_layout(1, start, n, W, 0, (1, 2), bs, CPU)
        assert torch.equal(inc.q_pos, full.q_pos[:, start : start + n])
        assert torch.equal(inc.win_idxs, full.win_idxs[:, start : start + n])
        for r in (1, 2):
            gi, gf = inc.groups[r], full.groups[r]
            G = gi.visible.size(-1)
            assert G == (start + n) // r
            assert torch.equal(gi.visible, gf.visible[:, start : start + n, :G])
            assert not gf.visible[:, start : start + n, G:].any()
            assert torch.equal(gi.newest, gf.newest[:, start : start + n])
            assert torch.equal(gi.block_id, gf.block_id[:, :G])
            assert gi.contiguous_block_size == gf.contiguous_block_size == bs
            assert gi.anchor_pos.tolist() == [[(start // r + j) * r for j in range(gi.anchor_pos.size(1))]]


def test_blocks_are_contiguous_only_with_one_document_per_row():
    """contiguous_block_size (block_id == g // bs, which the Triton Reindex path needs) is bs for
    incremental calls and single-document packed rows, 0 where blocks restart per document."""
    one = build_packed_layout(torch.zeros(2, 9, dtype=torch.long), 4, (1, 2), 4)
    assert [one.groups[r].contiguous_block_size for r in (1, 2)] == [4, 4]
    two = build_packed_layout(torch.tensor([[0] * 6 + [1] * 5]), 4, (1,), 4).groups[1]
    assert two.block_id[0].tolist() == [0, 0, 0, 0, 1, 1, 2, 2, 2, 2, 3]
    assert two.contiguous_block_size == 0
    assert build_incremental_layout(1, 5, 3, 4, 0, (1,), 4, CPU).groups[1].contiguous_block_size == 4


def test_ratio2_group_visible_only_when_complete_odd_and_even():
    lay = build_packed_layout(torch.zeros(1, 6, dtype=torch.long), 4, (2,), 1).groups[2]
    # group j = tokens 2j, 2j+1: visible from query 2j+1 on
    assert lay.visible[0].int().tolist() == [[0, 0, 0], [1, 0, 0], [1, 0, 0], [1, 1, 0], [1, 1, 0], [1, 1, 1]]


def test_indexer_alignment_loss_zero_iff_distributions_match():
    # one query, one head, window of 1 entry + 3 selected compressed entries
    probs = torch.tensor([[[[0.1, 0.2, 0.3, 0.4]]]])
    idxs = torch.tensor([[[0, 2, 5]]])
    target = torch.tensor([0.2, 0.3, 0.4]) / 0.9
    scores = torch.full((1, 1, 6), -torch.inf)
    scores[0, 0, [0, 2, 5]] = target.log()
    scores.requires_grad_(True)
    loss = indexer_alignment_loss(IndexerOutput(idxs, scores, topk_scores=scores.gather(-1, idxs)), probs[..., 1:])
    assert abs(loss.item()) < 1e-6
    flat = torch.zeros(1, 1, 6, requires_grad=True)
    loss = indexer_alignment_loss(IndexerOutput(idxs, flat, topk_scores=flat.gather(-1, idxs)), probs[..., 1:])
    loss.backward()
    kl = float((target * (target / (1 / 3)).log()).sum())
    assert abs(loss.item() - kl) < 1e-6
    assert flat.grad[0, 0, [1, 3, 4]].abs().sum() == 0 and flat.grad.abs().sum() > 0


def _concat_ref(q, kv_win, win_idxs, sink, scale, ckv, cidx):
    T = kv_win.size(1)
    idxs = torch.cat([win_idxs, torch.where(cidx >= 0, cidx + T, -1)], -1)
    return sparse_attn_ref(q, torch.cat([kv_win, ckv], 1), sink, idxs, scale)


@pytest.mark.numerics
def test_windowed_sparse_attn_equals_reference_packed_and_incremental():
    torch.manual_seed(2)
    H, D, W, G, Kc = 3, 16, 4, 6, 3
    sink = torch.randn(H)
    ckv = torch.randn(2, G, D)
    cases = [  # (layout, rows of window KV)
        (build_packed_layout(torch.tensor([[0] * 5 + [1] * 6, [0] * 11]), W, (), 1), 11),
        (build_incremental_layout(2, 9, 5, W, 6, (), 1, CPU), 8),  # tail of 3 cached rows + 5 new
        (build_incremental_layout(2, 9, 1, W, 6, (), 1, CPU), 4),  # one-token decode
        (build_incremental_layout(2, 0, 2, W, 0, (), 1, CPU), 2),  # prefill shorter than the window
    ]
    for lay, T in cases:
        S = lay.win_idxs.size(1)
        q = torch.randn(2, S, H, D, requires_grad=True)
        kv = torch.randn(2, T, D, requires_grad=True)
        cidx = torch.randint(-1, G, (2, S, Kc))
        got, p_comp = windowed_sparse_attn(q, kv, lay.win_lo, lay.win_idxs, sink, 0.3, ckv, cidx)
        want = _concat_ref(q, kv, lay.win_idxs, sink, 0.3, ckv, cidx)
        # two fp32 orders of one softmax-weighted mean of randn rows (window and compressed parts merged
        # vs one softmax): a few ulp of |v| < ~4 (measured <= 6e-7 under 4 CPU kernel paths; was 1e-6)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=4e-6)
        idxs = torch.cat([lay.win_idxs, torch.where(cidx >= 0, cidx + T, -1)], -1)
        probs = sparse_attn_probs_ref(q, torch.cat([kv, ckv], 1), sink, idxs, 0.3)
        torch.testing.assert_close(p_comp, probs[..., W:], rtol=1e-5, atol=1e-6)
        g1 = torch.autograd.grad(got.square().sum(), (q, kv))
        g2 = torch.autograd.grad(want.square().sum(), (q, kv))
        for a, b in zip(g1, g2):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def _spec_full_layer(attn, x, args, layer_id):
    """A Full layer's prefill at start_pos 0 written straight from model_reference §3.4-3.6 (one
    document, reference window indices, reference pooling/anchors/offsets), using flashpost's tie
    rule for the indexer top-k (DESIGN.md §2)."""
    from model.indexer import topk_indices
    from model.quant import fp4_e4m3_fake_quant, fp8_fake_quant, mxfp4_fake_quant
    from model.rope import apply_rotary_emb, rope_tables_for_layer

    S, r, W, H, Dh = x.size(1), args.compress_ratio(layer_id), args.window_size, args.n_heads, args.head_dim
    freqs = rope_tables_for_layer(args, layer_id)[:S]
    qr = attn.q_norm(attn.wq_a(x))
    q = apply_rotary_emb(attn.wq_b(qr).view(1, S, H, Dh), freqs)
    kv = fp8_fake_quant(apply_rotary_emb(attn.kv_norm(attn.wkv(x)), freqs))
    end = torch.arange(S).unsqueeze(1)
    win = (end - W + 1).clamp(0) + torch.arange(min(S, W))
    win = torch.where(win > end, -1, win)
    comp = attn.compressor
    if r == 1:
        latent = comp.norm(comp.wkv(x))
    else:
        cut = S - S % r
        kvc, sc = comp.wkv(x.float())[:, :cut], comp.wgate(x.float())[:, :cut]
        kvc, sc = kvc.unflatten(1, (-1, r)), sc.unflatten(1, (-1, r))
        latent = comp.norm((kvc * sc.softmax(dim=2)).sum(dim=2).to(x.dtype))
    anchors = freqs[: S - S % r : r]
    idx = attn.indexer
    k = mxfp4_fake_quant(apply_rotary_emb(idx.k_norm(idx.wk(latent)), anchors))
    qi = mxfp4_fake_quant(apply_rotary_emb(idx.wq_b(qr).view(1, S, args.index_n_heads, -1), freqs))
    w = idx.weights_proj(x) * args.index_head_dim**-0.5 * args.index_n_heads**-0.5
    score = (torch.einsum("bshd,btd->bsht", qi, k).relu() * w.unsqueeze(-1)).sum(dim=2)
    lens = (torch.arange(1, S + 1) // r).unsqueeze(-1)
    score = score.masked_fill(torch.arange(S // r) >= lens, -torch.inf)
    top = topk_indices(score, min(args.index_topk, S // r))[1].sort(dim=-1).values
    cidx = torch.where(top < lens, top + S, -1)
    ckv = fp4_e4m3_fake_quant(apply_rotary_emb(latent, anchors))
    o = sparse_attn_ref(q, torch.cat([kv, ckv], 1), attn.attn_sink, torch.cat([win[None], cidx], -1), Dh**-0.5)
    o = apply_rotary_emb(o, freqs, inverse=True).view(1, S, args.o_groups, -1)
    o = torch.einsum("bsgd,grd->bsgr", o, attn.wo_a.weight.view(args.o_groups, args.o_lora_rank, -1))
    return attn.wo_b(o.flatten(2))


def test_full_layers_follow_the_reference_prefill_semantics():
    from model.config import get_flavor
    from model.transformer import Transformer

    model = Transformer(get_flavor("debug"))
    model.init_weights(std=0.1)
    a = model.args
    torch.manual_seed(3)
    for S in (21, 30):  # odd and even: a trailing half group stays out
        x = torch.randn(1, S, a.dim)
        lay = build_packed_layout(torch.zeros(1, S, dtype=torch.long), a.window_size, model.ratios, 4)
        for layer_id in a.kv_source_layers:
            ctx = model._context(lay, indexer_loss=False)
            with torch.no_grad():
                got = model.layers[layer_id].attn(x, ctx)
                want = _spec_full_layer(model.layers[layer_id].attn, x, a, layer_id)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=f"layer {layer_id} S {S}")


@pytest.mark.parametrize("S", [1, 3, 40])  # S·K below and above the bank's 64 groups
def test_selected_compressed_rows_attend_as_the_whole_bank(S):
    """The fused kernel's KV tensor with only the selected compressed rows appended (decode) gives
    the attention of the whole bank appended, bit for bit (same rows, same order per query)."""
    from model.attention import _with_compressed

    g = torch.Generator().manual_seed(0)
    B, T, G, H, Dh, K = 2, 9, 64, 4, 16, 5
    q, kv = torch.randn(B, S, H, Dh, generator=g), torch.randn(B, T, Dh, generator=g)
    ckv, sink = torch.randn(B, G, Dh, generator=g), torch.randn(H, generator=g)
    win = torch.randint(-1, T, (B, S, 7), generator=g)
    cidx = torch.randint(-1, G, (B, S, K), generator=g)
    kv_all, cidx_all = _with_compressed(kv, ckv, cidx)
    got = sparse_attn_ref(q, kv_all, sink, torch.cat([win, cidx_all], -1), 0.25)
    full = torch.cat([win, torch.where(cidx >= 0, cidx + T, -1)], -1)
    want = sparse_attn_ref(q, torch.cat([kv, ckv], 1), sink, full, 0.25)
    assert torch.equal(got, want)
    assert kv_all.size(1) == (T + S * K if S * K < G else T + G)
