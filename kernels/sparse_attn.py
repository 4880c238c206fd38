"""Triton sparse CSA2 attention forward: queries against KV rows gathered by index (spec §3.9).

One shared KV head (K = V = the 512-wide latent row), per-head attention sink added unscaled to the
denominator only, index -1 = invalid, a row with no valid index returns 0. The kernel mirrors the
official tilelang kernel: online softmax over blocks of 64 indices, running max initialised at
-1e30, probabilities rounded to bf16 before P·V, fp32 denominator, output in q's dtype. Used for
decode / speculative verification (M = 1..few queries per sequence) and the training forward;
decode-sized calls give each row two programs (one per half of the output columns) and may split
its indices over SPLIT programs whose partial softmaxes a second kernel merges (flash-decoding).
Packed FP4 main-KV entries are read from their bytes: decoded into a staging buffer of the picked
rows for decode, or per element inside the kernel.
The backward is a Triton kernel too (recompute p from the saved log-denominator, fp32 atomics into
dkv since KV rows are shared across queries); it differentiates the fp32-probability attention of
the torch reference `model.attention.sparse_attn_ref` (re-exported here).

Shape legend: B batch, M queries per sequence, H heads, Dh head dim (K = V row), N KV rows,
K indices per query; tiles: BH heads, BK indices, BDK the QK reduction chunk, DV output columns,
SPLIT index chunks per row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from kernels.launch import dot_args, interpreting, launch_opts, sm_count
from kernels.quant_math import _e2m1_of_nibble, _e4m3_of_byte, cast_rne
from model.attention import sparse_attn_ref

__all__ = [
    "sparse_attn",
    "sparse_attn_fwd",
    "sparse_attn_bwd",
    "sparse_attn_ref",
    "DECODE_CONFIG",
    "PACKED_CONFIG",
    "PACKED_FUSED_CONFIG",
    "TRAIN_CONFIG",
    "REFERENCE_CONFIG",
    "BWD_CONFIG",
]

# Tile configs, the best of bench/kernels.py's sweep on one H200 (H 64, Dh 512, K 640, bf16; device
# times of CUDA graph replays with L2 flushed). All keep whole q rows resident (BDK "full") and load
# each gathered K = V row once per block, with the indices loaded a block ahead so that the
# pipeliner streams the gathers num_stages - 1 blocks ahead of the dots.
# Decode (B·M = 64 query rows): 128 programs without partial softmaxes, each (row, half of the
# output columns) scoring all of a row's indices against whole rows and multiplying p by its half
# of each row (the second half-row read hits L2): 42.6 us, against 44.6-45.0 us for splitting each
# row's indices over 2 programs (fp32 partials, 33 MB more traffic, and a combine kernel) and
# 55.4 us unsplit. SPLIT > 1 is kept for configs that want it (with any DV: each (chunk, column
# block) program writes its columns of the chunk's unnormalised fp32 partial, which
# _sparse_attn_combine_kernel merges in split order). Index halves x column halves (SPLIT 2, DV 256,
# 16-index blocks: 256 programs, two per SM at 112 KB of shared memory each) took 57-70 us, SPLIT 4
# 80 us; merging the partials in the kernel (the last of a row's programs to finish, counted by an
# atomic, reads the others' from L2) was exact but slower than the combine kernel: 48.8 against
# 46.2 us. In steady state (bench/device_timing.py's stream_ms, back to back over four
# KV sets) the shipped config takes 37.3 us, 28% of HBM. Its neighbours are slower: 2 stages
# 53.5 us, 16-index blocks 54-55 us, 8 warps 60 us. Also tried (steady state): both dots
# transposed, s [BK, heads] = kv · q^T and acc [Dh, heads] += kv^T · p, so that 32-head programs
# keep 64-row MMA tiles and the two head halves of a row share no work (a third fewer FLOPs than
# recomputing q·k per column half): 38.6 us at 64-index blocks (registers spill), 42.1 us at 32.
# What bounds it (bench/kernels.py's sparse_attn_decode_bounds line): the same 42 MB gathered by a
# probe with no dots reaches 41% of nominal HBM, and equally for random, sorted and contiguous row
# orders; torch's index_select of those rows 29% (read bytes), a copy of as many bytes 69-71%. No
# Triton gather of these rows tried reaches more: a sweep of 54 looped probe tiles (rows per load,
# index splits, stages, warps) peaked at 41.7% and one-shot probes (one [8-128, 512] tile per
# program, the most loads in flight) at 43.5%. At this size (9 us of traffic at peak)
# filling and draining the memory pipeline costs as much as the bytes. In steady state
# (sparse_attn_decode_bounds_steady_state line) the looped probe at this kernel's 128
# programs gathers the 42 MB at 58% (15.0 us), one 16-row tile per program (2,560 programs, no loop)
# at 65%, a copy kernel of as many bytes at 77%: at 128 programs the gathers alone, before q, o and
# any dot, take 86% of the 17.5 us that 60% allows, and more programs per row add fp32 partials
# (33 MB at 2 per row). So 60% of HBM is out of reach for this kernel. The dots bound it first:
# with every row's 640 indices picking among 32 rows of its KV (2 MB in all, served from L2) the
# shipped tile still takes 35.8 us in steady state, against 36.7-37.0 us on the real gathers:
# its time is the dot chain, not HBM. 60% means the 5.4 GFLOP of q·k and p·v at
# 307 TFLOP/s, 39% of the dense bf16 peak, fed by gathers; the shipped tile sustains 144 TFLOP/s of
# them in steady state (215 counting the q·k it computes once per column half). Earlier figures
# (49-58 us) were timed as launched from Python: a split call spends ~160 us on the host, more than
# the L2 flush's slack.
# Packed main-KV entries (ckv=), decode-sized 16-bit calls (PACKED_CONFIG, "STAGE"): the rows the
# indices pick (window rows copied, packed entries decoded) are first written in slot order to a
# [B, M·K, Dh] staging buffer (_stage_rows_kernel), then the dense kernel runs over it with each
# slot's position as its index. B 64, 128 window + 512 packed picks: 61.3 us, against 150-152 us
# for decoding per element inside the attention kernel (PACKED_FUSED_CONFIG: fp32 and
# training-sized calls still take it, as they would need a staging buffer per query row), 1.16 ms for
# unpacking the whole bank first, and 43 us for the dense kernel on rows held unpacked.
# Rows decoded inside the kernel pass through registers, so their loads are not cp.async-streamed.
# Tried and not kept: an attention kernel choosing each row from kv or the staging buffer (the
# pointer select spilled 38 registers: 69 us for the attention alone); whole rows decoded with
# tl.interleave/reshape (wrong outputs at BH 32 / BK 16 / 4 warps on the H200, Triton 3.6); rows
# kept as even and odd halves so that every load is a contiguous cp.async run (171-218 us: the
# decoded halves are written to shared memory for the dots each block, and the registers spill).
# The training forward (many rows) uses the unsplit kernel. If a config needs more shared memory
# than the device has, the launcher falls back along _FALLBACKS.
DECODE_CONFIG = {"BH": 64, "BK": 32, "BDK": "full", "DV": 256, "num_warps": 4, "num_stages": 3, "SPLIT": 1}
PACKED_CONFIG = {**DECODE_CONFIG, "STAGE": True}
PACKED_FUSED_CONFIG = {"BH": 64, "BK": 16, "BDK": "full", "DV": 512, "num_warps": 8, "num_stages": 1, "SPLIT": "auto",
                       "STAGE": False}  # fmt: skip
TRAIN_CONFIG = {"BH": 64, "BK": 64, "BDK": "full", "DV": 512, "num_warps": 8, "num_stages": 1, "SPLIT": 1}
# numerics="reference": the released tilelang kernel's index block (64) and one program per row
REFERENCE_CONFIG = TRAIN_CONFIG
DEFAULT_CONFIG = TRAIN_CONFIG  # base that a partial `config` argument overrides
_FALLBACKS = (
    {"BH": 64, "BK": 64, "BDK": 64, "DV": 256, "num_warps": 8, "num_stages": 1, "SPLIT": 1},
    {"BH": 64, "BK": 64, "BDK": 64, "DV": 128, "num_warps": 4, "num_stages": 1, "SPLIT": 1},
    {"BH": 32, "BK": 32, "BDK": 64, "DV": 128, "num_warps": 4, "num_stages": 1, "SPLIT": 1},
)
_DECODE_MAX_ROWS = 512  # fewer query rows than this take the decode tiles
_STAGE_TILE = {"BK": 8, "num_warps": 2}  # _stage_rows_kernel: index slots per program
_STAGE_MAX_BYTES = 1 << 28  # a larger staging buffer (many query rows x indices) decodes in the kernel


_fitted: dict[tuple, dict] = {}


@triton.jit
def _main_kv_rows(ckv_K, mask_K, DH: tl.constexpr):
    """[BK, DH] fp32 values of packed main-KV entries (model/packed_cache.py: DH/2 bytes of E2M1
    codes, low nibble = even element, then one E4M3 scale byte per 16 elements). Each element reads
    its code byte and scale byte itself (repeat reads hit L1): no interleave or reshape, whose layout
    conversions cost registers here. `_e2m1_of_nibble` and value x scale are exact, so the rows equal
    `unpack_main_kv`'s bit for bit."""
    d_D = tl.arange(0, DH)
    code = tl.load(ckv_K[:, None] + (d_D // 2)[None, :], mask=mask_K[:, None], other=0).to(tl.int32)
    v = _e2m1_of_nibble(code >> ((d_D % 2) * 4)[None, :])
    sb = tl.load(ckv_K[:, None] + DH // 2 + (d_D // 16)[None, :], mask=mask_K[:, None], other=0)
    return v * _e4m3_of_byte(sb.to(tl.int32))


@triton.jit
def _stage_rows_kernel(
    idx_ptr, kvw_ptr, ckv_ptr, words_ptr, slot_ptr, M, N, K, G, DH: tl.constexpr, BK: tl.constexpr, BF16: tl.constexpr
):  # fmt: skip
    """Program (row = b·M + m, block of BK index slots): the row each valid slot k names, written to
    stage [B, M·K, DH] at m·K + k (16-bit elements moved as int32 words of an (even, odd) pair), and
    that position (or -1) to slots [B·M, K]. A window index (idx < N) copies kv row idx; a main-KV
    index decodes packed entry idx - N of batch b as `_main_kv_rows` does: each code byte's two
    nibbles times its group's E4M3 scale, exact in bf16 (BF16) and fp16 (<= 6 significant bits,
    |v| <= 2688)."""
    row = tl.program_id(0).to(tl.int64)
    k_K = tl.program_id(1) * BK + tl.arange(0, BK)
    idx_K = tl.load(idx_ptr + row * K + k_K, mask=k_K < K, other=-1).to(tl.int64)
    packed_K = idx_K >= N
    window_K = (idx_K >= 0) & (idx_K < N)
    b = row // M
    ckv_K = ckv_ptr + (b * G + tl.where(packed_K, idx_K - N, 0)) * (DH // 2 + DH // 16)
    # code byte j = 8g + i holds elements 2j (low nibble) and 2j + 1 of scale group g: the [BK, A, 8]
    # shape lets one contiguous load of the A scale bytes broadcast over their groups
    A: tl.constexpr = DH // 16
    j_A8 = (tl.arange(0, A) * 8)[:, None] + tl.arange(0, 8)[None, :]
    code = tl.load(ckv_K[:, None, None] + j_A8[None, :, :], mask=packed_K[:, None, None], other=0).to(tl.int32)
    sb = tl.load(ckv_K[:, None] + DH // 2 + tl.arange(0, A)[None, :], mask=packed_K[:, None], other=0)
    s = _e4m3_of_byte(sb.to(tl.int32))[:, :, None]
    ST: tl.constexpr = tl.bfloat16 if BF16 else tl.float16
    lo = _e2m1_of_nibble(code) * s
    hi = _e2m1_of_nibble(code >> 4) * s
    lo16 = lo.to(ST).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    hi16 = hi.to(ST).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    kv_K = kvw_ptr + (b * N + tl.where(window_K, idx_K, 0)) * (DH // 2)
    words = tl.load(kv_K[:, None, None] + j_A8[None, :, :], mask=window_K[:, None, None], other=0)
    words = tl.where(packed_K[:, None, None], lo16 | (hi16 << 16), words)
    slot_K = (row % M) * K + k_K
    out = words_ptr + (b * M * K + slot_K)[:, None, None] * (DH // 2) + j_A8[None, :, :]
    tl.store(out, words, mask=(idx_K >= 0)[:, None, None])
    tl.store(slot_ptr + row * K + k_K, tl.where(idx_K >= 0, slot_K, -1).to(tl.int32), mask=k_K < K)


@triton.jit
def _sparse_attn_fwd_kernel(
    q_ptr, kv_ptr, sink_ptr, idx_ptr, o_ptr, lse_ptr, part_ptr, ml_ptr, ckv_ptr,
    M, H, N, K, G, scale,
    DH: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr, BDK: tl.constexpr, DV: tl.constexpr,
    F32_DOT: tl.constexpr, STORE_LSE: tl.constexpr, DOT_PREC: tl.constexpr, SPLIT: tl.constexpr,
    PACKED: tl.constexpr,
):  # fmt: skip
    """Program (row = b·M + m, head block, index chunk · DH/DV + output column block).
    With STORE_LSE also writes lse [B·M, H] = m + log(Σ exp(l - m) + exp(sink - m)) for the
    backward (inf for an empty row). With SPLIT > 1 chunk s of a row's indices writes its
    unnormalised acc (its DV columns) to part [s, row, H, DH] fp32 and (m, l) to ml [s, row, H, 2]
    (every column block of a chunk writes the same m, l) for _sparse_attn_combine_kernel; an empty
    chunk writes m = -1e30, l = 0, acc = 0. With PACKED
    (BDK = DV = DH) indices >= N address the packed main-KV entries ckv [B,G,DH/2+DH/16] (row
    idx - N), decoded in registers: kv [B,N,DH] then holds only the window rows."""
    row = tl.program_id(0).to(tl.int64)
    h0 = tl.program_id(1) * BH
    N_DV: tl.constexpr = DH // DV
    dv0 = (tl.program_id(2) % N_DV) * DV
    split_id = tl.program_id(2) // N_DV
    k_lo, k_hi = 0, K
    if SPLIT > 1:
        chunk = tl.cdiv(tl.cdiv(K, SPLIT), BK) * BK  # whole blocks per chunk
        k_lo = split_id * chunk
        k_hi = tl.minimum(K, k_lo + chunk)
    b = row // M
    h_H = h0 + tl.arange(0, BH)
    mask_H = h_H < H
    q_row = q_ptr + row * H * DH
    kv_b = kv_ptr + b * N * DH
    sink_H = tl.load(sink_ptr + h_H, mask=mask_H, other=0.0).to(tl.float32)
    m_H = tl.full((BH,), -1.0e30, tl.float32)
    l_H = tl.zeros((BH,), tl.float32)
    acc_HV = tl.zeros((BH, DV), tl.float32)
    dk_C = tl.arange(0, BDK)
    dv_V = dv0 + tl.arange(0, DV)
    DT: tl.constexpr = tl.float32 if F32_DOT else q_ptr.dtype.element_ty  # interpreter: fp32 dots
    if BDK == DH:  # whole q rows stay resident; K = V rows are loaded once per block
        q_HD = tl.load(q_row + h_H[:, None] * DH + dk_C[None, :], mask=mask_H[:, None], other=0.0).to(DT)
    # indices a block ahead: the gather's address is then loop-carried, not a load of the same
    # iteration, so the pipeliner streams it num_stages - 1 blocks ahead of the dots
    k_K = k_lo + tl.arange(0, BK)
    next_K = tl.load(idx_ptr + row * K + k_K, mask=k_K < k_hi, other=-1)
    for k0 in range(k_lo, k_hi, BK):
        idx_K = next_K.to(tl.int64)
        k_K = k0 + BK + tl.arange(0, BK)
        next_K = tl.load(idx_ptr + row * K + k_K, mask=k_K < k_hi, other=-1)
        valid_K = idx_K >= 0
        rows_K = kv_b + tl.where(valid_K, idx_K, 0) * DH
        if PACKED:
            packed_K = valid_K & (idx_K >= N)
            dense_K = valid_K & (idx_K < N)
            kv_KD = tl.load(rows_K[:, None] + dk_C[None, :], mask=dense_K[:, None], other=0.0).to(DT)
            ckv_K = ckv_ptr + (b * G + tl.where(packed_K, idx_K - N, 0)) * (DH // 2 + DH // 16)
            kv_KD = tl.where(packed_K[:, None], _main_kv_rows(ckv_K, packed_K, DH).to(DT), kv_KD)
            s_HK = tl.dot(q_HD, tl.trans(kv_KD), input_precision=DOT_PREC)
        elif BDK == DH:
            kv_KD = tl.load(rows_K[:, None] + dk_C[None, :], mask=valid_K[:, None], other=0.0).to(DT)
            s_HK = tl.dot(q_HD, tl.trans(kv_KD), input_precision=DOT_PREC)
        else:
            s_HK = tl.zeros((BH, BK), tl.float32)
            for d0 in tl.static_range(0, DH, BDK):
                q_HC = tl.load(q_row + h_H[:, None] * DH + (d0 + dk_C)[None, :], mask=mask_H[:, None], other=0.0)
                k_KC = tl.load(rows_K[:, None] + (d0 + dk_C)[None, :], mask=valid_K[:, None], other=0.0)
                s_HK = tl.dot(q_HC.to(DT), tl.trans(k_KC.to(DT)), s_HK, input_precision=DOT_PREC)
        s_HK = tl.where(valid_K[None, :], s_HK * scale, float("-inf"))
        m_new_H = tl.maximum(m_H, tl.max(s_HK, axis=1))
        alpha_H = tl.exp(m_H - m_new_H)
        p_HK = tl.exp(s_HK - m_new_H[:, None])
        l_H = l_H * alpha_H + tl.sum(p_HK, axis=1)
        if BDK == DH and DV == DH:
            v_KV = kv_KD
        else:
            v_KV = tl.load(rows_K[:, None] + dv_V[None, :], mask=valid_K[:, None], other=0.0).to(DT)
        acc_HV = acc_HV * alpha_H[:, None]
        # probabilities rounded to q's 16-bit dtype before P·V (exact in fp32 for the interpreter)
        p_HK = cast_rne(p_HK, q_ptr.dtype.element_ty).to(DT)
        acc_HV = tl.dot(p_HK, v_KV, acc_HV, input_precision=DOT_PREC)
        m_H = m_new_H
    if SPLIT > 1:
        part_row = split_id * tl.num_programs(0) + row
        tl.store(part_ptr + (part_row * H + h_H[:, None]) * DH + dv_V[None, :], acc_HV, mask=mask_H[:, None])
        tl.store(ml_ptr + (part_row * H + h_H) * 2, m_H, mask=mask_H)
        tl.store(ml_ptr + (part_row * H + h_H) * 2 + 1, l_H, mask=mask_H)
        return
    # the sink joins the denominator only, unscaled; an all-invalid row has m = -1e30, so
    # exp(sink - m) = inf and the output is 0 / inf = 0
    l_H = l_H + tl.exp(sink_H - m_H)
    o_HV = acc_HV / l_H[:, None]
    o_offs = row * H * DH + h_H[:, None] * DH + dv_V[None, :]
    tl.store(o_ptr + o_offs, cast_rne(o_HV, o_ptr.dtype.element_ty), mask=mask_H[:, None])
    if STORE_LSE:
        # every output-column program computes the same lse; the identical writes are benign
        tl.store(lse_ptr + row * H + h_H, m_H + tl.log(l_H), mask=mask_H)


@triton.jit
def _sparse_attn_combine_kernel(
    part_ptr, ml_ptr, sink_ptr, o_ptr, R, H,
    DH: tl.constexpr, SPLIT: tl.constexpr, BH: tl.constexpr,
):  # fmt: skip
    """o[row, h] = Σ_s exp(m_s - m) acc_s / (Σ_s exp(m_s - m) l_s + exp(sink - m)), m = max_s m_s:
    the split forward's partials merged in split order (so the result is deterministic)."""
    row = tl.program_id(0).to(tl.int64)
    h_H = tl.program_id(1) * BH + tl.arange(0, BH)
    mask_H = h_H < H
    d_D = tl.arange(0, DH)
    m_H = tl.full((BH,), -1.0e30, tl.float32)
    for s in tl.static_range(SPLIT):
        m_H = tl.maximum(m_H, tl.load(ml_ptr + ((s * R + row) * H + h_H) * 2, mask=mask_H, other=-1.0e30))
    l_H = tl.zeros((BH,), tl.float32)
    acc_HD = tl.zeros((BH, DH), tl.float32)
    for s in tl.static_range(SPLIT):
        m_s = tl.load(ml_ptr + ((s * R + row) * H + h_H) * 2, mask=mask_H, other=-1.0e30)
        w_H = tl.exp(m_s - m_H)
        l_H += w_H * tl.load(ml_ptr + ((s * R + row) * H + h_H) * 2 + 1, mask=mask_H, other=0.0)
        part_offs = ((s * R + row) * H + h_H[:, None]) * DH + d_D[None, :]
        acc_HD += w_H[:, None] * tl.load(part_ptr + part_offs, mask=mask_H[:, None], other=0.0)
    l_H += tl.exp(tl.load(sink_ptr + h_H, mask=mask_H, other=0.0) - m_H)  # all-invalid row: 0 / inf = 0
    o_offs = (row * H + h_H[:, None]) * DH + d_D[None, :]
    tl.store(o_ptr + o_offs, cast_rne(acc_HD / l_H[:, None], o_ptr.dtype.element_ty), mask=mask_H[:, None])


def sparse_attn_fwd(
    q: torch.Tensor,
    kv: torch.Tensor,
    attn_sink: torch.Tensor,
    idxs: torch.Tensor,
    scale: float,
    config: dict | None = None,
    lse: torch.Tensor | None = None,
    ckv: torch.Tensor | None = None,
) -> torch.Tensor:
    """Forward only. q [B,M,H,Dh] bf16/fp16, kv [B,N,Dh] (same dtype), attn_sink [H] fp32,
    idxs [B,M,K] int32/int64 (-1 invalid) -> o [B,M,H,Dh] in q's dtype. If `lse` (fp32 [B,M,H]) is
    given, the log of each softmax denominator (sink included) is written into it. With `ckv`, packed
    main-KV entries uint8 [B,G,Dh/2+Dh/16] (model/packed_cache.py), indices N..N+G-1 read its rows,
    decoded from their bytes (decode-sized 16-bit calls: into a staging buffer of the picked rows
    first; otherwise inside the kernel): the same output as passing cat([kv, unpack_main_kv(ckv,
    q.dtype)], 1) with the same tiles."""
    _check_inputs(q, kv, attn_sink, idxs)  # once per call: the launchers below trust their inputs
    if ckv is not None:
        return _packed_fwd(q, kv, attn_sink, idxs, scale, ckv, config)
    if config is None:
        decode = q.shape[0] * q.shape[1] < _DECODE_MAX_ROWS
        first = DECODE_CONFIG if decode else TRAIN_CONFIG
        # keyed by values dynamo can trace (not id() of the config dict); a compiled call takes the
        # config an eager call fitted, else the first: its launch happens after tracing, so no retry
        key = (q.shape[-1], q.shape[-2], q.dtype, q.device, decode)
        if torch.compiler.is_compiling():
            return _fwd(q, kv, attn_sink, idxs, scale, {**DEFAULT_CONFIG, **_fitted.get(key, first)}, lse)
        for cfg in [_fitted[key]] if key in _fitted else [first, *_FALLBACKS]:
            try:
                o = _fwd(q, kv, attn_sink, idxs, scale, {**DEFAULT_CONFIG, **cfg}, lse)
            except OutOfResources:
                continue
            _fitted[key] = cfg
            return o
        raise RuntimeError("no sparse_attn tile config fits this device")
    return _fwd(q, kv, attn_sink, idxs, scale, {**DEFAULT_CONFIG, **config}, lse)


def _packed_fwd(q, kv, attn_sink, idxs, scale, ckv, config):
    B, M, H, Dh = q.shape
    entry = Dh // 2 + Dh // 16
    if ckv.dtype != torch.uint8 or ckv.dim() != 3 or ckv.shape[0] != B or ckv.shape[2] != entry:
        raise ValueError(f"ckv must be packed main-KV entries uint8 [B,G,{entry}], got {ckv.dtype} {list(ckv.shape)}")
    if triton.next_power_of_2(Dh) != Dh:
        raise ValueError(f"packed main-KV entries need a power-of-2 head_dim, got {Dh}")
    ckv = ckv.contiguous()
    decode = B * M < _DECODE_MAX_ROWS
    cfg = {**DEFAULT_CONFIG, **(PACKED_CONFIG if decode else TRAIN_CONFIG), **(config or {})}
    stage_bytes = B * M * idxs.size(-1) * Dh * q.element_size()
    if cfg.get("STAGE") and q.dtype != torch.float32 and stage_bytes <= _STAGE_MAX_BYTES:
        try:
            kv_words = kv.view(torch.int32)
        except RuntimeError:  # storage offset not pair-aligned: decode in the kernel below
            kv_words = None
        if kv_words is not None:
            return _staged_fwd(q, kv_words, attn_sink, idxs, scale, ckv, cfg, config is None)
    if decode:  # decoded in the kernel (STAGE False; fp32, which has no 16-bit words; a huge buffer)
        cfg = {**DEFAULT_CONFIG, **PACKED_FUSED_CONFIG, **(config or {}), "STAGE": False}
    if cfg["BDK"] != "full" or min(cfg["DV"], Dh) != Dh:
        raise ValueError(f"packed entries decoded in the kernel need whole rows (BDK 'full', DV = Dh); got {cfg}")
    if config is not None:
        return _fwd(q, kv, attn_sink, idxs, scale, cfg, None, ckv)
    # whole rows must stay resident, so a config too large for shared memory (fp32 at head dim
    # 512) shrinks its index block, pipeline depth and head block instead of taking _FALLBACKS'
    # column splits
    for fit in (cfg, {**cfg, "BK": 16, "num_stages": 1}, {**cfg, "BH": 16, "BK": 16, "num_stages": 1}):
        try:
            return _fwd(q, kv, attn_sink, idxs, scale, fit, None, ckv)
        except OutOfResources:
            continue
    raise RuntimeError("no sparse_attn tile config with whole rows fits this device's shared memory")


def _staged_fwd(q, kv_words, attn_sink, idxs, scale, ckv, cfg, may_shrink):
    """The rows a decode step picks (window rows copied, packed main-KV entries decoded), written once
    to a [B, M·K, Dh] staging buffer in slot order, then the dense kernel over it with each slot's
    own position as its index: no decode inside the attention and no second row source there (a
    kernel selecting between kv and the buffer per slot spilled: 69 us against 42 us)."""
    B, M, H, Dh = q.shape
    N, K = kv_words.size(1), idxs.size(-1)
    stage = torch.empty(B, M * K, Dh, dtype=q.dtype, device=q.device)
    slots = torch.empty(B, M, K, dtype=torch.int32, device=q.device)
    if slots.numel():
        bk, nw = _STAGE_TILE["BK"], _STAGE_TILE["num_warps"]
        _stage_rows_kernel[(B * M, triton.cdiv(K, bk))](
            idxs, kv_words, ckv, stage.view(torch.int32), slots, M, N, K, ckv.size(1),
            DH=Dh, BK=bk, BF16=q.dtype == torch.bfloat16, **({} if interpreting() else {"num_warps": nw}),
        )  # fmt: skip
    for fit in [cfg, *(_FALLBACKS if may_shrink else ())]:
        try:
            return _fwd(q, stage, attn_sink, slots, scale, {**cfg, **fit}, None)
        except OutOfResources:
            continue
    raise RuntimeError("no sparse_attn tile config fits this device")


def _check_inputs(q, kv, attn_sink, idxs) -> None:
    if q.dim() != 4 or kv.dim() != 3 or idxs.dim() != 3:
        raise ValueError(f"need q [B,M,H,Dh], kv [B,N,Dh], idxs [B,M,K]; got {list(q.shape)}, {list(kv.shape)}, "
                         f"{list(idxs.shape)}")  # fmt: skip
    B, M, H, Dh = q.shape
    if kv.shape[0] != B or kv.shape[2] != Dh or idxs.shape[:2] != (B, M) or attn_sink.shape != (H,):
        raise ValueError(f"need q [B,M,H,Dh], kv [B,N,Dh], idxs [B,M,K], sink [H]; got q {list(q.shape)}, "
                         f"kv {list(kv.shape)}, idxs {list(idxs.shape)}, sink {list(attn_sink.shape)}")  # fmt: skip
    if q.dtype != kv.dtype or q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"q and kv must share a bf16 / fp16 / fp32 dtype, got {q.dtype} and {kv.dtype}")
    if idxs.is_floating_point():
        raise ValueError(f"idxs must be integer row indices (-1 = none), got {idxs.dtype}")
    if not (q.is_contiguous() and kv.is_contiguous() and idxs.is_contiguous() and attn_sink.is_contiguous()):
        raise ValueError("q, kv, idxs and attn_sink must be contiguous: pass .contiguous() copies")


def _fwd(q, kv, attn_sink, idxs, scale, cfg, lse, ckv=None):
    B, M, H, Dh = q.shape
    N = kv.size(1)
    K = idxs.size(-1)
    bh = min(cfg["BH"], max(16, triton.next_power_of_2(H)))  # heads padded to >= 16 for tl.dot
    bdk = Dh if cfg["BDK"] == "full" else min(int(cfg["BDK"]), Dh)
    dv = min(cfg["DV"], Dh)
    assert Dh % bdk == 0 and Dh % dv == 0, f"head_dim {Dh} must be a multiple of {bdk} and of DV {dv}"
    o = torch.empty_like(q)
    if q.numel() == 0:
        return o
    if K == 0:
        if lse is not None:
            lse.copy_(attn_sink.float().expand_as(lse))
        return o.zero_()
    n_hb = triton.cdiv(H, bh)
    split = cfg["SPLIT"]
    if split == "auto":  # enough chunks per row for one program per SM, whole blocks each
        split = max(1, min(sm_count(q.device) // (B * M * n_hb * (Dh // dv)), triton.cdiv(K, cfg["BK"]), 8))
    if lse is not None:
        split = 1  # the autograd forward writes lse
    opts = launch_opts(cfg)
    part = ml = o
    if split > 1:
        part = torch.empty(split, B * M, H, Dh, dtype=torch.float32, device=q.device)
        ml = torch.empty(split, B * M, H, 2, dtype=torch.float32, device=q.device)
    G = 0 if ckv is None else ckv.size(1)
    _sparse_attn_fwd_kernel[(B * M, n_hb, split * (Dh // dv))](
        q, kv, attn_sink, idxs, o, lse if lse is not None else o, part, ml, ckv if ckv is not None else o,
        M, H, N, K, G, float(scale),
        DH=Dh, BH=bh, BK=cfg["BK"], BDK=bdk, DV=dv,
        STORE_LSE=lse is not None, SPLIT=split, PACKED=ckv is not None, **dot_args(q.dtype), **opts,
    )  # fmt: skip
    if split > 1:
        _sparse_attn_combine_kernel[(B * M, triton.cdiv(H, 16))](
            part, ml, attn_sink, o, B * M, H, DH=Dh, SPLIT=split, BH=16,
            **({} if interpreting() else {"num_warps": 4}),
        )  # fmt: skip
    return o


@triton.jit
def _sparse_attn_bwd_kernel(
    q_ptr, kv_ptr, sink_ptr, idx_ptr, o_ptr, do_ptr, lse_ptr,
    dq_ptr, dkv_ptr, dsink_ptr,
    M, H, N, K, scale,
    DH: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr, F32_DOT: tl.constexpr, DOT_PREC: tl.constexpr,
):  # fmt: skip
    """Program (row, head block). Recomputes p = exp(scale·q·k - lse) per block of indices (fp32,
    the unrounded probabilities) and accumulates
      dq  = scale · Σ_k ds_k · kv_k,            ds = p · (do·kv_k - δ),  δ = Σ_d o·do
      dkv[idx_k] += Σ_h p·do + scale · Σ_h ds·q   (fp32 atomics: rows are shared across queries)
      dsink_part[row, h] = -exp(sink - lse) · δ
    dq / ds / p enter the dots in q's 16-bit dtype (fp32 under the interpreter)."""
    row = tl.program_id(0).to(tl.int64)
    h_H = tl.program_id(1) * BH + tl.arange(0, BH)
    mask_H = h_H < H
    b = row // M
    d_D = tl.arange(0, DH)
    DT: tl.constexpr = tl.float32 if F32_DOT else q_ptr.dtype.element_ty
    offs_HD = row * H * DH + h_H[:, None] * DH + d_D[None, :]
    q_HD = tl.load(q_ptr + offs_HD, mask=mask_H[:, None], other=0.0)
    do_HD = tl.load(do_ptr + offs_HD, mask=mask_H[:, None], other=0.0)
    o_HD = tl.load(o_ptr + offs_HD, mask=mask_H[:, None], other=0.0)
    delta_H = tl.sum(o_HD.to(tl.float32) * do_HD.to(tl.float32), axis=1)
    lse_H = tl.load(lse_ptr + row * H + h_H, mask=mask_H, other=float("inf"))
    sink_H = tl.load(sink_ptr + h_H, mask=mask_H, other=0.0).to(tl.float32)
    tl.store(dsink_ptr + row * H + h_H, -tl.exp(sink_H - lse_H) * delta_H, mask=mask_H)
    q_HD = q_HD.to(DT)
    do_HD = do_HD.to(DT)
    dq_HD = tl.zeros((BH, DH), tl.float32)
    kv_b = kv_ptr + b * N * DH
    dkv_b = dkv_ptr + b * N * DH
    for k0 in range(0, K, BK):
        k_K = k0 + tl.arange(0, BK)
        idx_K = tl.load(idx_ptr + row * K + k_K, mask=k_K < K, other=-1).to(tl.int64)
        valid_K = idx_K >= 0
        safe_K = tl.where(valid_K, idx_K, 0) * DH
        kv_KD = tl.load(kv_b + safe_K[:, None] + d_D[None, :], mask=valid_K[:, None], other=0.0).to(DT)
        s_HK = tl.dot(q_HD, tl.trans(kv_KD), input_precision=DOT_PREC) * scale
        p_HK = tl.where(valid_K[None, :], tl.exp(s_HK - lse_H[:, None]), 0.0)
        dp_HK = tl.dot(do_HD, tl.trans(kv_KD), input_precision=DOT_PREC)
        ds_HK = p_HK * (dp_HK - delta_H[:, None])
        dq_HD = tl.dot(ds_HK.to(DT), kv_KD, dq_HD, input_precision=DOT_PREC)
        dkv_KD = tl.dot(tl.trans(p_HK.to(DT)), do_HD, input_precision=DOT_PREC)
        dkv_KD += tl.dot(tl.trans(ds_HK.to(DT)), q_HD, input_precision=DOT_PREC) * scale
        tl.atomic_add(dkv_b + safe_K[:, None] + d_D[None, :], dkv_KD, mask=valid_K[:, None], sem="relaxed")
    tl.store(dq_ptr + offs_HD, cast_rne(dq_HD * scale, dq_ptr.dtype.element_ty), mask=mask_H[:, None])


# Backward tiles: whole head_dim rows resident (dq [BH, Dh] fp32 in registers), so small BH / BK.
BWD_CONFIG = {"BH": 32, "BK": 32, "num_warps": 8, "num_stages": 1}  # best of the H200 sweep


def sparse_attn_bwd(q, kv, attn_sink, idxs, scale, o, lse, do, config: dict | None = None):
    """Gradients (dq, dkv, dsink) of `sparse_attn` given its output o and lse [B,M,H] fp32."""
    cfg = {**BWD_CONFIG, **(config or {})}
    B, M, H, Dh = q.shape
    N, K = kv.size(1), idxs.size(-1)
    assert triton.next_power_of_2(Dh) == Dh, "the backward keeps whole rows: head_dim must be a power of 2"
    do = do.contiguous()
    dq = torch.empty_like(q)
    dkv = torch.zeros(B, N, Dh, dtype=torch.float32, device=q.device)
    dsink = torch.zeros(B * M, H, dtype=torch.float32, device=q.device)
    if q.numel() and K:
        bh = min(cfg["BH"], max(16, triton.next_power_of_2(H)))
        opts = launch_opts(cfg)
        _sparse_attn_bwd_kernel[(B * M, triton.cdiv(H, bh))](
            q, kv, attn_sink, idxs, o, do, lse, dq, dkv, dsink, M, H, N, K, float(scale),
            DH=Dh, BH=bh, BK=cfg["BK"], **dot_args(q.dtype), **opts,
        )  # fmt: skip
    else:
        dq.zero_()
    return dq, dkv.to(kv.dtype), dsink.sum(0)


class _SparseAttn(torch.autograd.Function):
    """Triton forward and backward. The backward differentiates the attention with unrounded fp32
    probabilities (the torch reference's), not the bf16-rounded P the forward multiplies V with."""

    @staticmethod
    def forward(ctx, q, kv, attn_sink, idxs, scale, config=None):
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        o = sparse_attn_fwd(q, kv, attn_sink, idxs, scale, config=config, lse=lse)
        ctx.save_for_backward(q, kv, attn_sink, idxs, o, lse)
        ctx.scale = scale
        return o

    @staticmethod
    def backward(ctx, g_o):
        q, kv, attn_sink, idxs, o, lse = ctx.saved_tensors
        dq, dkv, dsink = sparse_attn_bwd(q, kv, attn_sink, idxs, ctx.scale, o, lse, g_o)
        return dq, dkv, dsink, None, None, None


def sparse_attn(
    q: torch.Tensor,
    kv: torch.Tensor,
    attn_sink: torch.Tensor,
    idxs: torch.Tensor,
    scale: float,
    ckv: torch.Tensor | None = None,
    *,
    reference: bool = False,
) -> torch.Tensor:
    """Drop-in for `sparse_attn_ref` (same signature and contract), Triton forward and backward.
    Without autograd (the inference engine) it calls the forward alone, which lets decode-sized
    calls take the decode kernel (the autograd forward must also write the lse the backward reads).
    `ckv`: packed main-KV entries that indices >= kv.size(1) read (`sparse_attn_fwd`), forward only.
    `reference` (numerics="reference"): REFERENCE_CONFIG's tiles whatever the call's size, so the
    running max moves in the released kernel's blocks of 64 indices of the caller's list."""
    args = (q.contiguous(), kv.contiguous(), attn_sink.float().contiguous(), idxs.contiguous(), float(scale))
    config = REFERENCE_CONFIG if reference else None
    if ckv is not None:
        return sparse_attn_fwd(*args, config=config, ckv=ckv)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, kv, attn_sink)):
        return _SparseAttn.apply(*args, config)
    return sparse_attn_fwd(*args, config=config)
