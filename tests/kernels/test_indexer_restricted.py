"""Reindex layers with impl="triton" at inference score only the candidate pool
(`kernels.indexer.index_scores_restricted`): the same picks as the dense, pool-masked scores, ties
included; the dense path stays for gradients, the alignment loss and non-contiguous blocks.

Ties are made exact (integer q and k, so every per-head dot is exact in any summation order), so
"same picks" tests the tie rule and not rounding. CPU runs use TRITON_INTERPRET=1
(tests/kernels/conftest.py); `-m gpu` runs the same tests compiled on CUDA.
"""

import pytest
import torch

from model.attention import build_incremental_layout
from model.config import get_flavor
from model.indexer import Indexer, candidate_block_ids, candidate_mask

ARGS = {impl: get_flavor("debug", impl=impl) for impl in ("torch", "triton")}
REINDEX = [i for i in range(ARGS["torch"].n_layers) if ARGS["torch"].layer_role(i) == "reindex"]
BS = ARGS["torch"].candidate_block_size


def _indexers(device):
    """The debug model's Reindex indexer in both impls, same weights: integer wq_b (exact dots for
    integer qr), two of four heads weighted 0 (more all-ReLU-zero scores: ties)."""
    g = torch.Generator().manual_seed(0)
    state = None
    out = {}
    for impl, args in ARGS.items():
        idx = Indexer(args, REINDEX[0])
        if state is None:
            idx.wq_b.weight.data = torch.randint(-2, 3, idx.wq_b.weight.shape, generator=g).float()
            idx.weights_proj.weight.data = torch.randn(idx.weights_proj.weight.shape, generator=g)
            idx.weights_proj.weight.data[:2] = 0
            state = idx.state_dict()
        idx.load_state_dict(state)
        out[impl] = idx.to(device)
    assert out["triton"].index_scores_restricted is not None and out["torch"].index_scores_restricted is None
    return out


def _call(args, B, start_pos, S, topk_blocks, device, seed):
    """Positional inputs and keyword arguments of a Reindex call after `start_pos` cached tokens,
    with a candidate pool from random candidate-source scores. Integer qr and keys, some keys
    duplicated (equal nonzero scores) and one query row zero (all scores 0)."""
    g = torch.Generator().manual_seed(seed)
    gl = build_incremental_layout(B, start_pos, S, args.window_size, 0, (1,), BS, torch.device(device)).groups[1]
    G = gl.visible.size(-1)
    qr = torch.randint(-2, 3, (B, S, args.q_lora_rank), generator=g).float()
    qr[0, -1] = 0
    k = torch.randint(-2, 3, (B, G, args.index_head_dim), generator=g).float()
    k[:, 1::2] = k[:, 0 : G - G % 2 : 2]  # groups 2j, 2j+1 score alike: the newer must win at a cut
    src = torch.randn(B, S, G, generator=g).to(device).masked_fill(~gl.visible, -torch.inf)
    blocks = candidate_block_ids(src, gl.block_id, gl.n_blocks, gl.newest, topk_blocks)
    inputs = (
        torch.randn(B, S, args.dim, generator=g).to(device),
        qr.to(device),
        k.to(device),
        torch.ones(B, S, args.rope_head_dim // 2, dtype=torch.complex64, device=device),  # identity RoPE
        gl.visible,
    )
    kw = {
        "qat": False,
        "candidates_BSG": candidate_mask(blocks, gl.block_id, gl.n_blocks),
        "candidate_blocks_BSC": blocks,
        "contiguous_block_size": gl.contiguous_block_size,
        "need_scores": False,
    }
    return inputs, kw


@pytest.mark.parametrize(
    "B,start_pos,S,topk_blocks",
    [
        (2, 0, 40, 3),  # prefill: pool of 12 groups of up to 40, index_topk 8
        (2, 59, 1, 3),  # decode over 60 groups
        (1, 3, 9, 1),  # one block (4 groups) < index_topk: the dense path's extra -1 columns
    ],
)
def test_restricted_picks_equal_dense_picks_with_ties(device, B, start_pos, S, topk_blocks):
    idx = _indexers(device)
    inputs, kw = _call(ARGS["torch"], B, start_pos, S, topk_blocks, device, seed=1)
    with torch.no_grad():
        want = idx["torch"](*inputs, **kw)  # torch impl: always dense
        dense = idx["triton"](*inputs, **{**kw, "need_scores": True})
        got = idx["triton"](*inputs, **kw)
    assert want.scores is not None and dense.scores is not None and got.scores is None
    assert got.candidates is None and got.candidate_blocks is None
    assert got.topk_idxs.shape == want.topk_idxs.shape and got.topk_idxs.dtype == want.topk_idxs.dtype
    assert torch.equal(got.topk_idxs, want.topk_idxs)
    assert torch.equal(dense.topk_idxs, want.topk_idxs)
    # not vacuous: the pool hides visible groups, and a tie straddles the top-k cut somewhere
    assert (inputs[4] & ~kw["candidates_BSG"]).any()  # visible groups outside the pool
    K = want.topk_idxs.size(-1)
    vals = want.scores.sort(-1, descending=True).values
    finite = vals > -torch.inf
    cut_tie = (vals[..., K - 1] == vals[..., K]) & finite[..., K] if vals.size(-1) > K else finite[..., :0]
    assert topk_blocks == 1 or bool(cut_tie.any())


def test_restricted_path_only_without_gradient_or_dense_consumers(device):
    """Grad-enabled calls with trainable weights, callers that need the scores (the alignment loss),
    non-contiguous blocks and a missing block list keep the dense path (scores returned)."""
    idx = _indexers(device)["triton"]
    inputs, kw = _call(ARGS["triton"], 1, 0, 20, 3, device, seed=2)
    with torch.no_grad():
        want = idx(*inputs, **kw)
    assert want.scores is None

    def dense(**over):
        out = idx(*inputs, **{**kw, **over})
        assert torch.equal(out.topk_idxs, want.topk_idxs)
        return out.scores is not None

    assert dense()  # grad enabled, trainable weights: the indexer trains through dense scores
    with torch.no_grad():
        assert dense(need_scores=True)
        assert dense(contiguous_block_size=0)  # packed rows whose blocks restart per document
        assert dense(contiguous_block_size=2 * BS)  # blocks of another size than the model's
        assert dense(candidate_blocks_BSC=None)
    idx.requires_grad_(False)
    assert not dense()  # grad enabled, nothing requires it
    assert dense(need_scores=True)


def _model(debug_model, impl, device, zero_heads=True):
    model = debug_model(impl, seed=1)
    if zero_heads:  # Reindex heads 0..2 weighted 0: many all-ReLU-zero scores, ties at the cut
        for i in REINDEX:
            model.layers[i].attn.indexer.weights_proj.weight.data[:3] = 0
    return model.to(device).eval()


def _record(model, calls, monkeypatch=None):
    """Hook every indexer: calls[layer] gets (topk_idxs, scores is None) per call. With
    `monkeypatch`, the dense score op of Reindex layers raises, so any dense [B,S,G] scoring fails."""

    def no_dense(*a, **k):
        raise AssertionError("a Reindex layer built the dense score matrix")

    for i, layer in enumerate(model.layers):
        ix = layer.attn.indexer
        if ix is None:
            continue
        calls[i] = []
        ix.register_forward_hook(lambda m, a, o, i=i: calls[i].append((o.topk_idxs, o.scores is None)))
        if monkeypatch is not None and ix.uses_candidates:
            monkeypatch.setattr(ix, "index_scores", no_dense)


def test_model_no_grad_triton_picks_equal_torch(device, monkeypatch, debug_model):
    """The debug Transformer (candidate source 4, Reindex 6) teacher-forced without gradients: the
    Triton model's Reindex layer never builds dense scores and every index layer picks what the
    torch model picks, over 40 tokens (pool of 12 groups, index_topk 8)."""
    ids = torch.randint(0, 512, (1, 40), generator=torch.Generator().manual_seed(1)).to(device)
    runs = {}
    for impl in ("torch", "triton"):
        model, calls = _model(debug_model, impl, device), {}
        _record(model, calls, monkeypatch if impl == "triton" else None)
        pools = []
        src = model.layers[ARGS[impl].candidate_source_layer].attn.indexer
        src.register_forward_hook(lambda m, a, o, p=pools: p.append(o.candidates))
        with torch.no_grad():
            out = model(ids)
        runs[impl] = out.logits, calls, pools[0]
    (ref_logits, ref, src), (tri_logits, tri, _) = runs["torch"], runs["triton"]
    assert sorted(ref) == sorted(tri) and REINDEX[0] in tri
    for i in ref:
        (ref_idx, _), (tri_idx, restricted) = ref[i][0], tri[i][0]
        assert torch.equal(tri_idx, ref_idx), i
        assert restricted == (i in REINDEX), i
    assert (src.sum(-1) < torch.arange(1, 41, device=device)).any()  # the pool excludes groups
    tol = {"rtol": 1e-4, "atol": 1e-4} if device == "cpu" else {"rtol": 2e-3, "atol": 2e-3}
    torch.testing.assert_close(tri_logits, ref_logits, **tol)


def test_engine_greedy_decode_triton_equals_torch(device, monkeypatch, debug_model):
    """Incremental decode through the inference engine (prefill, then one token per call): the
    Triton model's Reindex layer takes the restricted path at every call, and the greedy tokens and
    every index layer's picks equal the torch model's."""
    from model.engine import InferenceEngine

    prompt = torch.randint(0, 512, (28,), generator=torch.Generator().manual_seed(2)).tolist()
    runs = {}
    for impl in ("torch", "triton"):
        model, calls = _model(debug_model, impl, device), {}
        _record(model, calls, monkeypatch if impl == "triton" else None)
        engine = InferenceEngine(model, None, max_sessions=1, device=device)
        sid = engine.start(prompt)
        runs[impl] = engine.generate([sid], max_new_tokens=3, stop_ids=())[0].token_ids, calls
    (ref_tokens, ref), (tri_tokens, tri) = runs["torch"], runs["triton"]
    assert tri_tokens == ref_tokens and len(ref_tokens) == 3
    for i in ref:
        assert len(tri[i]) == len(ref[i]) == 3, i  # prefill + 2 decode steps
        for (ref_idx, _), (tri_idx, restricted) in zip(ref[i], tri[i]):
            assert torch.equal(tri_idx, ref_idx), i
            assert restricted == (i in REINDEX), i
    assert [t.size(1) for t, _ in tri[REINDEX[0]]] == [28, 1, 1]
