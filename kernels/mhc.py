"""Triton Single-Pass mHC: one fused kernel per sub-layer boundary, forward and backward (spec §3.2).

At a boundary the reference runs hc_post (previous sub-layer's output into the 4 streams), then
hc_mixes + hc_split_sinkhorn (next sub-layer's coefficients from the new stream) and hc_pre (next
sub-layer's input, with the `pre` carried from the sub-layer before). Per token and per d of the
model dim, unfused that is read f + 4 streams, write 4 (hc_post), read 4 (mixes: RMS and the
projection), read 4 + write 1 (hc_pre): 18-20·d values. The fused kernel reads f and the 4 streams
once and writes the 4 new streams and the sub-layer input once: 10·d. The model dim is split across
programs for parallelism, each leaving a 33-float partial (X·fnᵀ and Σx²) per token that a small
kernel reduces before the RMS scaling and the Sinkhorn (20 iterations on a 4x4 per token).
Backward reads f, the 4 residual streams, the 4 stream grads and the input grad and writes the 5
input grads (15·d), recomputing the new stream instead of storing it, and recomputes Sinkhorn.
hc_mult is fixed at 4. The torch references live in `model/mhc.py` and are re-exported `_ref`.
Not here: the Block's bookkeeping of which `pre` feeds which sub-layer (model/transformer.py).

Shape legend: T tokens (flattened leading dims), D model dim, C = 4 streams, M = 24 mixes padded
to P = 32, BT/BD the token/dim tile of a program.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.quant import cast_rne
from model.mhc import hc_mixes as hc_mixes_ref
from model.mhc import hc_post as hc_post_ref
from model.mhc import hc_pre as hc_pre_ref
from model.mhc import hc_split_sinkhorn as hc_split_sinkhorn_ref

__all__ = [
    "hc_split_sinkhorn",
    "hc_post_mixes_pre",
    "hc_mixes_pre",
    "hc_post_mixes_pre_ref",
    "hc_mixes_pre_ref",
    "hc_mixes_ref",
    "hc_post_ref",
    "hc_pre_ref",
    "hc_split_sinkhorn_ref",
]

HC = 4
N_MIX = (2 + HC) * HC  # 24
# Launch tiles (bench/kernels.py sweeps them): tokens and model-dim columns per tile, warps.
# Launch tiles, the best of bench/kernels.py's sweep on one H200 (T 8192, D 5120, bf16): BT tokens x
# BD model-dim columns per tile; "programs" is how many programs to aim for by splitting D (forward)
# or the tokens (backward), whose partials a small kernel / torch then reduces. num_stages 1: the
# software-pipelined D loop (num_stages 3) overflowed shared memory; num_stages 2 measured slower.
CONFIG = {"BT": 16, "BD": 64, "num_warps": 4, "num_stages": 1, "programs": 2048}
# The fused forward boundary (_hc_fwd_kernel + _hc_finalize_kernel) has its own tiles: wider token
# tiles amortise the fn slice each program reads per D chunk (the sweep at T 4096, D 5120: 0.62 ms
# for BT 64 x BD 32 against 1.10 ms with the backward's 16 x 64).
# BT_FINALIZE: tokens per program of the finalize (the D-split partials' sum and Sinkhorn, each token on
# its own): a decode step has a few to a few hundred tokens, and with the forward's 64 one program ran a
# whole 64-row step's Sinkhorn. bench/kernels.py --only mhc_decode on an H100, the fused boundary at
# `small`'s width: 8 against 64 took 21.9 / 26.0 / 27.7 us against 29.7 / 42.5 / 46.0 at 1 / 64 / 256 tokens
FWD_CONFIG = {"BT": 64, "BD": 32, "num_warps": 4, "num_stages": 1, "programs": 1024, "BT_FINALIZE": 8}


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# fp32 dot precision for the coefficient projection: 3xTF32 is ~fp32 accurate on tensor cores; the
# plain-FMA "ieee" path is the fallback if this Triton build refuses it.
_DOT_PREC = ["tf32x3"]


# ------------------------------------------------------------------------------------------------
# Sinkhorn on a tile of tokens: pre/post [BT, 4], comb [BT, 4, 4]


@triton.jit
def _load_mix_tile(mix_ptr, t_T, mask_T):
    k_C = tl.arange(0, 4)
    j_C = tl.arange(0, 4)
    m_pre_TC = tl.load(mix_ptr + t_T[:, None] * 24 + k_C[None, :], mask=mask_T[:, None], other=0.0)
    m_post_TC = tl.load(mix_ptr + t_T[:, None] * 24 + 4 + k_C[None, :], mask=mask_T[:, None], other=0.0)
    offs_TCC = t_T[:, None, None] * 24 + 8 + j_C[None, :, None] * 4 + k_C[None, None, :]
    m_comb_TCC = tl.load(mix_ptr + offs_TCC, mask=mask_T[:, None, None], other=0.0)
    return m_pre_TC, m_post_TC, m_comb_TCC


@triton.jit
def _softmax_rows(z_TCC):
    e_TCC = tl.exp(z_TCC - tl.max(z_TCC, axis=2)[:, :, None])
    return e_TCC / tl.sum(e_TCC, axis=2)[:, :, None]


@triton.jit
def _norm_step(c_TCC, is_col, eps):
    """One Sinkhorn pass: divide by column sums (over j, axis 1) or row sums (over k, axis 2) + eps."""
    cs = tl.sum(c_TCC, axis=1)[:, None, :]
    rs = tl.sum(c_TCC, axis=2)[:, :, None]
    return c_TCC / (tl.where(is_col, cs, rs) + eps)


@triton.jit
def _sinkhorn_tile_fwd(
    mix_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, t_T, mask_T, ITERS: tl.constexpr, eps
):
    k_C = tl.arange(0, 4)
    j_C = tl.arange(0, 4)
    m_pre_TC, m_post_TC, m_comb_TCC = _load_mix_tile(mix_ptr, t_T, mask_T)
    s0 = tl.load(scale_ptr)
    s1 = tl.load(scale_ptr + 1)
    s2 = tl.load(scale_ptr + 2)
    b_pre_C = tl.load(base_ptr + k_C)
    b_post_C = tl.load(base_ptr + 4 + k_C)
    b_comb_CC = tl.load(base_ptr + 8 + j_C[:, None] * 4 + k_C[None, :])
    pre_TC = tl.sigmoid(m_pre_TC * s0 + b_pre_C[None, :]) + eps
    post_TC = 2.0 * tl.sigmoid(m_post_TC * s1 + b_post_C[None, :])
    c_TCC = _softmax_rows(m_comb_TCC * s2 + b_comb_CC[None, :, :]) + eps
    c_TCC = _norm_step(c_TCC, True, eps)
    for _ in range(ITERS - 1):
        c_TCC = _norm_step(c_TCC, False, eps)
        c_TCC = _norm_step(c_TCC, True, eps)
    offs_TC = t_T[:, None] * 4 + k_C[None, :]
    tl.store(pre_ptr + offs_TC, pre_TC, mask=mask_T[:, None])
    tl.store(post_ptr + offs_TC, post_TC, mask=mask_T[:, None])
    offs_TCC = t_T[:, None, None] * 16 + j_C[None, :, None] * 4 + k_C[None, None, :]
    tl.store(comb_ptr + offs_TCC, c_TCC, mask=mask_T[:, None, None])


@triton.jit
def _sinkhorn_fwd_kernel(
    mix_ptr,
    scale_ptr,
    base_ptr,
    pre_ptr,
    post_ptr,
    comb_ptr,
    n_tok,
    eps,
    ITERS: tl.constexpr,
    BT: tl.constexpr,
):
    t_T = tl.program_id(0) * BT + tl.arange(0, BT)
    _sinkhorn_tile_fwd(mix_ptr, scale_ptr, base_ptr, pre_ptr, post_ptr, comb_ptr, t_T, t_T < n_tok, ITERS, eps)


@triton.jit
def _sinkhorn_bwd_kernel(
    mix_ptr, r_ptr, scale_ptr, base_ptr, gpre_ptr, gpost_ptr, gcomb_ptr,
    gmix_ptr, coef_ptr, gsb_ptr, scratch_ptr, n_tok, inv_n, eps,
    ITERS: tl.constexpr, HAS_R: tl.constexpr, BT: tl.constexpr,
):  # fmt: skip
    """d(pre, post, comb)/d(mixes, scale, base). Sinkhorn is recomputed forward once, storing the
    input of each of the 2·ITERS-1 passes in scratch [T, 2·ITERS-1, 16] (the same threads read them
    back in reverse). With HAS_R the mixes came from
    hc_mixes (a = X·fnᵀ, mixes = a·r): writes g_a = g_mixes·r into gmix [T, 32] (zero padded) and
    coef = -(Σ g_mixes·mixes)·r²·inv_n, the RMS-statistic term of dX = g_a·fn + coef·X.
    gsb [programs, 32]: this program's partial sums, [0:24] = d base, [24:27] = d scale."""
    pid = tl.program_id(0)
    t_T = pid * BT + tl.arange(0, BT)
    mask_T = t_T < n_tok
    k_C = tl.arange(0, 4)
    j_C = tl.arange(0, 4)
    m_pre_TC, m_post_TC, m_comb_TCC = _load_mix_tile(mix_ptr, t_T, mask_T)
    s0 = tl.load(scale_ptr)
    s1 = tl.load(scale_ptr + 1)
    s2 = tl.load(scale_ptr + 2)
    offs_TC = t_T[:, None] * 4 + k_C[None, :]
    offs_TCC = t_T[:, None, None] * 16 + j_C[None, :, None] * 4 + k_C[None, None, :]
    # pre = sigmoid(z) + eps ; post = 2 sigmoid(z)
    sg_TC = tl.sigmoid(m_pre_TC * s0 + tl.load(base_ptr + k_C)[None, :])
    gz_pre_TC = tl.load(gpre_ptr + offs_TC, mask=mask_T[:, None], other=0.0) * sg_TC * (1.0 - sg_TC)
    sg_TC = tl.sigmoid(m_post_TC * s1 + tl.load(base_ptr + 4 + k_C)[None, :])
    gz_post_TC = tl.load(gpost_ptr + offs_TC, mask=mask_T[:, None], other=0.0) * 2.0 * sg_TC * (1.0 - sg_TC)
    # comb: softmax + eps, then NSTEP alternating normalisations (even step = column, odd = row)
    b_comb_CC = tl.load(base_ptr + 8 + j_C[:, None] * 4 + k_C[None, :])
    p_TCC = _softmax_rows(m_comb_TCC * s2 + b_comb_CC[None, :, :])
    c0_TCC = p_TCC + eps
    g_TCC = tl.load(gcomb_ptr + offs_TCC, mask=mask_T[:, None, None], other=0.0)
    NSTEP: tl.constexpr = 2 * ITERS - 1
    scr_TCC = scratch_ptr + t_T[:, None, None] * (NSTEP * 16) + j_C[None, :, None] * 4 + k_C[None, None, :]
    c_TCC = c0_TCC
    for n in range(NSTEP):
        tl.store(scr_TCC + n * 16, c_TCC, mask=mask_T[:, None, None])
        c_TCC = _norm_step(c_TCC, n % 2 == 0, eps)
    tl.debug_barrier()
    for i in range(NSTEP):
        n = NSTEP - 1 - i
        c_TCC = tl.load(scr_TCC + n * 16, mask=mask_T[:, None, None], other=1.0)
        is_col = n % 2 == 0
        s_TCC = tl.where(is_col, tl.sum(c_TCC, axis=1)[:, None, :], tl.sum(c_TCC, axis=2)[:, :, None]) + eps
        gy_TCC = g_TCC * (c_TCC / s_TCC)
        gs_TCC = tl.where(is_col, tl.sum(gy_TCC, axis=1)[:, None, :], tl.sum(gy_TCC, axis=2)[:, :, None])
        g_TCC = (g_TCC - gs_TCC) / s_TCC
    gz_comb_TCC = p_TCC * (g_TCC - tl.sum(g_TCC * p_TCC, axis=2)[:, :, None])
    gz_comb_TCC = tl.where(mask_T[:, None, None], gz_comb_TCC, 0.0)
    # d mixes, d scale, d base
    gm_pre_TC = gz_pre_TC * s0
    gm_post_TC = gz_post_TC * s1
    gm_comb_TCC = gz_comb_TCC * s2
    if HAS_R:
        r_T = tl.load(r_ptr + t_T, mask=mask_T, other=0.0)
        dot_T = tl.sum(gm_pre_TC * m_pre_TC, axis=1) + tl.sum(gm_post_TC * m_post_TC, axis=1)
        dot_T += tl.sum(tl.sum(gm_comb_TCC * m_comb_TCC, axis=2), axis=1)
        tl.store(coef_ptr + t_T, -dot_T * r_T * r_T * inv_n, mask=mask_T)
        gm_pre_TC *= r_T[:, None]
        gm_post_TC *= r_T[:, None]
        gm_comb_TCC *= r_T[:, None, None]
    tl.store(gmix_ptr + t_T[:, None] * 32 + k_C[None, :], gm_pre_TC, mask=mask_T[:, None])
    tl.store(gmix_ptr + t_T[:, None] * 32 + 4 + k_C[None, :], gm_post_TC, mask=mask_T[:, None])
    g_offs_TCC = t_T[:, None, None] * 32 + 8 + j_C[None, :, None] * 4 + k_C[None, None, :]
    tl.store(gmix_ptr + g_offs_TCC, gm_comb_TCC, mask=mask_T[:, None, None])
    tl.store(
        gmix_ptr + t_T[:, None] * 32 + 24 + 2 * k_C[None, :],
        tl.zeros((BT, 4), tl.float32),
        mask=mask_T[:, None],
    )
    tl.store(
        gmix_ptr + t_T[:, None] * 32 + 25 + 2 * k_C[None, :],
        tl.zeros((BT, 4), tl.float32),
        mask=mask_T[:, None],
    )
    # per-program partial sums (masked rows contribute 0: their incoming grads were loaded as 0)
    gsb = gsb_ptr + pid * 32
    tl.store(gsb + k_C, tl.sum(gz_pre_TC, axis=0))
    tl.store(gsb + 4 + k_C, tl.sum(gz_post_TC, axis=0))
    tl.store(gsb + 8 + j_C[:, None] * 4 + k_C[None, :], tl.sum(gz_comb_TCC, axis=0))
    tl.store(gsb + 24, tl.sum(tl.sum(gz_pre_TC * m_pre_TC, axis=1), axis=0))
    tl.store(gsb + 25, tl.sum(tl.sum(gz_post_TC * m_post_TC, axis=1), axis=0))
    tl.store(gsb + 26, tl.sum(tl.sum(tl.sum(gz_comb_TCC * m_comb_TCC, axis=2), axis=1), axis=0))


# ------------------------------------------------------------------------------------------------
# fused boundary, forward


@triton.jit
def _hc_fwd_kernel(
    f_ptr, res_ptr, post_ptr, comb_ptr, pc_ptr, fn_ptr,
    xnew_ptr, xin_ptr, pacc_ptr, psq_ptr,
    n_tok, D, d_per_split,
    HAS_POST: tl.constexpr, DOT_PREC: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
):  # fmt: skip
    """Grid (T/BT, D splits). Writes x_new and x_in for its tile (elementwise: x_in uses the carried
    pre, not the new mixes) and its partial projection X·fnᵀ [BT, 32] and Σx² [BT] over its columns
    into pacc [splits, T, 32] / psq [splits, T]; `_hc_finalize_kernel` reduces them."""
    pid_t = tl.program_id(0)
    pid_s = tl.program_id(1)
    t_T = pid_t * BT + tl.arange(0, BT)
    mask_T = t_T < n_tok
    t64_T = t_T.to(tl.int64)
    n_P = tl.arange(0, 32)
    acc_TP = tl.zeros((BT, 32), tl.float32)
    sq_TD = tl.zeros((BT, BD), tl.float32)
    OUT_DTYPE: tl.constexpr = xin_ptr.dtype.element_ty
    d_start = pid_s * d_per_split
    d_end = tl.minimum(d_start + d_per_split, D)
    for d0 in range(d_start, d_end, BD):
        d_D = d0 + tl.arange(0, BD)
        mask_D = d_D < d_end
        mask_TD = mask_T[:, None] & mask_D[None, :]
        res_offs_TD = t64_T[:, None] * (4 * D) + d_D[None, :]
        f_offs_TD = t64_T[:, None] * D + d_D[None, :]
        if HAS_POST:
            f_TD = tl.load(f_ptr + f_offs_TD, mask=mask_TD, other=0.0).to(tl.float32)
            r0 = tl.load(res_ptr + res_offs_TD, mask=mask_TD, other=0.0).to(tl.float32)
            r1 = tl.load(res_ptr + res_offs_TD + D, mask=mask_TD, other=0.0).to(tl.float32)
            r2 = tl.load(res_ptr + res_offs_TD + 2 * D, mask=mask_TD, other=0.0).to(tl.float32)
            r3 = tl.load(res_ptr + res_offs_TD + 3 * D, mask=mask_TD, other=0.0).to(tl.float32)
        xin_TD = tl.zeros((BT, BD), tl.float32)
        for k in tl.static_range(4):
            if HAS_POST:
                # the reference's op order: ((c0k·r0 + c1k·r1) + c2k·r2) + c3k·r3, then post_k·f + that
                acc = tl.load(comb_ptr + t_T * 16 + k, mask=mask_T, other=0.0)[:, None] * r0
                acc = acc + tl.load(comb_ptr + t_T * 16 + 4 + k, mask=mask_T, other=0.0)[:, None] * r1
                acc = acc + tl.load(comb_ptr + t_T * 16 + 8 + k, mask=mask_T, other=0.0)[:, None] * r2
                acc = acc + tl.load(comb_ptr + t_T * 16 + 12 + k, mask=mask_T, other=0.0)[:, None] * r3
                p_T = tl.load(post_ptr + t_T * 4 + k, mask=mask_T, other=0.0)
                x_TD = cast_rne(p_T[:, None] * f_TD + acc, OUT_DTYPE)
                tl.store(xnew_ptr + res_offs_TD + k * D, x_TD, mask=mask_TD)
                x_TD = x_TD.to(tl.float32)
            else:
                x_TD = tl.load(res_ptr + res_offs_TD + k * D, mask=mask_TD, other=0.0).to(tl.float32)
            sq_TD += x_TD * x_TD
            fn_DP = tl.load(
                fn_ptr + n_P[None, :] * (4 * D) + (k * D + d_D)[:, None],
                mask=(n_P < 24)[None, :] & mask_D[:, None],
                other=0.0,
            )
            acc_TP = tl.dot(x_TD, fn_DP, acc_TP, input_precision=DOT_PREC)
            pc_T = tl.load(pc_ptr + t_T * 4 + k, mask=mask_T, other=0.0)
            if k == 0:
                xin_TD = pc_T[:, None] * x_TD
            else:
                xin_TD = xin_TD + pc_T[:, None] * x_TD
        tl.store(xin_ptr + f_offs_TD, cast_rne(xin_TD, OUT_DTYPE), mask=mask_TD)
    part_T = pid_s * n_tok + t_T
    tl.store(pacc_ptr + part_T[:, None] * 32 + n_P[None, :], acc_TP, mask=mask_T[:, None])
    tl.store(psq_ptr + part_T, tl.sum(sq_TD, axis=1), mask=mask_T)


@triton.jit
def _hc_finalize_kernel(
    pacc_ptr, psq_ptr, scale_ptr, base_ptr, mix_ptr, r_ptr, pre_n_ptr, post_n_ptr, comb_n_ptr,
    n_tok, n_split, n_mean, norm_eps, hc_eps,
    ITERS: tl.constexpr, BT: tl.constexpr,
):  # fmt: skip
    """Sum the D-split partials: r = rsqrt(Σx²/(4D) + norm_eps), mixes = (X·fnᵀ)·r, then Sinkhorn."""
    t_T = tl.program_id(0) * BT + tl.arange(0, BT)
    mask_T = t_T < n_tok
    n_P = tl.arange(0, 32)
    acc_TP = tl.zeros((BT, 32), tl.float32)
    sq_T = tl.zeros((BT,), tl.float32)
    for sp in range(n_split):
        acc_TP += tl.load(pacc_ptr + (sp * n_tok + t_T)[:, None] * 32 + n_P[None, :], mask=mask_T[:, None], other=0.0)
        sq_T += tl.load(psq_ptr + sp * n_tok + t_T, mask=mask_T, other=0.0)
    r_T = 1.0 / tl.sqrt_rn(sq_T / n_mean + norm_eps)
    tl.store(r_ptr + t_T, r_T, mask=mask_T)
    mix_TP = acc_TP * r_T[:, None]
    tl.store(mix_ptr + t_T[:, None] * 24 + n_P[None, :], mix_TP, mask=mask_T[:, None] & (n_P < 24)[None, :])
    tl.debug_barrier()  # this program's mixes are re-read below in the Sinkhorn tile layout
    _sinkhorn_tile_fwd(mix_ptr, scale_ptr, base_ptr, pre_n_ptr, post_n_ptr, comb_n_ptr, t_T, mask_T, ITERS, hc_eps)


# ------------------------------------------------------------------------------------------------
# fused boundary, backward


@triton.jit
def _hc_bwd_kernel(
    f_ptr, res_ptr, post_ptr, comb_ptr, pc_ptr, fn_ptr, ga_ptr, coef_ptr,
    gxnew_ptr, gxin_ptr, gf_ptr, gres_ptr, part_ptr, gfn_ptr,
    n_tok, D, tok_per_split,
    HAS_POST: tl.constexpr, DOT_PREC: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
):  # fmt: skip
    """Grid (D/BD, splits). Program (c, s) owns columns [c·BD, (c+1)·BD) of every stream and the
    tokens of split s. Writes g_f / g_res tiles, per-token partial sums over its columns into
    part [D/BD, T, 24] (0:4 g_pc, 4:8 g_post, 8:24 g_comb[j, k]) and its g_fn partial into
    gfn [splits, 24, 4D]."""
    cid = tl.program_id(0)
    sid = tl.program_id(1)
    d_D = cid * BD + tl.arange(0, BD)
    mask_D = d_D < D
    n_P = tl.arange(0, 32)
    fn_mask_PD = (n_P < 24)[:, None] & mask_D[None, :]
    gfn0 = tl.zeros((32, BD), tl.float32)
    gfn1 = tl.zeros((32, BD), tl.float32)
    gfn2 = tl.zeros((32, BD), tl.float32)
    gfn3 = tl.zeros((32, BD), tl.float32)
    t_start = sid * tok_per_split
    for t0 in range(t_start, t_start + tok_per_split, BT):
        t_T = t0 + tl.arange(0, BT)
        mask_T = t_T < n_tok
        t64_T = t_T.to(tl.int64)
        mask_TD = mask_T[:, None] & mask_D[None, :]
        res_offs_TD = t64_T[:, None] * (4 * D) + d_D[None, :]
        f_offs_TD = t64_T[:, None] * D + d_D[None, :]
        gxin_TD = tl.load(gxin_ptr + f_offs_TD, mask=mask_TD, other=0.0).to(tl.float32)
        ga_TP = tl.load(ga_ptr + t_T[:, None] * 32 + n_P[None, :], mask=mask_T[:, None], other=0.0)
        coef_T = tl.load(coef_ptr + t_T, mask=mask_T, other=0.0)
        part = part_ptr + (cid * n_tok + t_T) * 24
        if HAS_POST:
            f_TD = tl.load(f_ptr + f_offs_TD, mask=mask_TD, other=0.0).to(tl.float32)
            r0 = tl.load(res_ptr + res_offs_TD, mask=mask_TD, other=0.0).to(tl.float32)
            r1 = tl.load(res_ptr + res_offs_TD + D, mask=mask_TD, other=0.0).to(tl.float32)
            r2 = tl.load(res_ptr + res_offs_TD + 2 * D, mask=mask_TD, other=0.0).to(tl.float32)
            r3 = tl.load(res_ptr + res_offs_TD + 3 * D, mask=mask_TD, other=0.0).to(tl.float32)
            gf_TD = tl.zeros((BT, BD), tl.float32)
            gr0 = tl.zeros((BT, BD), tl.float32)
            gr1 = tl.zeros((BT, BD), tl.float32)
            gr2 = tl.zeros((BT, BD), tl.float32)
            gr3 = tl.zeros((BT, BD), tl.float32)
        for k in tl.static_range(4):
            if HAS_POST:
                c0 = tl.load(comb_ptr + t_T * 16 + k, mask=mask_T, other=0.0)[:, None]
                c1 = tl.load(comb_ptr + t_T * 16 + 4 + k, mask=mask_T, other=0.0)[:, None]
                c2 = tl.load(comb_ptr + t_T * 16 + 8 + k, mask=mask_T, other=0.0)[:, None]
                c3 = tl.load(comb_ptr + t_T * 16 + 12 + k, mask=mask_T, other=0.0)[:, None]
                p_T = tl.load(post_ptr + t_T * 4 + k, mask=mask_T, other=0.0)
                acc = c0 * r0
                acc = acc + c1 * r1
                acc = acc + c2 * r2
                acc = acc + c3 * r3
                x_TD = cast_rne(p_T[:, None] * f_TD + acc, f_ptr.dtype.element_ty).to(tl.float32)
            else:
                x_TD = tl.load(res_ptr + res_offs_TD + k * D, mask=mask_TD, other=0.0).to(tl.float32)
            fn_PD = tl.load(fn_ptr + n_P[:, None] * (4 * D) + (k * D + d_D)[None, :], mask=fn_mask_PD, other=0.0)
            pc_T = tl.load(pc_ptr + t_T * 4 + k, mask=mask_T, other=0.0)
            g_TD = tl.dot(ga_TP, fn_PD, input_precision=DOT_PREC) + coef_T[:, None] * x_TD
            g_TD += pc_T[:, None] * gxin_TD
            tl.store(part + k, tl.sum(gxin_TD * x_TD, axis=1), mask=mask_T)
            x_TD = tl.where(mask_TD, x_TD, 0.0)
            if k == 0:
                gfn0 = tl.dot(tl.trans(ga_TP), x_TD, gfn0, input_precision=DOT_PREC)
            elif k == 1:
                gfn1 = tl.dot(tl.trans(ga_TP), x_TD, gfn1, input_precision=DOT_PREC)
            elif k == 2:
                gfn2 = tl.dot(tl.trans(ga_TP), x_TD, gfn2, input_precision=DOT_PREC)
            else:
                gfn3 = tl.dot(tl.trans(ga_TP), x_TD, gfn3, input_precision=DOT_PREC)
            if HAS_POST:
                g_TD += tl.load(gxnew_ptr + res_offs_TD + k * D, mask=mask_TD, other=0.0).to(tl.float32)
                gf_TD += p_T[:, None] * g_TD
                tl.store(part + 4 + k, tl.sum(g_TD * f_TD, axis=1), mask=mask_T)
                gr0 += c0 * g_TD
                gr1 += c1 * g_TD
                gr2 += c2 * g_TD
                gr3 += c3 * g_TD
                tl.store(part + 8 + k, tl.sum(g_TD * r0, axis=1), mask=mask_T)
                tl.store(part + 12 + k, tl.sum(g_TD * r1, axis=1), mask=mask_T)
                tl.store(part + 16 + k, tl.sum(g_TD * r2, axis=1), mask=mask_T)
                tl.store(part + 20 + k, tl.sum(g_TD * r3, axis=1), mask=mask_T)
            else:
                g_ty = gres_ptr.dtype.element_ty
                tl.store(gres_ptr + res_offs_TD + k * D, cast_rne(g_TD, g_ty), mask=mask_TD)
        if HAS_POST:
            tl.store(gf_ptr + f_offs_TD, cast_rne(gf_TD, gf_ptr.dtype.element_ty), mask=mask_TD)
            out_ty = gres_ptr.dtype.element_ty
            tl.store(gres_ptr + res_offs_TD, cast_rne(gr0, out_ty), mask=mask_TD)
            tl.store(gres_ptr + res_offs_TD + D, cast_rne(gr1, out_ty), mask=mask_TD)
            tl.store(gres_ptr + res_offs_TD + 2 * D, cast_rne(gr2, out_ty), mask=mask_TD)
            tl.store(gres_ptr + res_offs_TD + 3 * D, cast_rne(gr3, out_ty), mask=mask_TD)
    gfn = gfn_ptr + sid * 24 * (4 * D) + n_P[:, None] * (4 * D) + d_D[None, :]
    tl.store(gfn, gfn0, mask=fn_mask_PD)
    tl.store(gfn + D, gfn1, mask=fn_mask_PD)
    tl.store(gfn + 2 * D, gfn2, mask=fn_mask_PD)
    tl.store(gfn + 3 * D, gfn3, mask=fn_mask_PD)


# ------------------------------------------------------------------------------------------------
# launchers


def _launch_opts(cfg: dict | None = None) -> dict:
    # No FMA contraction: hc_post / hc_pre then round exactly like the reference's separate ops.
    cfg = cfg or CONFIG
    return (
        {}
        if _interpreting()
        else {
            "num_warps": cfg["num_warps"],
            "num_stages": cfg["num_stages"],
            "enable_fp_fusion": False,
        }
    )


def _dot_prec() -> str:
    return "ieee" if _interpreting() else _DOT_PREC[0]


def _with_dot_fallback(launch) -> None:
    try:
        launch(_dot_prec())
    except (triton.CompilationError, RuntimeError):  # no 3xTF32 dot in this Triton: FMA fp32 from now on
        if _interpreting() or _DOT_PREC[0] == "ieee":
            raise
        _DOT_PREC[0] = "ieee"
        launch("ieee")


def _check_stream(res: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor) -> tuple[int, int]:
    if res.dim() != 3 or res.size(1) != HC:
        raise ValueError(f"the residual stream must be [T, {HC}, D] (hc_mult = {HC}), got {list(res.shape)}")
    if not res.is_contiguous():
        raise ValueError("the residual stream must be contiguous: pass res.contiguous()")
    T, _, D = res.shape
    if fn.shape != (N_MIX, HC * D) or fn.dtype != torch.float32 or not fn.is_contiguous():
        raise ValueError(f"hc fn must be contiguous fp32 [{N_MIX}, {HC * D}], got {fn.dtype} {list(fn.shape)}")
    if scale.shape != (3,) or base.shape != (N_MIX,) or scale.dtype != torch.float32 or base.dtype != torch.float32:
        raise ValueError(f"hc scale / base must be fp32 [3] / [{N_MIX}], got {scale.dtype} {list(scale.shape)} / "
                         f"{base.dtype} {list(base.shape)}")  # fmt: skip
    return T, D


def _fwd(f, res, post, comb, pc, fn, scale, base, norm_eps, hc_eps, iters):
    T, D = _check_stream(res, fn, scale, base)
    has_post = f is not None
    dtype = f.dtype if has_post else res.dtype
    dev = res.device
    cfg = FWD_CONFIG
    bt, bd = cfg["BT"], cfg["BD"]
    xnew = torch.empty(T, HC, D, dtype=dtype, device=dev) if has_post else res
    xin = torch.empty(T, D, dtype=dtype, device=dev)
    mix = torch.empty(T, N_MIX, dtype=torch.float32, device=dev)
    r = torch.empty(T, dtype=torch.float32, device=dev)
    pre_n = torch.empty(T, HC, dtype=torch.float32, device=dev)
    post_n = torch.empty(T, HC, dtype=torch.float32, device=dev)
    comb_n = torch.empty(T, HC, HC, dtype=torch.float32, device=dev)
    if T:
        n_t = triton.cdiv(T, bt)
        splits = max(1, min(triton.cdiv(D, bd), triton.cdiv(cfg["programs"], n_t)))
        d_per_split = triton.cdiv(triton.cdiv(D, splits), bd) * bd
        splits = triton.cdiv(D, d_per_split)
        pacc = torch.empty(splits, T, 32, dtype=torch.float32, device=dev)
        psq = torch.empty(splits, T, dtype=torch.float32, device=dev)
        args = (f if has_post else res, res, post if has_post else pc, comb if has_post else pc, pc, fn)

        def launch(prec):
            _hc_fwd_kernel[(n_t, splits)](
                *args, xnew, xin, pacc, psq, T, D, d_per_split,
                HAS_POST=has_post, DOT_PREC=prec, BT=bt, BD=bd, **_launch_opts(cfg),
            )  # fmt: skip

        _with_dot_fallback(launch)
        fin_bt = cfg["BT_FINALIZE"]
        _hc_finalize_kernel[(triton.cdiv(T, fin_bt),)](
            pacc, psq, scale, base, mix, r, pre_n, post_n, comb_n,
            T, splits, float(HC * D), norm_eps, hc_eps, ITERS=iters, BT=fin_bt, **_launch_opts(cfg),
        )  # fmt: skip
    return (xnew if has_post else None), xin, mix, r, pre_n, post_n, comb_n


def _sinkhorn_bwd(mix, r, scale, base, g_pre, g_post, g_comb, hc_eps, iters, inv_n):
    T = mix.size(0)
    dev = mix.device
    n_prog = max(1, triton.cdiv(T, CONFIG["BT"]))
    ga = torch.empty(T, 32, dtype=torch.float32, device=dev)
    coef = torch.empty(T, dtype=torch.float32, device=dev)
    gsb = torch.zeros(n_prog, 32, dtype=torch.float32, device=dev)
    scratch = torch.empty(T, 2 * iters - 1, 16, dtype=torch.float32, device=dev)
    if T:
        _sinkhorn_bwd_kernel[(n_prog,)](
            mix, r if r is not None else mix, scale, base,
            g_pre.contiguous(), g_post.contiguous(), g_comb.contiguous(),
            ga, coef, gsb, scratch, T, inv_n, hc_eps,
            ITERS=iters, HAS_R=r is not None, BT=CONFIG["BT"], **_launch_opts(),
        )  # fmt: skip
    return ga, coef, gsb[:, 24:27].sum(0), gsb[:, :24].sum(0)


def _bwd(saved, grads, norm_eps, hc_eps, iters):
    f, res, post, comb, pc, fn, scale, base, mix, r = saved
    g_xnew, g_xin, g_pre, g_post, g_comb = grads
    T, D = _check_stream(res, fn, scale, base)
    has_post = f is not None
    dev = res.device
    ga, coef, g_scale, g_base = _sinkhorn_bwd(mix, r, scale, base, g_pre, g_post, g_comb, hc_eps, iters, 1.0 / (HC * D))
    n_c = triton.cdiv(D, CONFIG["BD"])
    splits = max(1, min(triton.cdiv(T, CONFIG["BT"]), triton.cdiv(CONFIG["programs"], n_c)))
    tok_per_split = triton.cdiv(triton.cdiv(max(T, 1), splits), CONFIG["BT"]) * CONFIG["BT"]
    splits = max(1, triton.cdiv(T, tok_per_split))
    # every (chunk, token, slot) of part and every gfn entry is written by the kernel (part's 4:24
    # only with HAS_POST, and only those are read)
    part = torch.empty(n_c, T, N_MIX, dtype=torch.float32, device=dev)
    gfn = torch.empty(splits, N_MIX, HC * D, dtype=torch.float32, device=dev)
    g_f = torch.empty_like(f) if has_post else None
    g_res = torch.empty_like(res)
    if T:
        g_xin = g_xin.contiguous()
        g_xnew = g_xnew.contiguous() if has_post else g_xin
        args = (
            f if has_post else res,
            res,
            post if has_post else pc,
            comb if has_post else pc,
            pc,
            fn,
            ga,
            coef,
        )
        outs = (g_xnew, g_xin, g_f if has_post else g_res, g_res, part, gfn)

        def launch(prec):
            _hc_bwd_kernel[(n_c, splits)](
                *args, *outs, T, D, tok_per_split,
                HAS_POST=has_post, DOT_PREC=prec, BT=CONFIG["BT"], BD=CONFIG["BD"], **_launch_opts(),
            )  # fmt: skip

        _with_dot_fallback(launch)
    part = part.sum(0)
    g_pc = part[:, 0:4]
    g_post_in = part[:, 4:8] if has_post else None
    g_comb_in = part[:, 8:24].reshape(T, HC, HC) if has_post else None
    return g_f, g_res, g_post_in, g_comb_in, g_pc, gfn.sum(0), g_scale, g_base


class _HcPostMixesPre(torch.autograd.Function):
    @staticmethod
    def forward(ctx, f, res, post, comb, pc, fn, scale, base, norm_eps, hc_eps, iters):
        xnew, xin, mix, r, pre_n, post_n, comb_n = _fwd(
            f, res, post, comb, pc, fn, scale, base, norm_eps, hc_eps, iters
        )
        ctx.save_for_backward(f, res, post, comb, pc, fn, scale, base, mix, r)
        ctx.consts = (norm_eps, hc_eps, iters)
        return xnew, xin, pre_n, post_n, comb_n

    @staticmethod
    def backward(ctx, g_xnew, g_xin, g_pre, g_post, g_comb):
        grads = _bwd(ctx.saved_tensors, (g_xnew, g_xin, g_pre, g_post, g_comb), *ctx.consts)
        return (*grads, None, None, None)


class _HcMixesPre(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, pc, fn, scale, base, norm_eps, hc_eps, iters):
        _, xin, mix, r, pre_n, post_n, comb_n = _fwd(None, x, None, None, pc, fn, scale, base, norm_eps, hc_eps, iters)
        ctx.save_for_backward(x, pc, fn, scale, base, mix, r)
        ctx.consts = (norm_eps, hc_eps, iters)
        return xin, pre_n, post_n, comb_n

    @staticmethod
    def backward(ctx, g_xin, g_pre, g_post, g_comb):
        x, pc, fn, scale, base, mix, r = ctx.saved_tensors
        saved = (None, x, None, None, pc, fn, scale, base, mix, r)
        _, g_x, _, _, g_pc, g_fn, g_scale, g_base = _bwd(saved, (None, g_xin, g_pre, g_post, g_comb), *ctx.consts)
        return g_x, g_pc, g_fn, g_scale, g_base, None, None, None


class _HcSplitSinkhorn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, mix, scale, base, hc_eps, iters):
        T = mix.size(0)
        pre = torch.empty(T, HC, dtype=torch.float32, device=mix.device)
        post = torch.empty_like(pre)
        comb = torch.empty(T, HC, HC, dtype=torch.float32, device=mix.device)
        if T:
            _sinkhorn_fwd_kernel[(triton.cdiv(T, CONFIG["BT"]),)](
                mix, scale, base, pre, post, comb, T, hc_eps, ITERS=iters, BT=CONFIG["BT"], **_launch_opts()
            )
        ctx.save_for_backward(mix, scale, base)
        ctx.consts = (hc_eps, iters)
        return pre, post, comb

    @staticmethod
    def backward(ctx, g_pre, g_post, g_comb):
        mix, scale, base = ctx.saved_tensors
        hc_eps, iters = ctx.consts
        ga, _, g_scale, g_base = _sinkhorn_bwd(mix, None, scale, base, g_pre, g_post, g_comb, hc_eps, iters, 0.0)
        return ga[:, :N_MIX], g_scale, g_base, None, None


# ------------------------------------------------------------------------------------------------
# public API (leading dims are flattened into T; hc_mult = 4)


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t.float().contiguous()


def hc_split_sinkhorn(
    mixes: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    hc_mult: int = HC,
    iters: int = 20,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton `hc_split_sinkhorn`: mixes [..., 24] -> pre [..., 4], post [..., 4], comb [..., 4, 4] fp32."""
    if hc_mult != HC or mixes.size(-1) != N_MIX:
        raise ValueError(f"the kernels are built for hc_mult {HC} ({N_MIX} mixes), got hc_mult {hc_mult} and "
                         f"mixes {list(mixes.shape)}: use impl=torch for other widths")  # fmt: skip
    lead = mixes.shape[:-1]
    pre, post, comb = _HcSplitSinkhorn.apply(_f32(mixes.reshape(-1, N_MIX)), _f32(scale), _f32(base), eps, iters)
    return pre.view(*lead, HC), post.view(*lead, HC), comb.view(*lead, HC, HC)


def hc_post_mixes_pre(
    f: torch.Tensor,
    residual: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    pre_carried: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    *,
    norm_eps: float,
    hc_eps: float,
    iters: int = 20,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused sub-layer boundary. f [..., D] (sub-layer output), residual [..., 4, D], post [..., 4],
    comb [..., 4, 4] (the finished sub-layer's coefficients), pre_carried [..., 4], and the next
    sub-layer's fn [24, 4D] / scale [3] / base [24] (fp32) ->
      x_new = hc_post(f, residual, post, comb)                 [..., 4, D] f.dtype
      x_in  = hc_pre(x_new, pre_carried)                       [..., D]    f.dtype
      pre, post_n, comb_n = hc_split_sinkhorn(hc_mixes(x_new)) [..., 4], [..., 4], [..., 4, 4] fp32
    Differentiable in every tensor argument."""
    if residual.dim() < 2 or residual.shape[-2:] != (HC, f.size(-1)) or residual.shape[:-2] != f.shape[:-1]:
        raise ValueError(f"residual must be f's shape with {HC} streams before the last dim ([..., {HC}, D] "
                         f"for f [..., D]), got f {list(f.shape)} and residual {list(residual.shape)}")  # fmt: skip
    lead, D = f.shape[:-1], f.size(-1)
    outs = _HcPostMixesPre.apply(
        f.reshape(-1, D).contiguous(), residual.reshape(-1, HC, D).contiguous(),
        _f32(post.reshape(-1, HC)), _f32(comb.reshape(-1, HC, HC)), _f32(pre_carried.reshape(-1, HC)),
        _f32(fn), _f32(scale), _f32(base), norm_eps, hc_eps, iters,
    )  # fmt: skip
    xnew, xin, pre_n, post_n, comb_n = outs
    return (
        xnew.view(*lead, HC, D), xin.view(*lead, D),
        pre_n.view(*lead, HC), post_n.view(*lead, HC), comb_n.view(*lead, HC, HC),
    )  # fmt: skip


def hc_mixes_pre(
    x: torch.Tensor,
    pre_carried: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    *,
    norm_eps: float,
    hc_eps: float,
    iters: int = 20,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Boundary without a preceding hc_post (the first block): x [..., 4, D] ->
    (hc_pre(x, pre_carried) [..., D], pre, post, comb of hc_split_sinkhorn(hc_mixes(x)))."""
    if x.dim() < 2 or x.size(-2) != HC:
        raise ValueError(f"x must be the residual streams [..., {HC}, D], got {list(x.shape)}")
    lead, D = x.shape[:-2], x.size(-1)
    xin, pre_n, post_n, comb_n = _HcMixesPre.apply(
        x.reshape(-1, HC, D).contiguous(), _f32(pre_carried.reshape(-1, HC)),
        _f32(fn), _f32(scale), _f32(base), norm_eps, hc_eps, iters,
    )  # fmt: skip
    return xin.view(*lead, D), pre_n.view(*lead, HC), post_n.view(*lead, HC), comb_n.view(*lead, HC, HC)


def hc_post_mixes_pre_ref(f, residual, post, comb, pre_carried, fn, scale, base, *, norm_eps, hc_eps, iters=20):
    """The same boundary composed from the model/mhc.py references (unfused)."""
    x_new = hc_post_ref(f, residual, post, comb)
    pre, post_n, comb_n = hc_split_sinkhorn_ref(hc_mixes_ref(x_new, fn, norm_eps), scale, base, HC, iters, hc_eps)
    return x_new, hc_pre_ref(x_new, pre_carried), pre, post_n, comb_n


def hc_mixes_pre_ref(x, pre_carried, fn, scale, base, *, norm_eps, hc_eps, iters=20):
    pre, post_n, comb_n = hc_split_sinkhorn_ref(hc_mixes_ref(x, fn, norm_eps), scale, base, HC, iters, hc_eps)
    return hc_pre_ref(x, pre_carried), pre, post_n, comb_n
