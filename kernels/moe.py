"""Triton grouped expert GEMMs for the routed experts of the MoE (spec §3.11), forward and backward.

The N = T·K token-expert assignments are sorted by expert (stable, as the torch path does: a
chunked counting sort in two small kernels, which also write the expert offsets, the tile tables
and the routing weights in sorted order; no host sync). Every GEMM is then ONE launch over all
experts: a program takes a BM-row tile of one expert's rows and one column tile. Expert weights
are read in place through a table of element offsets from the first expert's tensor (no per-call
stacking).
  up    gu = [x[tok] @ w1[e]ᵀ, x[tok] @ w3[e]ᵀ] (bf16-rounded, kept for the backward) and the fused
        clamped SwiGLU h = bf16(wgt · silu(min(g, L)) · clamp(u, -L, L))      (L = swiglu_limit)
  down  y[slot] = h @ w2[e]ᵀ, written straight to the (token, k) slot order
  bwd   dh = dy[slot] @ w2[e] with the SwiGLU backward fused (dg, du in bf16, dwgt partials);
        dx[slot] = dg @ w1[e] + du @ w3[e]; dW13[e] = Σ_rows dguᵀ x[tok], dW2[e] = Σ_rows dy[slot]ᵀ h
`moe_ref` is the torch reference (the per-expert loop of `model.moe.Expert`). The input gradient's fp32
sum over a token's K slots is one small kernel. Not here: routing, the shared expert and the forward's
sum over a token's K outputs (model/moe.py keeps those).

Shape legend: T tokens, D model dim, F expert inter dim, E routed experts, K experts per token,
N = T·K assignments (sorted by expert), BM/BN/BK the row/column/reduction tile.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.launch import dot_args, interpreting, launch_opts
from kernels.quant import cast_rne

__all__ = ["moe_experts", "moe_ref", "expert_offsets", "CONFIG"]

# Tiles per kernel (bench/kernels.py sweeps them on the H200): rows BM x columns BN, reduction BK.
# Best of bench/kernels.py's per-kernel sweep (each kernel launched alone) on one H200 at `small`
# sizes (T 8192, D 1024, F 512, 32 experts top-4): up 409, down 382, dh 225, dx 485, wgrad 391 TFLOP/s.
CONFIG = {
    "up": {"BM": 128, "BN": 128, "BK": 64, "num_warps": 8, "num_stages": 4},
    "down": {"BM": 128, "BN": 128, "BK": 64, "num_warps": 8, "num_stages": 3},
    "dh": {"BM": 64, "BN": 64, "BK": 64, "num_warps": 4, "num_stages": 4},
    "dx": {"BM": 128, "BN": 128, "BK": 64, "num_warps": 8, "num_stages": 3},
    "wgrad": {"BM": 128, "BN": 128, "BK": 64, "num_warps": 4, "num_stages": 4},
}


# ------------------------------------------------------------------------------------------------
# tile scheduling and operand helpers


@triton.jit
def _row_tile(tile_cum_ptr, offs_ptr, E, EP: tl.constexpr, BM: tl.constexpr):
    """Program's M tile -> (expert e, first row, end row of e); e == E for a program past the last
    tile. tile_cum [E] is the inclusive cumsum of cdiv(count_e, BM); offs [E+1] the row offsets."""
    t = tl.program_id(1)
    e_P = tl.arange(0, EP)
    cum_P = tl.load(tile_cum_ptr + e_P, mask=e_P < E, other=2**30)
    e = tl.sum((cum_P <= t).to(tl.int32))
    e_c = tl.minimum(e, E - 1)
    prev = tl.load(tile_cum_ptr + e_c - 1, mask=e_c > 0, other=0)
    row0 = tl.load(offs_ptr + e_c) + (t - prev) * BM
    row_end = tl.load(offs_ptr + e_c + 1)
    return e, e_c, row0, row_end


@triton.jit
def _expert_ptr(base_ptr, wofs_ptr, e):
    """Expert e's weight: base + offset, offsets stored in 16-byte units so the compiler knows the
    16-byte alignment of every expert's start and vectorises the loads."""
    UNIT: tl.constexpr = 128 // base_ptr.dtype.element_ty.primitive_bitwidth
    return base_ptr + tl.load(wofs_ptr + e).to(tl.int64) * UNIT


# ------------------------------------------------------------------------------------------------
# kernels


@triton.jit
def _up_kernel(
    x_ptr, w1_ptr, w3_ptr, w1ofs_ptr, w3ofs_ptr, tok_ptr, wgt_ptr, gu_ptr, h_ptr, tile_cum_ptr, offs_ptr,
    E, D, F, limit,
    EP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    HAS_LIMIT: tl.constexpr, F32_DOT: tl.constexpr, DOT_PREC: tl.constexpr,
):  # fmt: skip
    """gu[n, f] = bf16(x[tok_n] · w1[e, f]), gu[n, F + f] = bf16(x[tok_n] · w3[e, f]); h[n, f] the
    weighted clamped SwiGLU, rounded to bf16 (x's dtype) as the reference's `.to(dtype)` does."""
    e, e_c, row0, row_end = _row_tile(tile_cum_ptr, offs_ptr, E, EP, BM)
    if e >= E:
        return
    DT: tl.constexpr = tl.float32 if F32_DOT else x_ptr.dtype.element_ty
    n_M = row0 + tl.arange(0, BM)
    mask_M = n_M < row_end
    tok_M = tl.load(tok_ptr + n_M, mask=mask_M, other=0).to(tl.int64)
    f_N = tl.program_id(0) * BN + tl.arange(0, BN)
    k_K = tl.arange(0, BK)
    a_ptrs = x_ptr + tok_M[:, None] * D + k_K[None, :]
    w1 = _expert_ptr(w1_ptr, w1ofs_ptr, e_c)
    w3 = _expert_ptr(w3_ptr, w3ofs_ptr, e_c)
    b_offs = f_N[None, :].to(tl.int64) * D + k_K[:, None]  # B[k, f] = w[f, k]
    acc_g = tl.zeros((BM, BN), tl.float32)
    acc_u = tl.zeros((BM, BN), tl.float32)
    for k0 in range(0, D, BK):
        a = tl.load(a_ptrs + k0, mask=mask_M[:, None], other=0.0).to(DT)
        acc_g = tl.dot(a, tl.load(w1 + b_offs + k0).to(DT), acc_g, input_precision=DOT_PREC)
        acc_u = tl.dot(a, tl.load(w3 + b_offs + k0).to(DT), acc_u, input_precision=DOT_PREC)
    OT: tl.constexpr = gu_ptr.dtype.element_ty
    g = cast_rne(acc_g, OT)
    u = cast_rne(acc_u, OT)
    gu_offs = n_M[:, None].to(tl.int64) * (2 * F) + f_N[None, :]
    tl.store(gu_ptr + gu_offs, g, mask=mask_M[:, None])
    tl.store(gu_ptr + gu_offs + F, u, mask=mask_M[:, None])
    g = g.to(tl.float32)
    u = u.to(tl.float32)
    if HAS_LIMIT:
        u = tl.minimum(tl.maximum(u, -limit), limit)
        g = tl.minimum(g, limit)
    wgt_M = tl.load(wgt_ptr + n_M, mask=mask_M, other=0.0)
    h = wgt_M[:, None] * (g * tl.sigmoid(g) * u)
    h_offs = n_M[:, None].to(tl.int64) * F + f_N[None, :]
    tl.store(h_ptr + h_offs, cast_rne(h, h_ptr.dtype.element_ty), mask=mask_M[:, None])


@triton.jit
def _rows_mm_kernel(
    a_ptr, a_idx_ptr, b_ptr, b2_ptr, bofs_ptr, b2ofs_ptr, c_ptr, c_idx_ptr, tile_cum_ptr, offs_ptr,
    gu_ptr, wgt_ptr, dwgt_ptr,
    E, KA, NC, stride_bk, stride_bn, limit,
    EP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    A_GATHER: tl.constexpr, DUAL: tl.constexpr, C_SCATTER: tl.constexpr, SWIGLU_BWD: tl.constexpr,
    HAS_LIMIT: tl.constexpr, F32_DOT: tl.constexpr, DOT_PREC: tl.constexpr,
):  # fmt: skip
    """C[c_row(n), :] = A[a_row(n), :KA] @ B_e (B_e[k, j] at b + k·stride_bk + j·stride_bn); with DUAL
    A has 2·KA columns and the second half multiplies B2_e. a_row / c_row gather / scatter through
    an index when A_GATHER / C_SCATTER. With SWIGLU_BWD the product is dh (the down-projection's
    input grad): the epilogue writes dgu = [dg, du] (bf16) into C and Σ_f dh·h0 partials to dwgt."""
    e, e_c, row0, row_end = _row_tile(tile_cum_ptr, offs_ptr, E, EP, BM)
    if e >= E:
        return
    DT: tl.constexpr = tl.float32 if F32_DOT else a_ptr.dtype.element_ty
    n_M = row0 + tl.arange(0, BM)
    mask_M = n_M < row_end
    if A_GATHER:
        arow_M = tl.load(a_idx_ptr + n_M, mask=mask_M, other=0).to(tl.int64)
    else:
        arow_M = n_M.to(tl.int64)
    LDA: tl.constexpr = 2 if DUAL else 1
    j_N = tl.program_id(0) * BN + tl.arange(0, BN)
    k_K = tl.arange(0, BK)
    a_ptrs = a_ptr + arow_M[:, None] * (KA * LDA) + k_K[None, :]
    b_offs = k_K[:, None].to(tl.int64) * stride_bk + j_N[None, :].to(tl.int64) * stride_bn
    b = _expert_ptr(b_ptr, bofs_ptr, e_c)
    acc = tl.zeros((BM, BN), tl.float32)
    if DUAL:
        # one pipelined loop over both halves (A's columns KA..2KA multiply B2): B2 addressed from B
        b2 = _expert_ptr(b2_ptr, b2ofs_ptr, e_c)
        for k0 in range(0, 2 * KA, BK):
            a = tl.load(a_ptrs + k0, mask=mask_M[:, None], other=0.0).to(DT)
            bk = tl.where(k0 < KA, b + k0 * stride_bk, b2 + (k0 - KA) * stride_bk)
            acc = tl.dot(a, tl.load(bk + b_offs).to(DT), acc, input_precision=DOT_PREC)
    else:
        for k0 in range(0, KA, BK):
            a = tl.load(a_ptrs + k0, mask=mask_M[:, None], other=0.0).to(DT)
            acc = tl.dot(a, tl.load(b + b_offs + k0 * stride_bk).to(DT), acc, input_precision=DOT_PREC)
    if SWIGLU_BWD:
        # dh rounded like the reference's bf16 matmul output, then the SwiGLU backward in fp32
        OT: tl.constexpr = c_ptr.dtype.element_ty
        dh = cast_rne(acc, OT).to(tl.float32)
        gu_offs = n_M[:, None].to(tl.int64) * (2 * NC) + j_N[None, :]
        g = tl.load(gu_ptr + gu_offs, mask=mask_M[:, None], other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + gu_offs + NC, mask=mask_M[:, None], other=0.0).to(tl.float32)
        if HAS_LIMIT:
            uc = tl.minimum(tl.maximum(u, -limit), limit)
            gc = tl.minimum(g, limit)
        else:
            uc = u
            gc = g
        sig = tl.sigmoid(gc)
        act = gc * sig
        wgt_M = tl.load(wgt_ptr + n_M, mask=mask_M, other=0.0)
        # Σ_f partials stored by slot (A's gather index), so the launcher needs no scatter
        dwgt_offs = arow_M * tl.num_programs(0) + tl.program_id(0)
        tl.store(dwgt_ptr + dwgt_offs, tl.sum(dh * act * uc, axis=1), mask=mask_M)
        dh0 = dh * wgt_M[:, None]
        dg = dh0 * uc * (sig * (1.0 + gc * (1.0 - sig)))
        du = dh0 * act
        if HAS_LIMIT:
            dg = tl.where(g <= limit, dg, 0.0)
            du = tl.where((u >= -limit) & (u <= limit), du, 0.0)
        tl.store(c_ptr + gu_offs, cast_rne(dg, OT), mask=mask_M[:, None])
        tl.store(c_ptr + gu_offs + NC, cast_rne(du, OT), mask=mask_M[:, None])
    else:
        if C_SCATTER:
            crow_M = tl.load(c_idx_ptr + n_M, mask=mask_M, other=0).to(tl.int64)
        else:
            crow_M = n_M.to(tl.int64)
        c_offs = crow_M[:, None] * NC + j_N[None, :]
        tl.store(c_ptr + c_offs, cast_rne(acc, c_ptr.dtype.element_ty), mask=mask_M[:, None])


@triton.jit
def _wgrad_kernel(
    a_ptr, a_idx_ptr, b_ptr, b_idx_ptr, c_ptr, offs_ptr, P, Q,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    A_GATHER: tl.constexpr, B_GATHER: tl.constexpr, F32_DOT: tl.constexpr, DOT_PREC: tl.constexpr,
):  # fmt: skip
    """C[e] [P, Q] = Σ_{n in expert e} A[a_row(n), :P]ᵀ B[b_row(n), :Q]; program (P x Q tile, e).
    An expert with no rows gets zeros."""
    e = tl.program_id(1)
    n_pq = tl.cdiv(Q, BN)
    p_M = (tl.program_id(0) // n_pq) * BM + tl.arange(0, BM)
    q_N = (tl.program_id(0) % n_pq) * BN + tl.arange(0, BN)
    start = tl.load(offs_ptr + e)
    end = tl.load(offs_ptr + e + 1)
    DT: tl.constexpr = tl.float32 if F32_DOT else a_ptr.dtype.element_ty
    acc = tl.zeros((BM, BN), tl.float32)
    for r0 in range(start, end, BK):
        r_K = r0 + tl.arange(0, BK)
        mask_K = r_K < end
        if A_GATHER:
            ar_K = tl.load(a_idx_ptr + r_K, mask=mask_K, other=0).to(tl.int64)
        else:
            ar_K = r_K.to(tl.int64)
        if B_GATHER:
            br_K = tl.load(b_idx_ptr + r_K, mask=mask_K, other=0).to(tl.int64)
        else:
            br_K = r_K.to(tl.int64)
        at = tl.load(a_ptr + ar_K[None, :] * P + p_M[:, None], mask=mask_K[None, :], other=0.0).to(DT)
        bb = tl.load(b_ptr + br_K[:, None] * Q + q_N[None, :], mask=mask_K[:, None], other=0.0).to(DT)
        acc = tl.dot(at, bb, acc, input_precision=DOT_PREC)
    c_offs = e.to(tl.int64) * P * Q + p_M[:, None] * Q + q_N[None, :]
    tl.store(c_ptr + c_offs, cast_rne(acc, c_ptr.dtype.element_ty))


@triton.jit
def _sum_slots_kernel(x_ptr, y_ptr, T, D, K: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    """y[t, :] = Σ_k x[t·K + k, :] accumulated in fp32 in k order, rounded once to y's dtype: the
    reference's `.float().sum(1)` over a token's K expert slots in one pass (no fp32 copy)."""
    t_T = tl.program_id(0) * BT + tl.arange(0, BT)
    d_D = tl.program_id(1) * BD + tl.arange(0, BD)
    m_TD = (t_T < T)[:, None] & (d_D < D)[None, :]
    offs_TD = t_T[:, None].to(tl.int64) * (K * D) + d_D[None, :]
    acc = tl.zeros((BT, BD), tl.float32)
    for k in tl.static_range(K):
        acc += tl.load(x_ptr + offs_TD + k * D, mask=m_TD, other=0.0).to(tl.float32)
    tl.store(y_ptr + t_T[:, None].to(tl.int64) * D + d_D[None, :], cast_rne(acc, y_ptr.dtype.element_ty), mask=m_TD)


# ------------------------------------------------------------------------------------------------
# launchers


def _tile(cfg: dict, n: int, name: str) -> int:
    """The configured tile, halved until it divides n (model dims are multiples of 16)."""
    t = cfg[name]
    while n % t:
        t //= 2
    if t < 16:
        raise ValueError(f"the grouped GEMM tiles need dimensions that are multiples of 16, got {n}: use impl=torch")
    return t


def _config(name: str, dtype: torch.dtype) -> dict:
    """CONFIG[name] (tuned for bf16), with BK halved for 4-byte operands: at fp32 the bf16 tiles'
    pipelined shared-memory buffers need more than an H200 block's 227 KB (`up` asked for 288 KB
    when the `small` demo ran in fp32)."""
    cfg = CONFIG[name]
    return {**cfg, "BK": cfg["BK"] // 2} if dtype.itemsize == 4 else cfg


_offsets_cache: dict[tuple, torch.Tensor] = {}


def _weight_offsets(ws: list[torch.Tensor]) -> torch.Tensor:
    """int64 [E] offsets of each expert's weight from the first one's, in 16-byte units, on the
    weights' device. Every weight must be contiguous, of one dtype and 16-byte aligned relative to
    the first. Cached by the weights' addresses (stable across steps: optimisers update in place),
    so a call costs no host-to-device copy, which would stall the stream."""
    base = ws[0]
    ptrs = tuple(w.data_ptr() for w in ws)
    key = (base.device, ptrs)
    offs = _offsets_cache.get(key)
    if offs is None:
        if any(not w.is_contiguous() or w.dtype != base.dtype or w.shape != base.shape for w in ws):
            raise ValueError("expert weights of one kind must be contiguous, of one dtype and one shape")
        d = [p - ptrs[0] for p in ptrs]
        if any(x % 16 for x in d) or 16 % base.element_size():
            raise ValueError("expert weights must be 16-byte aligned relative to each other (torch allocations are)")
        if len(_offsets_cache) > 256:
            _offsets_cache.clear()
        offs = _offsets_cache[key] = torch.tensor([x // 16 for x in d], dtype=torch.int64).to(base.device)
    return offs


def expert_offsets(
    w1s: list[torch.Tensor], w3s: list[torch.Tensor], w2s: list[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The offset tables (w1, w3, w2) `moe_experts` reads its experts' weights through, for a caller
    that passes them in (`offsets=`): a traced region (torch.compile) cannot read data pointers, so
    they are made outside it, here, eagerly. Valid while the weights stay where they are: call again
    after they move (the lookup is by address, so an unmoved set costs a dict lookup)."""
    return _weight_offsets(w1s), _weight_offsets(w3s), _weight_offsets(w2s)


@triton.jit
def _sched_buckets(ids_ptr, c, N, E, BLOCK: tl.constexpr, EP: tl.constexpr):
    """Chunk c's buckets, int32 [BLOCK]: expert ids 0..E-1, E for any id outside them, EP - 1 for
    the lanes past N (EP >= E + 2, so that bucket is never a real one)."""
    i_B = c * BLOCK + tl.arange(0, BLOCK)
    ok_B = i_B < N
    ids_B = tl.load(ids_ptr + i_B, mask=ok_B, other=0)
    return tl.where(ok_B, tl.where((ids_B >= 0) & (ids_B < E), ids_B, E), EP - 1).to(tl.int32)


@triton.jit
def _sched_hist_kernel(ids_ptr, hist_ptr, N, E, BLOCK: tl.constexpr, EP: tl.constexpr):
    """Chunk c's histogram over `_sched_buckets`."""
    c = tl.program_id(0)
    tl.store(hist_ptr + c * EP + tl.arange(0, EP), tl.histogram(_sched_buckets(ids_ptr, c, N, E, BLOCK, EP), EP))


@triton.jit
def _sched_scatter_kernel(
    ids_ptr, w_ptr, hist_ptr, table_ptr, slot_ptr, tok_ptr, wgt_ptr, offs_ptr, tile_cum_ptr, N, E, K,
    BLOCK: tl.constexpr, EP: tl.constexpr, CB: tl.constexpr, N_BM: tl.constexpr,
):  # fmt: skip
    """Chunk c's assignments to their sorted positions: a stable counting sort by expert over the
    chunks' histograms hist [C, EP]. An assignment of bucket b at sorted position j of its chunk
    goes to start[b] + (b's count in earlier chunks) + (j - b's first position in the chunk).
    Every program sums the histograms itself (C^2 EP reads: _Schedule bounds C). Program 0 also
    writes offs [E+1] and tile_cum [N_BM, E] (for BM = 16 << s)."""
    c = tl.program_id(0)
    C = tl.num_programs(0)
    e_P = tl.arange(0, EP)
    total_P = tl.zeros([EP], tl.int32)
    before_P = tl.zeros([EP], tl.int32)
    for c0 in range(0, C, CB):  # CB chunks' histograms per load
        c_R = c0 + tl.arange(0, CB)
        rows_RP = tl.load(hist_ptr + c_R[:, None] * EP + e_P[None, :], mask=(c_R < C)[:, None], other=0)
        total_P += tl.sum(rows_RP, 0)
        before_P += tl.sum(tl.where((c_R < c)[:, None], rows_RP, 0), 0)
    here_P = tl.load(hist_ptr + c * EP + e_P)
    start_P = tl.cumsum(total_P, 0) - total_P
    # the per-bucket term of every destination goes through memory (table row c is this
    # program's scratch): a register tensor cannot be indexed by another
    tl.store(table_ptr + c * EP + e_P, start_P + before_P - (tl.cumsum(here_P, 0) - here_P))
    tl.debug_barrier()
    local_B = tl.arange(0, BLOCK)
    key_B = tl.sort(_sched_buckets(ids_ptr, c, N, E, BLOCK, EP) * BLOCK + local_B)  # unique keys: stable
    slot_B = c * BLOCK + key_B % BLOCK  # j-th assignment of the chunk in (bucket, index) order
    dest_B = tl.load(table_ptr + c * EP + key_B // BLOCK) + local_B
    ok_B = slot_B < N
    tl.store(slot_ptr + dest_B, slot_B, mask=ok_B)
    tl.store(tok_ptr + dest_B, slot_B // K, mask=ok_B)
    tl.store(wgt_ptr + dest_B, tl.load(w_ptr + slot_B, mask=ok_B, other=0.0).to(tl.float32), mask=ok_B)
    if c == 0:
        tl.store(offs_ptr + e_P, start_P, mask=e_P <= E)
        for s in tl.static_range(N_BM):
            tiles_P = tl.where(e_P < E, (total_P + (16 << s) - 1) // (16 << s), 0)
            tl.store(tile_cum_ptr + s * E + e_P, tl.cumsum(tiles_P, 0), mask=e_P < E)


class _Schedule:
    """Sorted-assignment bookkeeping shared by the forward and backward launches: slot_N (the
    assignments' (token, k) positions sorted by expert, stably), tok_N, wgt_N (the routing weights
    in that order, fp32), offs [E+1] (expert e's rows are offs[e]:offs[e+1]) and the tile tables.
    Ids outside 0..E-1 (none come from the router) sort last, in their order, in no expert's rows.
    Up to MAX_CHUNKS chunks, two Triton kernels build all of it (a chunked counting sort, no host
    sync) where torch ops take 17 launches; above, the torch ops (a stable sort of narrow keys and
    searchsorted), whose time grows far slower with N than the kernels' C^2 histogram reads.
    H200, one call after an L2 flush (torch ops in brackets): 32768 assignments over 32
    experts 11.6 us (54.9), 65536 over 256: 17.9 (67.0), 131072 over 256: 25.5 (68.7), 524288 over
    256 at 1024 chunks: 162.7 (80.7)."""

    _BMS = 5  # tile tables for BM 16, 32, 64, 128, 256
    MAX_CHUNKS = 256

    def __init__(self, topk_idx_TK: torch.Tensor, weights_TK: torch.Tensor, n_experts: int, block: int | None = None):
        T, K = topk_idx_TK.shape
        self.T, self.K, self.E, self.N = T, K, n_experts, T * K
        dev = topk_idx_TK.device
        EP = triton.next_power_of_2(n_experts + 2)  # buckets: experts, out-of-range ids, past-N lanes
        if EP > 4096:
            raise ValueError(f"the Triton MoE schedule takes up to 4094 experts, got {n_experts}; use impl=torch")
        ids_N, w_N = topk_idx_TK.contiguous().view(-1), weights_TK.detach().contiguous().view(-1)
        # assignments per program: a bitonic sort of BLOCK keys. Best of a sweep on the H200 (BLOCK
        # 128-4096, 1-8 warps): 256 for 32 experts (18.8 us at 1024), 512 for 256 (25.4 us at 256)
        block = block or (256 if EP <= 128 else 512)
        C = triton.cdiv(self.N, block)
        self._tiles: dict[int, torch.Tensor] = {}
        self._tile_table = None
        if C > self.MAX_CHUNKS:
            self._sort_schedule(ids_N, w_N)
            return
        new = torch.empty if self.N else torch.zeros  # with assignments, the kernels write every entry
        self.slot_N = torch.empty(self.N, dtype=torch.int32, device=dev)
        self.tok_N = torch.empty(self.N, dtype=torch.int32, device=dev)
        self.wgt_N = torch.empty(self.N, dtype=torch.float32, device=dev)
        self.offs = new(n_experts + 1, dtype=torch.int32, device=dev)
        self._tile_table = new(self._BMS, n_experts, dtype=torch.int32, device=dev)
        if not self.N:
            return
        hist = torch.empty(C, EP, dtype=torch.int32, device=dev)
        table = torch.empty(C, EP, dtype=torch.int32, device=dev)
        opts = {} if interpreting() else {"num_warps": 4}
        _sched_hist_kernel[(C,)](ids_N, hist, self.N, n_experts, BLOCK=block, EP=EP, **opts)
        _sched_scatter_kernel[(C,)](
            ids_N, w_N, hist, table, self.slot_N, self.tok_N, self.wgt_N, self.offs, self._tile_table,
            self.N, n_experts, K, BLOCK=block, EP=EP, CB=max(1, min(64, 4096 // EP)), N_BM=self._BMS, **opts,
        )  # fmt: skip

    def _sort_schedule(self, ids_N: torch.Tensor, w_N: torch.Tensor) -> None:
        E = self.E
        # narrow keys: the radix sort makes one pass per key byte (8 for int64 ids)
        keys_N = torch.where((ids_N >= 0) & (ids_N < E), ids_N, E).to(torch.uint8 if E <= 255 else torch.int16)
        keys_N, order_N = keys_N.sort(stable=True)
        self.slot_N = order_N.to(torch.int32)
        self.tok_N = (order_N // self.K).to(torch.int32)
        self.wgt_N = w_N.float().index_select(0, order_N)
        bounds = torch.arange(E + 1, dtype=keys_N.dtype, device=keys_N.device)
        self.offs = torch.searchsorted(keys_N, bounds, out_int32=True)

    @property
    def counts_E(self) -> torch.Tensor:
        return (self.offs[1:] - self.offs[:-1]).long()

    def tile_cum(self, bm: int) -> torch.Tensor:
        """Inclusive cumsum over experts of cdiv(count_e, bm), int32 [E]."""
        s = bm.bit_length() - 5
        if self._tile_table is not None and bm == 16 << s and 0 <= s < self._BMS:
            return self._tile_table[s]
        if bm not in self._tiles:  # a tile the kernel does not tabulate, or no kernel ran
            self._tiles[bm] = ((self.counts_E + bm - 1) // bm).cumsum(0).to(torch.int32)
        return self._tiles[bm]

    def m_tiles(self, bm: int) -> int:
        return triton.cdiv(self.N, bm) + self.E  # upper bound; programs past the last tile exit

    def row_args(self, bm: int) -> tuple:
        return self.tile_cum(bm), self.offs


def _rows_mm(sched, a, a_idx, b, bofs, c, c_idx, KA, NC, stride_bk, stride_bn, cfg, b2=None, b2ofs=None,
             swiglu=None, limit=0.0):  # fmt: skip
    bm, bn, bk = cfg["BM"], _tile(cfg, NC, "BN"), _tile(cfg, KA, "BK")
    grid = (NC // bn, sched.m_tiles(bm))
    gu, wgt, dwgt = swiglu if swiglu is not None else (c, c, c)
    _rows_mm_kernel[grid](
        a, a_idx if a_idx is not None else a, b, b2 if b2 is not None else b, bofs,
        b2ofs if b2ofs is not None else bofs, c, c_idx if c_idx is not None else c, *sched.row_args(bm),
        gu, wgt, dwgt, sched.E, KA, NC, stride_bk, stride_bn, float(limit),
        EP=triton.next_power_of_2(sched.E), BM=bm, BN=bn, BK=bk, A_GATHER=a_idx is not None, DUAL=b2 is not None,
        C_SCATTER=c_idx is not None, SWIGLU_BWD=swiglu is not None, HAS_LIMIT=limit > 0,
        **dot_args(a.dtype), **launch_opts(cfg),
    )  # fmt: skip
    return grid[0]


def _wgrad(sched, a, a_idx, b, b_idx, P, Q, dtype, cfg) -> torch.Tensor:
    c = torch.empty(sched.E, P, Q, dtype=dtype, device=a.device)
    bm, bn, bk = _tile(cfg, P, "BM"), _tile(cfg, Q, "BN"), cfg["BK"]
    grid = ((P // bm) * (Q // bn), sched.E)
    _wgrad_kernel[grid](
        a, a_idx if a_idx is not None else a, b, b_idx if b_idx is not None else b, c, sched.offs, P, Q,
        BM=bm, BN=bn, BK=bk, A_GATHER=a_idx is not None, B_GATHER=b_idx is not None,
        **dot_args(a.dtype), **launch_opts(cfg),
    )  # fmt: skip
    return c


def _up(sched, x_TD, w1, w1ofs, w3, w3ofs, wgt_N, gu, h, limit, cfg):
    D, Fi = x_TD.size(1), h.size(1)
    bm, bn, bk = cfg["BM"], _tile(cfg, Fi, "BN"), _tile(cfg, D, "BK")
    _up_kernel[(Fi // bn, sched.m_tiles(bm))](
        x_TD, w1, w3, w1ofs, w3ofs, sched.tok_N, wgt_N, gu, h, *sched.row_args(bm),
        sched.E, D, Fi, float(limit),
        EP=triton.next_power_of_2(sched.E), BM=bm, BN=bn, BK=bk, HAS_LIMIT=limit > 0,
        **dot_args(x_TD.dtype), **launch_opts(cfg),
    )  # fmt: skip


def _forward(x_TD, wgt_N, sched, w1s, w3s, w2s, limit, offsets):
    D = x_TD.size(1)
    Fi = w1s[0].size(0)
    dev, dt = x_TD.device, x_TD.dtype
    (w1, w3, w2), (w1ofs, w3ofs, w2ofs) = (w1s[0], w3s[0], w2s[0]), offsets
    gu = torch.empty(sched.N, 2 * Fi, dtype=dt, device=dev)
    h = torch.empty(sched.N, Fi, dtype=dt, device=dev)
    y = torch.empty(sched.N, D, dtype=dt, device=dev)
    if sched.N:
        _up(sched, x_TD, w1, w1ofs, w3, w3ofs, wgt_N, gu, h, limit, _config("up", x_TD.dtype))
        # y[slot] = h @ w2[e]ᵀ: B[k=f, j=d] = w2[d, f]
        _rows_mm(sched, h, None, w2, w2ofs, y, sched.slot_N, Fi, D, 1, Fi, _config("down", x_TD.dtype))
    return y, gu, h, (w1, w1ofs, w3, w3ofs, w2, w2ofs)


class _MoEExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, weights_TK, topk_idx_TK, n_experts, limit, offsets, *ws):
        E = n_experts
        w1s, w3s, w2s = ws[:E], ws[E : 2 * E], ws[2 * E :]
        sched = _Schedule(topk_idx_TK, weights_TK, E)
        wgt_N = sched.wgt_N
        y, gu, h, wtab = _forward(x_TD, wgt_N, sched, w1s, w3s, w2s, limit, offsets)
        ctx.save_for_backward(x_TD, wgt_N, gu, h, *ws)
        ctx.sched, ctx.wtab, ctx.limit, ctx.E = sched, wtab, limit, E
        return y.view(sched.T, sched.K, -1)

    @staticmethod
    def backward(ctx, dy_TKD):
        x_TD, wgt_N, gu, h, *ws = ctx.saved_tensors
        sched, limit = ctx.sched, ctx.limit
        w1, w1ofs, w3, w3ofs, w2, w2ofs = ctx.wtab
        T, D = x_TD.shape
        Fi = h.size(1)
        dy = dy_TKD.contiguous().view(sched.N, D).to(x_TD.dtype)
        dgu = torch.empty_like(gu)
        dx_N = torch.empty(sched.N, D, dtype=x_TD.dtype, device=x_TD.device)
        cfg_dh, cfg_dx, cfg_wg = (_config(k, x_TD.dtype) for k in ("dh", "dx", "wgrad"))
        n_ft = Fi // _tile(cfg_dh, Fi, "BN")
        dwgt_part = torch.zeros(sched.N, n_ft, dtype=torch.float32, device=x_TD.device)
        if sched.N:
            # dh = dy[slot] @ w2[e]: B[k=d, j=f] = w2[d, f]; SwiGLU backward in the epilogue
            _rows_mm(sched, dy, sched.slot_N, w2, w2ofs, dgu, None, D, Fi, Fi, 1, cfg_dh,
                     swiglu=(gu, wgt_N, dwgt_part), limit=limit)  # fmt: skip
            # dx[slot] = dg @ w1[e] + du @ w3[e]: B[k=f, j=d] = w[f, d]
            _rows_mm(sched, dgu, None, w1, w1ofs, dx_N, sched.slot_N, Fi, D, D, 1, cfg_dx, b2=w3, b2ofs=w3ofs)
        dx_TD = torch.empty_like(x_TD)
        if T:
            bd = min(triton.next_power_of_2(D), 256)
            _sum_slots_kernel[(triton.cdiv(T, 16), triton.cdiv(D, bd))](
                dx_N, dx_TD, T, D, K=sched.K, BT=16, BD=bd, **({} if interpreting() else {"num_warps": 4})
            )
        dW13 = _wgrad(sched, dgu, None, x_TD, sched.tok_N, 2 * Fi, D, ws[0].dtype, cfg_wg)
        dW2 = _wgrad(sched, dy, sched.slot_N, h, None, D, Fi, ws[0].dtype, cfg_wg)
        dweights = dwgt_part.sum(1)  # already in slot (token, k) order
        grads = (*dW13[:, :Fi].unbind(0), *dW13[:, Fi:].unbind(0), *dW2.unbind(0))
        return dx_TD, dweights.view(T, sched.K), None, None, None, None, *grads


def moe_experts(
    x_TD: torch.Tensor,
    weights_TK: torch.Tensor,
    topk_idx_TK: torch.Tensor,
    w1s: list[torch.Tensor],
    w3s: list[torch.Tensor],
    w2s: list[torch.Tensor],
    swiglu_limit: float = 0.0,
    offsets: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Routed experts of every assignment: x [T, D] (bf16/fp16/fp32), weights [T, K] fp32 routing
    weights (differentiable), topk_idx [T, K] int expert ids, w1s / w3s [F, D] and w2s [D, F] per
    expert (model.moe.Expert's w1, w3, w2) -> y [T, K, D] in x's dtype, slot (t, k) = expert
    topk_idx[t, k]'s output for token t times its weight. Gradients for x, weights and all weights.
    `offsets`: `expert_offsets(w1s, w3s, w2s)` made beforehand, as a compiled caller must (it reads
    no data pointer); None looks them up here."""
    E = len(w1s)
    if len(w3s) != E or len(w2s) != E or E == 0:
        raise ValueError(f"need one w1, w3 and w2 per expert, got {len(w1s)}, {len(w3s)} and {len(w2s)}")
    if x_TD.ndim != 2 or topk_idx_TK.shape != weights_TK.shape or topk_idx_TK.size(0) != x_TD.size(0):
        raise ValueError(f"need x [T, D] and weights / topk_idx [T, K]; got x {list(x_TD.shape)}, weights "
                         f"{list(weights_TK.shape)}, topk_idx {list(topk_idx_TK.shape)}")  # fmt: skip
    Fi, D = w1s[0].shape
    if x_TD.size(1) != D or w2s[0].shape != (D, Fi) or w3s[0].shape != (Fi, D):
        raise ValueError(f"need w1 / w3 [F, D] and w2 [D, F] for x [T, {x_TD.size(1)}]; got w1 {list(w1s[0].shape)}, "
                         f"w3 {list(w3s[0].shape)}, w2 {list(w2s[0].shape)}")  # fmt: skip
    if any(w.dtype != x_TD.dtype for w in (*w1s, *w3s, *w2s)):
        raise ValueError(f"the experts' weights must share x's dtype {x_TD.dtype}")
    ws = [w.contiguous() for w in (*w1s, *w3s, *w2s)]
    if offsets is None:
        offsets = expert_offsets(ws[:E], ws[E : 2 * E], ws[2 * E :])
    return _MoEExperts.apply(x_TD.contiguous(), weights_TK, topk_idx_TK, E, float(swiglu_limit), offsets, *ws)


def moe_ref(
    x_TD: torch.Tensor,
    weights_TK: torch.Tensor,
    topk_idx_TK: torch.Tensor,
    w1s: list[torch.Tensor],
    w3s: list[torch.Tensor],
    w2s: list[torch.Tensor],
    swiglu_limit: float = 0.0,
) -> torch.Tensor:
    """Torch reference of `moe_experts`: sort by expert, run each expert's clamped SwiGLU on its own
    rows (model.moe.Expert's arithmetic), return the [T, K, D] slot outputs."""
    T, K = topk_idx_TK.shape
    E = len(w1s)
    expert_N = topk_idx_TK.flatten()
    order_N = expert_N.argsort(stable=True)
    x_ND = x_TD.index_select(0, order_N // K)
    w_N1 = weights_TK.flatten().index_select(0, order_N).unsqueeze(-1)
    outs, start = [], 0
    for e, n in enumerate(torch.bincount(expert_N, minlength=E).tolist()):
        if n:
            xe = x_ND[start : start + n]
            gate = F.linear(xe, w1s[e]).float()
            up = F.linear(xe, w3s[e]).float()
            if swiglu_limit > 0:
                up = up.clamp(min=-swiglu_limit, max=swiglu_limit)
                gate = gate.clamp(max=swiglu_limit)
            hid = w_N1[start : start + n] * (F.silu(gate) * up)
            outs.append(F.linear(hid.to(x_TD.dtype), w2s[e]))
            start += n
    y_ND = torch.cat(outs, 0) if outs else x_TD.new_zeros(0, x_TD.size(1))
    inverse_N = torch.empty_like(order_N)
    inverse_N[order_N] = torch.arange(order_N.numel(), device=order_N.device)
    return y_ND.index_select(0, inverse_N).view(T, K, -1)
