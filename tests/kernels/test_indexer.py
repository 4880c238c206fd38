"""Parity of the Triton indexer scores (kernels/indexer.py) with the torch reference, and its wiring.

Scores agree with `index_scores_ref` up to fp32 summation order (16-bit products are exact in the fp32
accumulator); the backward feeds t = dscore·w·[dot > 0] to its dots in q's dtype, so bf16 gradients
agree to about a bf16 ulp of their scale. CPU runs use TRITON_INTERPRET=1 (tests/kernels/conftest.py);
`-m gpu` runs the same tests compiled on CUDA.
"""

import pytest
import torch
import torch.nn.functional as F

from kernels import indexer as ki
from model.indexer import select_candidate_blocks, top_candidate_blocks, topk_indices


def _inputs(B, S, I, Di, G, dtype, device, seed=0, causal=False):
    """q, k, w and a visibility mask with the awkward rows the model produces: a query that sees
    nothing, a head weight row of zeros, a zero query row."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, S, I, Di, generator=g).to(dtype)
    k = torch.randn(B, G, Di, generator=g).to(dtype)
    w = torch.randn(B, S, I, generator=g)
    if causal:  # query s sees groups g <= s·G/S, as prefill with ratio G/S does
        vis = (torch.arange(G)[None, :] * S <= torch.arange(S)[:, None] * G).expand(B, S, G).clone()
    else:
        vis = torch.rand(B, S, G, generator=g) < 0.7
    vis[0, 0] = False
    if S > 1:
        w[0, 1] = 0.0
        q[-1, -1] = 0
    return q.to(device), k.to(device), w.to(device), vis.to(device)


def _assert_scores(got, want, rel=1e-5):
    assert got.shape == want.shape and got.dtype == torch.float32
    inf = torch.isinf(want)
    assert torch.equal(torch.isinf(got), inf) and torch.equal(got[inf], want[inf])
    scale = want[~inf].abs().max().item() if (~inf).any() else 1.0
    err = (got[~inf] - want[~inf]).abs().max().item() if (~inf).any() else 0.0
    assert err <= rel * scale + 1e-6, (err, scale)


SHAPES = [
    (2, 37, 5, 32, 45),  # S and G not multiples of the tiles, I not a power of 2
    (1, 20, 6, 64, 70),
    (2, 1, 32, 128, 200),  # decode: one query, heads on the dot's M side
    (1, 3, 3, 128, 33),  # a few queries (speculative verify): queries padded to 16 dot rows
]


@pytest.mark.parametrize("B,S,I,Di,G", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scores_match_reference(device, B, S, I, Di, G, dtype):
    q, k, w, vis = _inputs(B, S, I, Di, G, dtype, device)
    want = ki.index_scores_ref(q, k, w, vis)
    _assert_scores(ki.index_scores(q, k, w, vis), want)
    _assert_scores(ki.index_scores(q, k, w), ki.index_scores_ref(q, k, w))  # no mask
    assert (want[0, 0] == -torch.inf).all()
    if S > 1:  # a zero weight row scores exactly 0 wherever visible
        row = ki.index_scores(q, k, w, vis)[0, 1]
        assert (row[vis[0, 1]] == 0).all()


def test_expanded_mask_and_tile_configs(device):
    """A broadcast (stride-0) mask needs no copy; every tile shape gives the same scores."""
    q, k, w, _ = _inputs(2, 24, 5, 64, 50, torch.bfloat16, device, seed=1)
    vis = (torch.rand(1, 24, 50, generator=torch.Generator().manual_seed(2)) < 0.5).to(device).expand(2, 24, 50)
    want = ki.index_scores_ref(q, k, w, vis)
    for cfg in ({"BS": 16, "HB": 4, "BG": 32}, {"BS": 1, "HB": 8, "BG": 64}, {"BS": 32, "HB": 1, "BG": 16}):
        _assert_scores(ki.index_scores_fwd(q, k, w, vis, config=cfg)[0], want)


@pytest.mark.parametrize("B,S,I,Di,G", [(2, 37, 5, 32, 45), (1, 20, 32, 128, 40)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_matches_reference(device, B, S, I, Di, G, dtype):
    """dq, dk, dw vs autograd through the reference; invisible entries pass no gradient."""
    q, k, w, vis = _inputs(B, S, I, Di, G, dtype, device, seed=3, causal=True)
    ins = [t.clone().requires_grad_() for t in (q, k, w)]
    d = torch.randn(B, S, G, generator=torch.Generator().manual_seed(4)).to(device)
    d[~vis] = 1e3  # large upstream gradient on masked entries must vanish, as masked_fill's does
    grads = torch.autograd.grad(ki.index_scores(*ins, vis), ins, d)
    grads_ref = torch.autograd.grad(ki.index_scores_ref(*ins, vis), ins, d)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for a, b in zip(grads, grads_ref):
        assert a.shape == b.shape and a.dtype == b.dtype
        err = (a.float() - b.float()).abs().max().item()
        assert err <= tol * b.float().abs().max().item() + 1e-6, err
    assert grads[2][0, 0].abs().max().item() == 0.0  # the query that sees nothing
    # the dk pass split over rows sums the same partials, in another order (one rounding of k's dtype)
    dq, dk, dw = ki.index_scores_bwd(q, k, w, vis, d, config={"dk_splits": 3})
    rtol = 1e-5 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(dk.float(), grads[1].float(), rtol=rtol, atol=1e-5)


def test_no_grad_call_takes_the_forward_alone(device):
    q, k, w, vis = _inputs(1, 5, 4, 64, 30, torch.bfloat16, device, seed=5)
    with torch.no_grad():
        s = ki.index_scores(q, k, w, vis)
    assert torch.equal(s, ki.index_scores_fwd(q, k, w, vis)[0])
    s_grad = ki.index_scores(q, k, w.requires_grad_(), vis)
    assert s_grad.requires_grad and torch.equal(s_grad.detach(), s)


@pytest.mark.parametrize("block_size", [4, 8])
def test_block_max_epilogue_gives_the_candidate_pool(device, block_size):
    """Block maxima of the epilogue == the scores' block maxima, and pinning + top-k over them in
    torch gives `select_candidate_blocks`' mask for the contiguous layout (incremental calls)."""
    B, S, G, topk_blocks = 2, 30, 30, 3  # G not a multiple of the block: the last block is partial
    q, k, w, _ = _inputs(B, S, 4, 32, G, torch.float32, device, seed=6)
    vis = (torch.arange(G, device=device) <= torch.arange(S, device=device)[:, None]).expand(B, S, G)
    score, bmax = ki.index_scores_with_block_max(q, k, w, vis, block_size)
    assert torch.equal(score, ki.index_scores(q, k, w, vis))
    assert torch.equal(bmax, ki.block_max_scores_ref(score, block_size))
    n_blocks = -(-G // block_size)
    newest = torch.arange(S, device=device).expand(B, S)
    block_id = (torch.arange(G, device=device) // block_size).expand(B, G)
    want = select_candidate_blocks(score, block_id, n_blocks, newest, topk_blocks)
    blk = top_candidate_blocks(bmax, newest // block_size, topk_blocks)
    keep = torch.zeros(B, S, n_blocks + 1, dtype=torch.bool, device=device)
    keep = keep.scatter(-1, torch.where(blk >= 0, blk, n_blocks), True)[..., :n_blocks]
    assert torch.equal(keep.repeat_interleave(block_size, -1)[..., :G], want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_restricted_scores_match_reference(device, dtype):
    B, S, I, Di, G, bs, C = 2, 9, 5, 64, 41, 4, 4
    q, k, w, vis = _inputs(B, S, I, Di, G, dtype, device, seed=7)
    g = torch.Generator().manual_seed(8)
    blk = torch.randint(-1, -(-G // bs) + 1, (B, S, C), generator=g)  # -1 and one block past the end
    blk = blk.sort(-1).values.to(device)
    for mask in (vis, None):
        s, ids = ki.index_scores_restricted(q, k, w, blk, bs, mask)
        s_ref, ids_ref = ki.index_scores_restricted_ref(q, k, w, blk, bs, mask)
        assert torch.equal(ids, ids_ref) and ids.dtype == torch.long
        _assert_scores(s, s_ref)
    assert (ids[blk.repeat_interleave(bs, -1) < 0] == -1).all()


def test_restricted_topk_picks_the_dense_candidate_topk(device):
    """Reindex: top-k over the candidate blocks' restricted scores == dense top-k with the pool mask."""
    B, S, I, Di, G, bs, topk_blocks, K = 2, 40, 6, 32, 40, 4, 3, 8
    q, k, w, _ = _inputs(B, S, I, Di, G, torch.float32, device, seed=9)
    vis = (torch.arange(G, device=device) <= torch.arange(S, device=device)[:, None]).expand(B, S, G)
    newest = torch.arange(S, device=device).expand(B, S)
    # the candidate source scores with its own queries; the Reindex layer with others
    src_score, bmax = ki.index_scores_with_block_max(torch.roll(q, 1, 2), k, w, vis, bs)
    blk = top_candidate_blocks(bmax, newest // bs, topk_blocks)
    cand = select_candidate_blocks(src_score, (torch.arange(G, device=device) // bs).expand(B, G),
                                   -(-G // bs), newest, topk_blocks)  # fmt: skip
    dense = ki.index_scores(q, k, w, vis).masked_fill(~cand, -torch.inf)
    vals, idx = topk_indices(dense, K)
    want = torch.where(vals > -torch.inf, idx, -1).sort(-1).values
    s, ids = ki.index_scores_restricted(q, k, w, blk, bs, vis)
    vals, pos = topk_indices(s, K)
    got = torch.where(vals > -torch.inf, ids.gather(-1, pos), -1).sort(-1).values
    assert torch.equal(got, want)
    assert (want[:, bs * topk_blocks :] >= 0).all()  # full pools: the comparison is not vacuous


def test_launchers_reject_bad_inputs(device):
    q, k, w, vis = _inputs(1, 4, 4, 32, 10, torch.bfloat16, device)
    with pytest.raises(ValueError, match="share"):
        ki.index_scores_fwd(q, k.float(), w)
    with pytest.raises(ValueError, match="fp32"):
        ki.index_scores_fwd(q, k, w.bfloat16())
    with pytest.raises(ValueError, match="contiguous"):
        ki.index_scores_fwd(q.transpose(1, 2), k, w)
    with pytest.raises(ValueError, match="visible"):
        ki.index_scores_fwd(q, k, w, vis[..., :5])
    with pytest.raises(ValueError, match="power of 2"):
        ki.index_scores_fwd(q, k, w, vis, block_size=3)
    with pytest.raises(ValueError, match="shape mismatch"):
        ki.index_scores_fwd(q, k[:, :, :16].contiguous(), w)


def test_model_triton_impl_picks_the_same_groups(device, debug_model):
    """The debug Transformer with impl=triton (Triton indexer, and the other kernels) against
    impl=torch: same top-k at every index layer (Full, candidate source, Reindex), same logits and
    indexer-loss gradients within tolerance. fp32: the kernels' fp32 dots follow the reference in
    another order (~1e-6 relative), so QAT is off: under it a value on an FP8/FP4 rounding boundary
    would round apart in the two impls and move picks and logits by a quantization step (the quant
    kernels are compared bit for bit in test_quant.py)."""
    ids = torch.randint(0, 512, (1, 40), generator=torch.Generator().manual_seed(1)).to(device)
    runs = {}
    for impl in ("torch", "triton"):
        model = debug_model(impl, seed=1, device=device, qat=False)
        picks = {}
        for i, layer in enumerate(model.layers):
            if layer.attn.indexer is not None:
                assert (layer.attn.indexer.index_scores is ki.index_scores) == (impl == "triton")
                layer.attn.indexer.register_forward_hook(lambda m, a, o, i=i, p=picks: p.__setitem__(i, o.topk_idxs))
        out = model(ids)
        out.indexer_loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters() if ".indexer." in n and p.grad is not None}
        runs[impl] = out, picks, grads
    (ref, ref_picks, ref_grads), (tri, tri_picks, tri_grads) = runs["torch"], runs["triton"]
    assert sorted(ref_picks) == sorted(tri_picks) and len(ref_picks) == 4
    for i in ref_picks:
        assert torch.equal(tri_picks[i], ref_picks[i]), i
    tol = {"rtol": 1e-4, "atol": 1e-4} if device == "cpu" else {"rtol": 2e-3, "atol": 2e-3}
    torch.testing.assert_close(tri.logits, ref.logits, **tol)
    assert ref_grads.keys() == tri_grads.keys() and ref_grads
    for n in ref_grads:
        torch.testing.assert_close(tri_grads[n], ref_grads[n], **tol, msg=n)


def test_reference_is_the_indexers_formula():
    """index_scores_ref is the per-head loop of §3.6 step 5 (the formula the model tests pin)."""
    q, k, w, vis = _inputs(2, 6, 3, 32, 9, torch.float32, "cpu", seed=10)
    want = sum(F.relu(q[:, :, h] @ k.transpose(1, 2)) * w[:, :, h, None] for h in range(3))
    torch.testing.assert_close(ki.index_scores_ref(q, k, w), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(ki.index_scores_ref(q, k, w, vis), want.masked_fill(~vis, -torch.inf))


def test_triton_indexer_replays_the_models_indexer_calls(device, debug_model):
    """Each index layer's call inside the torch debug model (QAT, causal masks, the candidate pool),
    replayed through an `Indexer` built with impl=triton: same picks, candidates, scores; the other
    kernels play no part, so this holds exactly wherever the scores do. The no-grad Reindex call
    takes the restricted path (tests/kernels/test_indexer_restricted.py): no scores to compare."""
    from model.config import get_flavor
    from model.indexer import Indexer

    model = debug_model("torch", seed=2, device=device)
    calls = {}
    for i, layer in enumerate(model.layers):
        if layer.attn.indexer is not None:
            layer.attn.indexer.register_forward_hook(
                lambda m, a, kw, o, i=i, c=calls: c.__setitem__(i, (a, kw, o)), with_kwargs=True
            )
    with torch.no_grad():
        model(torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(3)).to(device))
    tri_args = get_flavor("debug", impl="triton")
    assert len(calls) == 4
    for i, (a, kw, want) in calls.items():
        idx = Indexer(tri_args, i).to(device)
        idx.load_state_dict(model.layers[i].attn.indexer.state_dict())
        with torch.no_grad():
            got = idx(*a, **kw)
        assert torch.equal(got.topk_idxs, want.topk_idxs), i
        assert (got.scores is None) == idx.uses_candidates, i
        if got.scores is not None:
            _assert_scores(got.scores, want.scores)
        assert (got.candidates is None) == (want.candidates is None)
        assert got.candidates is None or torch.equal(got.candidates, want.candidates)
        assert got.candidate_blocks is None or torch.equal(got.candidate_blocks, want.candidate_blocks)


def test_mask_argument_traces_under_dynamo():
    """`_vis_args` inside torch.compile (the engine's compiled decode step): a uint8 copy of the mask
    with its own strides, where eager takes a view that keeps an expanded mask's zero strides;
    either way the kernel reads the same 0/1 bytes at every (b, s, g)."""
    vis = (torch.rand(1, 3, 5, generator=torch.Generator().manual_seed(0)) < 0.5).expand(2, 3, 5)
    eager, strides = ki._vis_args(vis, (2, 3, 5), vis.device)
    assert eager.dtype == torch.uint8 and strides == (0, 5, 1) and eager.data_ptr() == vis.data_ptr()
    compiled, c_strides = torch.compile(ki._vis_args, backend="eager", fullgraph=True)(vis, (2, 3, 5), vis.device)
    assert compiled.dtype == torch.uint8 and c_strides == compiled.stride()
    assert compiled.data_ptr() != vis.data_ptr()  # a copy: inductor cannot lower the bool->uint8 view
    assert torch.equal(compiled, vis.to(torch.uint8)) and torch.equal(eager, compiled)
