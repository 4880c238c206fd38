"""Parity of the Triton sparse attention forward (kernels/sparse_attn.py) with `sparse_attn_ref`.

The kernel rounds probabilities to bf16 before P·V (as the official kernel does) while the torch
reference keeps them fp32, so outputs agree to about one bf16 ulp, not bit for bit. CPU runs use
TRITON_INTERPRET=1 (set in tests/kernels/conftest.py); `-m gpu` runs them compiled on CUDA.
"""

import pytest
import torch

from kernels import sparse_attn as ks

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # all -1 rows: exp(sink + 1e30)


def _inputs(B, M, H, Dh, N, K, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, M, H, Dh, generator=g).to(dtype)
    kv = torch.randn(B, N, Dh, generator=g).to(dtype)
    sink = torch.randn(H, generator=g)
    idxs = torch.randint(0, N, (B, M, K), generator=g, dtype=torch.int32)
    idxs[torch.rand(B, M, K, generator=g) < 0.3] = -1  # scattered invalid slots
    idxs[0, 0, K // 3 :] = -1  # a short row
    if B * M > 1:
        idxs[-1, -1] = -1  # a row with no valid index -> zeros
    return q.to(device), kv.to(device), sink.to(device), idxs.to(device)


def _check(o, r):
    assert o.shape == r.shape and o.dtype == r.dtype
    err = (o.float() - r.float()).abs()
    assert err.max().item() <= 1e-2 + 1e-2 * r.float().abs().max().item(), err.max().item()


@pytest.mark.parametrize(
    "B,M,H,Dh,N,K",
    [
        (2, 3, 4, 64, 50, 70),  # heads padded to 16, K not a multiple of the 64-block
        (1, 2, 16, 128, 40, 64),
        (2, 1, 20, 64, 30, 130),  # H not a power of two
        (1, 1, 4, 512, 96, 160),  # decode-like: one query, the real head_dim
    ],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_forward_matches_reference(device, B, M, H, Dh, N, K, dtype):
    q, kv, sink, idxs = _inputs(B, M, H, Dh, N, K, dtype, device)
    scale = Dh**-0.5
    o = ks.sparse_attn(q, kv, sink, idxs, scale)
    _check(o, ks.sparse_attn_ref(q, kv, sink, idxs, scale))
    if B * M > 1:
        assert o[-1, -1].abs().max().item() == 0.0


def test_int64_indices_and_config(device):
    q, kv, sink, idxs = _inputs(1, 2, 8, 128, 33, 96, torch.bfloat16, device)
    ref = ks.sparse_attn_ref(q, kv, sink, idxs, 0.1)
    for cfg in (
        {"BK": 32, "DV": 64},
        {"DV": 128, "BH": 16},
        {"BDK": "full", "DV": 128},
        {"BDK": "full", "DV": 512},
    ):
        _check(ks.sparse_attn_fwd(q, kv, sink, idxs.long(), 0.1, cfg), ref)


def test_sink_dominates(device):
    """A huge sink absorbs the softmax mass: outputs go to 0 (sink carries no value)."""
    q, kv, _, idxs = _inputs(1, 1, 4, 64, 20, 16, torch.bfloat16, device)
    sink = torch.full((4,), 80.0, device=device)
    assert ks.sparse_attn(q, kv, sink, idxs, 0.125).abs().max().item() < 1e-6


@pytest.mark.parametrize("B,M,H,Dh,N,K", [(1, 2, 4, 64, 20, 24), (2, 3, 20, 128, 40, 70), (1, 1, 4, 512, 50, 40)])
def test_backward_matches_reference(device, B, M, H, Dh, N, K):
    """Triton backward vs autograd through the torch reference (duplicate and -1 indices included)."""
    q, kv, sink, idxs = _inputs(B, M, H, Dh, N, K, torch.bfloat16, device, seed=4)
    idxs[0, 0, 1] = idxs[0, 0, 0] = 3  # a row gathered twice by one query: its grads must add up
    ins = [t.clone().requires_grad_() for t in (q, kv, sink)]
    g = torch.randn(B, M, H, Dh, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16).to(device)
    scale = Dh**-0.5
    grads = torch.autograd.grad(ks.sparse_attn(*ins, idxs, scale), ins, g)
    grads_ref = torch.autograd.grad(ks.sparse_attn_ref(*ins, idxs, scale), ins, g)
    for a, b in zip(grads, grads_ref):
        assert a.shape == b.shape and a.dtype == b.dtype
        err = (a.float() - b.float()).abs().max().item()
        assert err <= 3e-2 * b.float().abs().max().item() + 1e-3, err
    if B * M > 1:  # the empty row contributes nothing
        assert grads[0][-1, -1].abs().max().item() == 0.0


@pytest.mark.parametrize("B,M,H,Dh,N,K", [(2, 1, 20, 64, 30, 130), (1, 2, 64, 128, 80, 96), (3, 1, 4, 512, 60, 70)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("split", [2, 3, "auto"])
@pytest.mark.parametrize("dv", [512, 32])
def test_split_decode_matches_reference(device, B, M, H, Dh, N, K, dtype, split, dv):
    """The decode path: each row's indices split over programs (some chunks empty or all -1), the
    partial softmaxes merged by the combine kernel, with whole output rows per program or a block of
    DV columns each (then every column block of a chunk writes its part); repeated calls give
    identical bits."""
    q, kv, sink, idxs = _inputs(B, M, H, Dh, N, K, dtype, device, seed=4)
    idxs[0, 0, : K // 2] = -1  # a chunk with no valid index beside valid ones in the same row
    scale = Dh**-0.5
    tiles = {"BK": 32, "num_warps": 8, "num_stages": 2} if dv == 512 else {"BK": 16, "num_warps": 4, "num_stages": 3}
    cfg = {"BH": 64, "BDK": "full", "DV": dv, "SPLIT": split, **tiles}
    o = ks.sparse_attn_fwd(q, kv, sink, idxs, scale, cfg)
    _check(o, ks.sparse_attn_ref(q, kv, sink, idxs, scale))
    assert not o[-1, -1].any()  # the all-invalid row
    assert torch.equal(o, ks.sparse_attn_fwd(q, kv, sink, idxs, scale, cfg))


def test_no_grad_call_takes_the_forward_alone(device):
    """Under no_grad `sparse_attn` (the model's entry) gives the same output as with autograd."""
    q, kv, sink, idxs = _inputs(4, 1, 16, 128, 40, 96, torch.bfloat16, device, seed=5)
    with torch.no_grad():
        o = ks.sparse_attn(q, kv, sink, idxs, 0.1)
    _check(o, ks.sparse_attn_ref(q, kv, sink, idxs, 0.1))
    assert torch.equal(o, ks.sparse_attn_fwd(q, kv, sink, idxs, 0.1))


@pytest.mark.parametrize(
    "B,M,H,Dh,T,G,K", [(2, 1, 20, 64, 30, 50, 70), (1, 3, 16, 128, 8, 40, 96), (2, 1, 4, 512, 16, 60, 80)]
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_packed_main_kv_is_read_as_unpacked(device, B, M, H, Dh, T, G, K, dtype):
    """Indices >= T read packed FP4 main-KV entries (E2M1 + E4M3/16, the packed cache's bytes),
    decoded in the kernel: bit-identical to the dense kernel on the unpacked rows, close to the ref."""
    from model.packed_cache import pack_main_kv, unpack_main_kv
    from model.quant import fp4_e4m3_fake_quant

    g = torch.Generator().manual_seed(7)
    q = torch.randn(B, M, H, Dh, generator=g).to(dtype).to(device)
    win = torch.randn(B, T, Dh, generator=g).to(dtype).to(device)
    ckv = pack_main_kv(fp4_e4m3_fake_quant(torch.randn(B, G, Dh, generator=g) * 3)).to(device)
    sink = torch.randn(H, generator=g).to(device)
    idxs = torch.randint(0, T + G, (B, M, K), generator=g, dtype=torch.int32)
    idxs[torch.rand(B, M, K, generator=g) < 0.2] = -1
    idxs[-1, -1] = -1
    idxs = idxs.to(device)
    dense = torch.cat([win, unpack_main_kv(ckv, dtype)], dim=1)
    ref = ks.sparse_attn_ref(q, dense, sink, idxs, Dh**-0.5)
    # fp32 at head_dim 512 needs the smaller tiles to fit shared memory (cfg None: the launcher shrinks them)
    # decode: 16-bit rows are staged (decoded once into a buffer, then read by the dense kernel),
    # fp32 and STAGE False decode in the kernel
    small = {"BK": 16, "num_stages": 1}
    fused = {**ks.PACKED_FUSED_CONFIG, "BK": 16}
    for cfg in (None, {"SPLIT": 2, **small}, {**ks.TRAIN_CONFIG, "BK": 16}, {"BH": 16, **small}, fused):
        o = ks.sparse_attn_fwd(q, win, sink, idxs, Dh**-0.5, cfg, ckv=ckv)
        _check(o, ref)
        assert not o[-1, -1].any()
        staged = dtype != torch.float32 and (cfg or ks.PACKED_CONFIG).get("STAGE", True)
        if device == "cpu" or staged:  # fused, compiled: the dots' operands come by another path
            base = ks.PACKED_CONFIG if staged else ks.PACKED_FUSED_CONFIG
            dense_cfg = {**base, **(cfg or {})}
            assert torch.equal(o, ks.sparse_attn_fwd(q, dense, sink, idxs, Dh**-0.5, dense_cfg))
    with pytest.raises(ValueError, match="packed main-KV entries"):
        ks.sparse_attn_fwd(q, win, sink, idxs, Dh**-0.5, ckv=ckv[..., :-1])


def test_launchers_reject_bad_inputs(device):
    q, kv, sink, idxs = _inputs(2, 1, 4, 64, 20, 30, torch.bfloat16, device, seed=6)
    with pytest.raises(ValueError, match="integer row indices"):
        ks.sparse_attn_fwd(q, kv, sink, idxs.float(), 0.1)
    with pytest.raises(ValueError, match="share a bf16"):
        ks.sparse_attn_fwd(q, kv.float(), sink, idxs, 0.1)
    with pytest.raises(ValueError, match="contiguous"):
        ks.sparse_attn_fwd(q.repeat(1, 1, 1, 2)[..., :64], kv, sink, idxs, 0.1)
    with pytest.raises(ValueError, match=r"kv \[B,N,Dh\]"):
        ks.sparse_attn_fwd(q, kv[..., :32].contiguous(), sink, idxs, 0.1)
    with pytest.raises(ValueError, match=r"need q \[B,M,H,Dh\]"):
        ks.sparse_attn_fwd(q[0], kv, sink, idxs, 0.1)


def test_packed_decode_over_the_staging_budget_decodes_in_the_kernel(device, monkeypatch):
    """A staging buffer larger than _STAGE_MAX_BYTES is not allocated: the call decodes inside the
    attention kernel (the fused tiles' bits) and still matches the reference."""
    from model.packed_cache import pack_main_kv, unpack_main_kv
    from model.quant import fp4_e4m3_fake_quant

    g = torch.Generator().manual_seed(11)
    B, H, Dh, T, G, K = 2, 8, 64, 12, 40, 48
    q = torch.randn(B, 1, H, Dh, generator=g).to(torch.bfloat16).to(device)
    win = torch.randn(B, T, Dh, generator=g).to(torch.bfloat16).to(device)
    ckv = pack_main_kv(fp4_e4m3_fake_quant(torch.randn(B, G, Dh, generator=g))).to(device)
    sink = torch.randn(H, generator=g).to(device)
    idxs = torch.randint(0, T + G, (B, 1, K), generator=g, dtype=torch.int32).to(device)
    dense = torch.cat([win, unpack_main_kv(ckv, torch.bfloat16)], dim=1)
    monkeypatch.setattr(ks, "_STAGE_MAX_BYTES", 0)
    o = ks.sparse_attn_fwd(q, win, sink, idxs, Dh**-0.5, ckv=ckv)
    _check(o, ks.sparse_attn_ref(q, dense, sink, idxs, Dh**-0.5))
    if device == "cpu":
        assert torch.equal(o, ks.sparse_attn_fwd(q, dense, sink, idxs, Dh**-0.5, ks.PACKED_FUSED_CONFIG))


@pytest.mark.parametrize("B,M,H,Dh,N,K", [(2, 3, 4, 64, 50, 150), (1, 1, 4, 512, 96, 160)])
def test_reference_tiles_follow_the_released_kernels_blocks(device, B, M, H, Dh, N, K):
    """numerics="reference" (reference=True): REFERENCE_CONFIG moves the running max in blocks of 64
    indices as the released kernel and `sparse_attn_blocked_ref` do, decode-sized calls included;
    the dots' own accumulation order stays the kernel's, hence a tolerance of one bf16 ulp."""
    from model.attention import sparse_attn_blocked_ref

    assert ks.REFERENCE_CONFIG["BK"] == 64 and ks.REFERENCE_CONFIG["SPLIT"] == 1
    q, kv, sink, idxs = _inputs(B, M, H, Dh, N, K, torch.bfloat16, device)
    scale = Dh**-0.5
    o = ks.sparse_attn(q, kv, sink, idxs, scale, reference=True)
    r = sparse_attn_blocked_ref(q.cpu(), kv.cpu(), sink.cpu(), idxs.cpu(), scale)
    err = (o.cpu().float() - r.float()).abs()
    assert (err <= 2**-7 * r.float().abs() + 1e-3).all(), err.max().item()
