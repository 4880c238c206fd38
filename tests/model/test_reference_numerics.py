"""numerics="reference": the released inference code's arithmetic, piece by piece and end to end.

The bit-for-bit comparison against the released code itself is a recipe run outside the repository
(docs/reference_parity.md); these tests pin what that comparison relies on, on self-made weights:
the kernel's blocked bf16-probability attention, its index-list layout, bf16 indexer scores with
torch.topk picks, and that the option changes nothing unless chosen.
"""

import dataclasses

import pytest
import torch

from model.attention import (
    REFERENCE_ATTN_BLOCK,
    reference_window_idxs,
    sparse_attn_blocked_ref,
    sparse_attn_ref,
    window_topk_idxs,
)
from model.config import ModelArgs, get_flavor
from model.indexer import Indexer, candidate_block_ids, torch_topk
from model.transformer import ModelCache, Transformer


def _attn_inputs(seed: int, M: int = 3, H: int = 4, N: int = 150, K: int = 140, Dh: int = 32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, M, H, Dh, generator=g).bfloat16()
    kv = torch.randn(2, N, Dh, generator=g).bfloat16()
    sink = torch.randn(H, generator=g)
    idxs = torch.randint(0, N, (2, M, K), generator=g)
    idxs[torch.rand(2, M, K, generator=g) < 0.2] = -1
    return q, kv, sink, idxs


def test_blocked_attention_is_the_fp32_attention_up_to_bf16_probabilities():
    q, kv, sink, idxs = _attn_inputs(0)
    o = sparse_attn_blocked_ref(q, kv, sink, idxs, 32**-0.5)
    ref = sparse_attn_ref(q, kv, sink, idxs, 32**-0.5)
    # p in [0, 1] rounded to bf16 (relative error 2^-9) before P·V, output rounded to bf16
    assert o.dtype == torch.bfloat16
    assert (o.float() - ref.float()).abs().max() <= 4e-3 * ref.float().abs().max()


def test_blocked_attention_rounds_probabilities_per_block_of_64():
    """One block (K <= 64): o = bf16(exp(l - m))·V / (sum exp(l - m) + exp(sink - m)), m the row max."""
    q, kv, sink, idxs = _attn_inputs(1, K=REFERENCE_ATTN_BLOCK)
    scale = 32**-0.5
    valid = idxs >= 0
    rows = kv.float()[torch.arange(2)[:, None, None], idxs.clamp(min=0)] * valid[..., None]
    logits = torch.einsum("bmhd,bmkd->bmhk", q.float(), rows).masked_fill(~valid[:, :, None], -torch.inf) * scale
    m = logits.amax(-1).clamp(min=-1e30)
    p = torch.exp(logits - m[..., None])
    num = torch.einsum("bmhk,bmkd->bmhd", p.bfloat16().float(), rows)
    want = (num / (p.sum(-1) + torch.exp(sink - m))[..., None]).bfloat16()
    got = sparse_attn_blocked_ref(q, kv, sink, idxs, scale)
    # same operations in the same order, but einsum may pick its own reduction order: 1 bf16 ulp
    assert ((got.float() - want.float()).abs() <= want.float().abs() * 2**-8 + 1e-6).all()
    # and a row with no valid index gives 0
    idxs[0, 0] = -1
    assert torch.equal(sparse_attn_blocked_ref(q, kv, sink, idxs, scale)[0, 0], torch.zeros_like(q[0, 0]))


def test_reference_window_layout_prefill_valid_first_decode_ring_order():
    W, S = 4, 6
    pos = torch.arange(S)[None]
    flash = window_topk_idxs(pos, torch.zeros_like(pos), W)
    got = reference_window_idxs(flash, pos)
    # the released prefill: (s - W + 1).clamp(0) + arange(min(S, W)), -1 past s
    end = torch.arange(S)[:, None]
    want = (end - W + 1).clamp(0) + torch.arange(min(S, W))
    assert torch.equal(got[0], torch.where(want > end, -1, want))
    short = window_topk_idxs(pos[:, :2], torch.zeros_like(pos[:, :2]), W)
    assert reference_window_idxs(short, pos[:, :2]).shape[-1] == 2  # min(S, W) wide
    # a decode step (its query is not at position 0) keeps the ring order, -1 first
    q_abs = torch.tensor([[2]])
    dec = window_topk_idxs(q_abs, torch.zeros_like(q_abs), W)
    assert torch.equal(reference_window_idxs(dec, q_abs), dec)
    assert dec.tolist() == [[[-1, 0, 1, 2]]]


def _indexer(numerics: str, **kw) -> tuple[Indexer, ModelArgs]:
    args = dataclasses.replace(get_flavor("debug"), numerics=numerics, **kw)
    layer = args.index_source_layers[0]
    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        return Indexer(args, layer).eval(), args
    finally:
        torch.set_default_dtype(prev)


def test_reference_indexer_scores_in_bf16_and_picks_with_torch_topk():
    ix, args = _indexer("reference", index_topk=4)
    B, S, G = 1, 9, 9
    g = torch.Generator().manual_seed(2)
    x = torch.randn(B, S, args.dim, generator=g).bfloat16()
    qr = torch.randn(B, S, args.q_lora_rank, generator=g).bfloat16()
    k = torch.randn(B, G, args.index_head_dim, generator=g).bfloat16()
    freqs = torch.polar(torch.ones(S, args.rope_head_dim // 2), torch.zeros(S, args.rope_head_dim // 2))
    visible = torch.ones(S, G, dtype=torch.bool).tril()[None]
    with torch.no_grad():
        out = ix(x, qr, k, freqs, visible, qat=True)
    assert out.scores.dtype == torch.bfloat16
    picks = out.scores.topk(4, dim=-1, sorted=False).indices.sort(dim=-1).values
    assert torch.equal(out.topk_idxs, torch.where(visible.gather(-1, picks), picks, -1))
    # query 0 sees one group: its pick first, the three unreachable picks -1 after it
    assert out.topk_idxs[0, 0].tolist() == [0, -1, -1, -1]


def test_reference_candidate_blocks_use_torch_topk_ties():
    # all four blocks tie: torch.topk's order picks, the newer-wins rule would keep blocks 2 and 3
    scores = torch.zeros(1, 1, 8)
    block_id = (torch.arange(8) // 2)[None]
    newest = torch.tensor([[-1]])
    ref = candidate_block_ids(scores, block_id, 4, newest, 2, torch_topk)
    assert torch.equal(ref, torch.zeros(1, 1, 4).topk(2, dim=-1).indices.sort(dim=-1).values)
    assert candidate_block_ids(scores, block_id, 4, newest, 2).tolist() == [[[2, 3]]]


def _model(numerics: str) -> Transformer:
    args = dataclasses.replace(get_flavor("debug"), engram_layer_ids=(), engram_num_embeddings=(), numerics=numerics)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = Transformer(args).eval()
    finally:
        torch.set_default_dtype(prev)
    model.init_weights(seed=4, std=0.1)
    return model


@pytest.fixture(scope="module")
def models() -> dict[str, Transformer]:
    ref, flash = _model("reference"), _model("flashpost")
    flash.load_state_dict(ref.state_dict())
    return {"reference": ref, "flashpost": flash}


@torch.no_grad()
def _prefill_decode_draft(model: Transformer, ids: torch.Tensor, S: int):
    cache = ModelCache()
    logits, mh = model.forward_incremental(ids[:, :S], 0, cache, return_main_hidden=True)
    out = [logits[:, -1]]
    drafts = []
    for i in range(S, ids.size(1) - 1):
        logits, step_mh = model.forward_incremental(ids[:, i : i + 1], i, cache, return_main_hidden=True)
        out.append(logits[:, -1])
        drafts.append(model.draft_step(ids[:, i + 1], torch.cat([mh, step_mh], 1), cache).logits)
        mh = step_mh[:, :0]
    return torch.stack(out, 1), torch.stack(drafts, 1)


def test_reference_numerics_runs_prefill_decode_and_drafts_near_flashpost(models):
    """Same weights, both options. They differ by bf16 roundings and the top-k ties they break
    differently (ReLU'd index scores tie at 0 often), which moves single logits by up to ~1 on this
    small model: a mean relative difference of ~6%, bounded here with a 3x margin. W is small, so
    decode wraps the window ring and the drafter's ring-slot order matters."""
    ids = torch.randint(0, 512, (1, 48), generator=torch.Generator().manual_seed(5))
    S = 30
    ref_logits, ref_drafts = _prefill_decode_draft(models["reference"], ids, S)
    fp_logits, fp_drafts = _prefill_decode_draft(models["flashpost"], ids, S)
    assert torch.isfinite(ref_logits).all() and torch.isfinite(ref_drafts).all()
    for a, b in ((ref_logits, fp_logits), (ref_drafts, fp_drafts)):
        assert (a - b).abs().mean() <= 0.2 * b.abs().mean()
        assert not torch.equal(a, b)  # the option does change the arithmetic


def test_reference_numerics_teacher_forced_forward_matches_its_prefill(models):
    """A packed teacher-forced row runs the same index layout as a prefill at position 0, so its
    last-position hidden state equals the prefill's bit for bit (one row, same shapes)."""
    model = models["reference"]
    ids = torch.randint(0, 512, (1, 40), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        tf = model(ids, compute_indexer_loss=False).hidden
    assert torch.equal(tf, _last_hidden(model, ids))


def _last_hidden(model: Transformer, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        cache = ModelCache()
        enc = model.encode_incremental(ids, 0, cache)
        model.run_layers(enc.streams, range(model.args.n_encoder_layers, model.args.n_layers), enc.ctx,
                         cache.layers, enc.image_mask, enc.engram_inputs)  # fmt: skip
        return model.collapse(enc.streams)[0]
