"""Triton block quantisers for V4.1's FP8 / FP4 activations and caches (spec §3.10), bit-exact.

Three formats, each a fake-quant (QDQ, straight-through gradient, for QAT) and a quantise+pack
kernel producing the packed cache layout, plus the matching unpack/dequantise kernels:
  * FP8:       e4m3 codes, UE8M0 (power-of-two) scale per 32    -> codes uint8 [.., N], scale u8 [.., N/32]
  * FP4-E4M3:  E2M1 codes, E4M3 scale per 16                    -> packed u8 [.., N/2], scale u8 [.., N/16]
  * MXFP4:     E2M1 codes, UE8M0 scale per 32                   -> packed u8 [.., N/2], scale u8 [.., N/32]
Packing: two E2M1 nibbles per byte, the low nibble holds the even element; E4M3 scales are stored as
their e4m3fn bit pattern and UE8M0 scales as the biased exponent byte (2^(b-127)), so
`scale.view(torch.float8_e4m3fn)` / `scale.view(torch.float8_e8m0fnu)` read them back.
The torch references live in `model/quant.py` and are re-exported here with an `_ref` suffix.
Scales are computed on the fp32 bits, x/s is an exact reciprocal multiply (power-of-two scales), an
IEEE `div_rn`, or for 16-bit x and E2M1 a reciprocal multiply whose rounding is made exact (`_scaled`,
`_e2m1_lowbits`), there is no FMA contraction, and the fp8/bf16 casts are the hardware RNE ones on the GPU
(emulated on the bits under the interpreter), so both give the references' bits. The kernels are
bound by instruction issue as much as by HBM, so the E2M1 rounding is one float add (`_e2m1_parts`),
the E4M3 scale of 16-bit inputs a multiply by fl(1/6) (`_group_scale`), and the unpack two exact
multiplies per value (`_unpack_word`); each shortcut is checked exhaustively against the reference
arithmetic. Two layouts: tile kernels (threads along a group) and per-group kernels (one thread per
group, or two groups for the E4M3/16 pack; 16-bit tensors), chosen per kind and format in CONFIG.
The element arithmetic (casts, roundings, codes, scales) is in kernels/quant_math.py.
Block-scaled GEMMs are not here.

Shape legend: G = number of quantisation groups (numel / block), B = block, R = groups per program.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.quant_math import (  # noqa: F401 - cast_rne is re-exported for the other kernels
    INTERPRET,
    _e2m1_code,
    _e2m1_mag_of_code,
    _e2m1_of_nibble,
    _e2m1_parts,
    _e2m1_qdq,
    _e4m3_byte,
    _e4m3_code_of_mag,
    _e4m3_of_byte,
    _group_scale,
    _pow2_ceil,
    _pow2_inv,
    _round_e4m3,
    _round_e4m3_mag,
    _scale_byte,
    _scaled,
    cast_rne,
)
from model.quant import (
    dequantize_fp4 as dequantize_fp4_ref,
)
from model.quant import (
    dequantize_fp8 as dequantize_fp8_ref,
)
from model.quant import (
    fp4_e4m3_fake_quant as fp4_e4m3_fake_quant_ref,
)
from model.quant import (
    fp8_fake_quant as fp8_fake_quant_ref,
)
from model.quant import (
    mxfp4_fake_quant as mxfp4_fake_quant_ref,
)
from model.quant import (
    pack_e2m1 as pack_e2m1_ref,
)
from model.quant import (
    quantize_fp4_e4m3 as quantize_fp4_e4m3_ref,
)
from model.quant import (
    quantize_fp8 as quantize_fp8_ref,
)
from model.quant import (
    quantize_mxfp4 as quantize_mxfp4_ref,
)
from model.quant import (
    unpack_e2m1 as unpack_e2m1_ref,
)

__all__ = [
    "FMT_FP8",
    "FMT_FP4_E4M3",
    "FMT_MXFP4",
    "fp8_fake_quant",
    "fp4_e4m3_fake_quant",
    "mxfp4_fake_quant",
    "quantize_fp8_packed",
    "quantize_fp4_e4m3_packed",
    "quantize_mxfp4_packed",
    "dequantize_fp8_packed",
    "dequantize_fp4_packed",
    "scale_bytes_to_float",
    "cast_rne",
    # references (model/quant.py)
    "fp8_fake_quant_ref",
    "fp4_e4m3_fake_quant_ref",
    "mxfp4_fake_quant_ref",
    "quantize_fp8_ref",
    "quantize_fp4_e4m3_ref",
    "quantize_mxfp4_ref",
    "dequantize_fp8_ref",
    "dequantize_fp4_ref",
    "pack_e2m1_ref",
    "unpack_e2m1_ref",
]

FMT_FP8, FMT_FP4_E4M3, FMT_MXFP4 = 0, 1, 2
_DEFAULT_BLOCK = {FMT_FP8: 32, FMT_FP4_E4M3: 16, FMT_MXFP4: 32}
# Launch tiles, the best of bench/kernels.py's sweep on one H200 (16384x4096 bf16): "rows"
# quantisation groups per program (128 groups of 32 = 4096 elements, 8 KiB of bf16 in flight) for
# the quantisers, "rows_dequant" for the unpack kernel, warps per program, and "strided": how the
# FP4 pack kernel splits even / odd elements (None = per format: stride-2 loads for E4M3/16, which
# measured 13% faster there, one load + tl.split for MXFP4, where stride-2 measured 1.7x slower).
# "pairs": FP4 packing reads (even, odd) pairs as one 32/64-bit word (_fp4_pack_pairs_kernel) with
# "rows_pairs" groups per program; False keeps the element kernel (_quant_pack_kernel).
# "groups": 16-bit tensors may take the one-thread-per-group kernels (_qdq_groups_kernel, and for FP4
# _fp4_pack_groups_kernel / _fp4_unpack_groups_kernel): "<kind>_groups" maps a format to that
# kernel's tile (groups per program, warps) or to None, which keeps the tile kernel above. That
# layout computes each scale once with no shuffles but its 16-byte accesses stride by a whole group
# (uncoalesced per instruction): on the H200 it won for the E4M3/16 unpack (58% of HBM against 47%)
# and lost for the fake quant (MXFP4 62% against 80%). Its FP4 pack has the leanest code (sm_90 SASS
# per element: E4M3/16 14 vs 21 for pairs, MXFP4 10.7 vs 13.6) and the best H200 times, 128 MiB bf16
# (bench/kernels.py): E4M3/16 68-71% of HBM (pairs 64%), MXFP4 74-76% at 64 groups / 2 warps (pairs
# 67%); smaller tiles than 64 and larger than 256 lose. The FP8 pack reaches 80%, a d2d copy 89%. Its
# loads evict first (x is read once: +1.5% E4M3/16, +3% MXFP4), and "pack_amax2" (per format) takes
# the amax by packed 16-bit max-abs on the loaded words (`_group_amax_words`): E4M3/16 +2%, MXFP4 -1%
# (off). The layout's memory pattern bounds it: the same loads and stores with no arithmetic reach
# only 75.7% (E4M3/16). Slower on the H200: a TMA tile (coalesced, read back from shared memory; E4M3/16
# 56-63%, MXFP4 65-71%), grid-stride loops (68%; Triton-pipelined 44%), 2-4 threads per group (55-72%).
# "two" (E4M3/16 pack): two adjacent groups per thread, MXFP4/32's 64-byte access pattern
# (_fp4_pack_two_groups): 71.3% against 70.6% for one group in one process (device time).
# The E4M3/16 pack is bound by instruction issue (sm_90 SASS, two groups: 13.2 per element, of which
# 9 are the per-element minimum: unpack, multiply, abs + truncate, exponent, add-max, add, code,
# two funnel shifts; Triton 3.9's ptxas): dropping its per-element clamp alone (inexact, timing only)
# took it from 70.4-71.1% to 73.6-73.9% in one process. The clamp now runs on the packed words against
# 6s (`_e4m3_clamp_words`, half an instruction per element) and the multiplier is rcp.approx (no
# subnormal guard): 72.5-73.0% against 70.5-71.1% for the previous code in one process, 73.1-73.4%
# for both layouts in bench/kernels.py's sweep. Tried, no faster on Triton 3.6: the
# signs gathered by byte permutes (PRMT) instead of one funnel shift each, L2 prefetch-size hints on
# inline-asm loads (no arithmetic: 74-75% with or without), two threads per group (68%); a persistent
# loop fed by pipelined TMA tiles (host descriptors, 1-8 programs per SM, 2-4 stages: 15-66%).
# The figures above are one call per CUDA-graph replay after a zero-fill L2 flush, which charges
# the op for the flush's dirty lines and ~4 us of launch latency (bench/device_timing.py), and
# there the E4M3/16 layouts tie (73%). In steady state (back to back over rotating inputs and
# outputs) one group per thread at 64 groups / 2 warps is the best E4M3/16 tile: 75.0%
# of HBM at 64 MiB of bf16 and 78.8% at 128 MiB, against 72.0% / 78.6% for two groups per thread
# at 128 / 4 warps (the previous default); a copy kernel of the same bytes 77% / 81%. MXFP4
# 75.8% / 81.0%, FP8 82.8% / 87.1%; at 512 MiB E4M3/16 84%, MXFP4 85%, FP8 91%.
_PACK_GROUPS = {FMT_FP4_E4M3: {"rows": 64, "num_warps": 2}, FMT_MXFP4: {"rows": 64, "num_warps": 2}}
_UNPACK_GROUPS = {FMT_FP4_E4M3: {"rows": 128, "num_warps": 4}, FMT_MXFP4: None}
CONFIG = {"rows": 128, "rows_dequant": 64, "num_warps": 4, "strided": None, "pairs": True, "rows_pairs": 256,
          "groups": True, "qdq_groups": {FMT_FP8: None, FMT_FP4_E4M3: None, FMT_MXFP4: None},
          "pack_groups": _PACK_GROUPS, "unpack_groups": _UNPACK_GROUPS,
          "pack_amax2": {FMT_FP4_E4M3: True, FMT_MXFP4: False}}  # fmt: skip


# ------------------------------------------------------------------------------------------------
# kernels


@triton.jit
def _qdq_kernel(x_ptr, y_ptr, n_groups, FMT: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    """y = dequant(quant(x)) per group of BLOCK contiguous elements; x viewed as [G, BLOCK]."""
    pid = tl.program_id(0)
    g_R = pid.to(tl.int64) * ROWS + tl.arange(0, ROWS)
    offs_RB = g_R[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    mask_RB = (g_R < n_groups)[:, None]
    x_RB = tl.load(x_ptr + offs_RB, mask=mask_RB, other=0.0).to(tl.float32)
    X16: tl.constexpr = x_ptr.dtype.element_ty.primitive_bitwidth == 16
    s_R = _group_scale(tl.max(tl.abs(x_RB), axis=1), FMT, X16)
    RECIP: tl.constexpr = FMT == 1 and X16
    v_RB = _scaled(x_RB, s_R, FMT, RECIP)
    if FMT == 0:
        q_RB = _round_e4m3(tl.minimum(tl.maximum(v_RB, -448.0), 448.0))
    else:
        q_RB = _e2m1_qdq(v_RB, RECIP)
    tl.store(y_ptr + offs_RB, cast_rne(q_RB * s_R[:, None], y_ptr.dtype.element_ty), mask=mask_RB)


@triton.jit
def _quant_pack_kernel(
    x_ptr, q_ptr, s_ptr, n_groups,
    FMT: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr, STRIDED: tl.constexpr,
):  # fmt: skip
    """x [G, BLOCK] -> codes (fp8: [G, BLOCK] bytes; fp4: [G, BLOCK/2] packed bytes) + scale byte [G].
    STRIDED loads the even / odd elements with two stride-2 loads instead of one load + tl.split."""
    pid = tl.program_id(0)
    g_R = pid.to(tl.int64) * ROWS + tl.arange(0, ROWS)
    mask_R = g_R < n_groups
    HALF: tl.constexpr = BLOCK // 2
    RECIP: tl.constexpr = FMT == 1 and x_ptr.dtype.element_ty.primitive_bitwidth == 16
    if FMT != 0 and STRIDED:
        offs_RH = g_R[:, None] * BLOCK + 2 * tl.arange(0, HALF)[None, :]
        even_RH = tl.load(x_ptr + offs_RH, mask=mask_R[:, None], other=0.0).to(tl.float32)
        odd_RH = tl.load(x_ptr + offs_RH + 1, mask=mask_R[:, None], other=0.0).to(tl.float32)
        amax_R = tl.maximum(tl.max(tl.abs(even_RH), axis=1), tl.max(tl.abs(odd_RH), axis=1))
        s_R = _group_scale(amax_R, FMT, RECIP)
        even_RH = _scaled(even_RH, s_R, FMT, RECIP)
        odd_RH = _scaled(odd_RH, s_R, FMT, RECIP)
    else:
        offs_RB = g_R[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
        x_RB = tl.load(x_ptr + offs_RB, mask=mask_R[:, None], other=0.0).to(tl.float32)
        s_R = _group_scale(tl.max(tl.abs(x_RB), axis=1), FMT, RECIP)
        v_RB = _scaled(x_RB, s_R, FMT, RECIP)
    tl.store(s_ptr + g_R, _scale_byte(s_R, FMT).to(tl.uint8), mask=mask_R)
    if FMT == 0:
        code_RB = _e4m3_byte(tl.minimum(tl.maximum(v_RB, -448.0), 448.0))
        tl.store(q_ptr + offs_RB, code_RB.to(tl.uint8), mask=mask_R[:, None])
    else:
        if not STRIDED:
            even_RH, odd_RH = tl.split(tl.reshape(v_RB, (ROWS, HALF, 2)))
        byte_RH = _e2m1_code(even_RH, RECIP) | (_e2m1_code(odd_RH, RECIP) << 4)
        offs_RH = g_R[:, None] * HALF + tl.arange(0, HALF)[None, :]
        tl.store(q_ptr + offs_RH, byte_RH.to(tl.uint8), mask=mask_R[:, None])


@triton.jit
def _fp4_pack_pairs_kernel(
    xw_ptr, q_ptr, s_ptr, n_groups,
    FMT: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr, SRC: tl.constexpr,
):  # fmt: skip
    """FP4 quantise+pack reading each (even, odd) element pair as one word: x viewed as int32 (SRC 0:
    bf16 pairs, 1: fp16 pairs) or int64 (SRC 2: fp32 pairs), so every load is a full coalesced
    vector and the pair splits with integer shifts (no shuffles); one output byte per word."""
    pid = tl.program_id(0)
    g_R = pid.to(tl.int64) * ROWS + tl.arange(0, ROWS)
    mask_R = g_R < n_groups
    HALF: tl.constexpr = BLOCK // 2
    offs_RH = g_R[:, None] * HALF + tl.arange(0, HALF)[None, :]
    w_RH = tl.load(xw_ptr + offs_RH, mask=mask_R[:, None], other=0)
    if SRC == 0:
        even_RH = (w_RH << 16).to(tl.float32, bitcast=True)
        odd_RH = (w_RH & -65536).to(tl.float32, bitcast=True)
    elif SRC == 1:
        even_RH = (w_RH & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        odd_RH = (w_RH >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    else:
        even_RH = (w_RH & 0xFFFFFFFF).to(tl.int32).to(tl.float32, bitcast=True)
        odd_RH = (w_RH >> 32).to(tl.int32).to(tl.float32, bitcast=True)
    RECIP: tl.constexpr = FMT == 1 and SRC != 2
    amax_R = tl.maximum(tl.max(tl.abs(even_RH), axis=1), tl.max(tl.abs(odd_RH), axis=1))
    s_R = _group_scale(amax_R, FMT, SRC != 2)
    tl.store(s_ptr + g_R, _scale_byte(s_R, FMT).to(tl.uint8), mask=mask_R)
    byte_RH = _e2m1_code(_scaled(even_RH, s_R, FMT, RECIP), RECIP)
    byte_RH |= _e2m1_code(_scaled(odd_RH, s_R, FMT, RECIP), RECIP) << 4
    tl.store(q_ptr + offs_RH, byte_RH.to(tl.uint8), mask=mask_R[:, None])


@triton.jit
def _halves_of_words(w, SRC: tl.constexpr):
    """int32 words of two 16-bit values (SRC 0: bf16, 1: fp16) -> (even, odd) elements as fp32."""
    if SRC == 0:
        even = (w << 16).to(tl.float32, bitcast=True)
        odd = (w & -65536).to(tl.float32, bitcast=True)
    else:
        even = (w & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        odd = (w >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return even, odd


@triton.jit
def _xorsign_abs_words(a, b, MIN: tl.constexpr, SRC: tl.constexpr):
    """min (MIN) or max of |a| and |b| per 16-bit half of int32 words of bf16 (SRC 0) / fp16 (1) pairs,
    signed with the xor of the inputs' signs: PTX {min,max}.xorsign.abs, one instruction for two
    elements. Exact (a min or max picks one of its inputs). The amax takes the max (its sign bits are
    junk, dropped by its caller); the E4M3/16 pack's clamp the min against a bound >= 0, which keeps
    a's sign. Under the interpreter, the same on the bits (no NaN inputs there)."""
    if INTERPRET:
        la, lb, ha, hb = a & 0x7FFF, b & 0x7FFF, (a >> 16) & 0x7FFF, (b >> 16) & 0x7FFF
        if MIN:
            mag = tl.minimum(la, lb) | (tl.minimum(ha, hb) << 16)
        else:
            mag = tl.maximum(la, lb) | (tl.maximum(ha, hb) << 16)
        r = mag | ((a ^ b) & -2147450880)  # the sign bits 0x80008000
    elif MIN and SRC == 0:
        r = tl.inline_asm_elementwise("min.xorsign.abs.bf16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.int32,
                                      is_pure=True, pack=1)  # fmt: skip
    elif MIN:
        r = tl.inline_asm_elementwise("min.xorsign.abs.f16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.int32,
                                      is_pure=True, pack=1)  # fmt: skip
    elif SRC == 0:
        r = tl.inline_asm_elementwise("max.xorsign.abs.bf16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.int32,
                                      is_pure=True, pack=1)  # fmt: skip
    else:
        r = tl.inline_asm_elementwise("max.xorsign.abs.f16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.int32,
                                      is_pure=True, pack=1)  # fmt: skip
    return r


@triton.jit
def _e4m3_clamp_words(s_R, SRC: tl.constexpr):
    """6·s (exact in 16 bits: s has 4 significant bits) in both halves of an int32 [R, 1]: the E4M3/16
    pack clamps |x| to it on the packed words (`_xorsign_abs_words` min, two elements per instruction), where
    x/s > 6 saturates to code 7 anyway, so `_e2m1_lowbits` needs no per-element clamp."""
    if SRC == 0:
        t = (6.0 * s_R).to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    else:
        t = (6.0 * s_R).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    return (t | (t << 16))[:, None]


@triton.jit
def _group_amax_words(w0, w1, w2, w3, BLOCK: tl.constexpr, SRC: tl.constexpr):
    """amax (fp32 [R]) of groups held as [R, 4] word chunks w0..w3 (w2, w3 only for BLOCK 32), one row per
    thread, by `_xorsign_abs_words` max: 5 (BLOCK 16) / 7 (32) packed max-abs and one fp32 max per group instead of
    15 / 31 fp32 maxes on the unpacked halves."""
    m = _xorsign_abs_words(w0, w1, False, SRC)
    if BLOCK == 32:
        m = _xorsign_abs_words(m, _xorsign_abs_words(w2, w3, False, SRC), False, SRC)
    m02, m13 = tl.split(tl.reshape(m, (m.shape[0], 2, 2)))
    m0, m2 = tl.split(m02)
    m1, m3 = tl.split(m13)
    m = _xorsign_abs_words(_xorsign_abs_words(m0, m1, False, SRC), _xorsign_abs_words(m2, m3, False, SRC), False, SRC)
    e, o = _halves_of_words(m, SRC)
    return tl.maximum(tl.abs(e), tl.abs(o))


@triton.jit
def _e2m1_lowbits(x, r_R, FMT: tl.constexpr):
    """x (fp32 [R]) times the group's multiplier r -> int32 whose low 4 bits are the E2M1 magnitude code
    (bit 3 clear; higher bits junk), via `_e2m1_parts`' add. MXFP4: r = 2^-e is exact and |x·r| <= 6·(1+2^-23)
    (the scale is rounded up from fl(amax·fl(1/6))), which still rounds to code 7, so no clamp. E4M3: x is
    already clamped to |x| <= 6s (`_e4m3_clamp_words`; the rounded-down scale otherwise lets x/s reach 6.375,
    or more with subnormal scales, past what the add can round), r is (1+2^-14)/s within 2 ulp, and x·r is
    truncated to 13 significant bits, which reproduces the rounding of x/s:
    x ≠ t·s puts x/s >= 2^-11·t away from a tie t (see `_scaled`), beyond the <= 2^-12 moved here,
    while x = t·s gives x·r in (t, t·(1+2^-13)), which truncates back to t exactly (t has <= 3 bits)."""
    v = x * r_R
    if FMT == 1:  # |v| and its truncation in one mask; |x| <= 6s (the caller's clamp) keeps |v| < 6.001
        v = (v.to(tl.int32, bitcast=True) & 0x7FFFF800).to(tl.float32, bitcast=True)
    # the exponent field of the signed v (the mask drops the sign), so |v| stays an operand modifier
    c = tl.maximum((v.to(tl.int32, bitcast=True) & 0x7F800000) + 184549382, 1249902598)
    b = (tl.abs(v) + c.to(tl.float32, bitcast=True)).to(tl.int32, bitcast=True)
    return b + (b >> 22)  # code in the low 4 bits, see `_e2m1_parts`


@triton.jit
def _pack_words(w, r_R, FMT: tl.constexpr, SRC: tl.constexpr):
    """4 words [R, 4] (8 elements) of one group -> their 8 E2M1 nibbles as one int32 [R] (element i in
    nibble i). Each code's low bits and each sign (the top 4 bits of the element's fp32 pattern) enter
    an accumulator through one funnel shift each; one LOP3 then merges codes and signs."""
    w02, w13 = tl.split(tl.reshape(w, (w.shape[0], 2, 2)))
    w0, w2 = tl.split(w02)
    w1, w3 = tl.split(w13)
    e0, o0 = _halves_of_words(w0, SRC)
    e1, o1 = _halves_of_words(w1, SRC)
    e2, o2 = _halves_of_words(w2, SRC)
    e3, o3 = _halves_of_words(w3, SRC)
    # signs move up (element 0 enters last), codes move down (element 0 enters first); each chain starts
    # from a register whose bits all leave it (from a constant, the first two steps compile to more).
    sg = _signs_in(_signs_in(w0.to(tl.uint32, bitcast=True), e3, o3), e2, o2)
    sg = _signs_in(_signs_in(sg, e1, o1), e0, o0)
    acc = _codes_in(_codes_in(sg, e0, o0, r_R, FMT), e1, o1, r_R, FMT)
    acc = _codes_in(_codes_in(acc, e2, o2, r_R, FMT), e3, o3, r_R, FMT)
    return ((acc & 0x77777777) | (sg & 0x88888888)).to(tl.int32, bitcast=True)


@triton.jit
def _codes64(w_lo, w_hi, r_R, FMT: tl.constexpr, SRC: tl.constexpr):
    """Two [R, 4] word chunks (16 elements) -> their 16 E2M1 nibbles as one int64 [R], w_lo's first."""
    lo = _pack_words(w_lo, r_R, FMT, SRC).to(tl.int64) & 0xFFFFFFFF
    return lo | (_pack_words(w_hi, r_R, FMT, SRC).to(tl.int64) << 32)


@triton.jit
def _signs_in(acc, even, odd):
    """acc << 8 with the top 4 bits (sign in bit 3) of fp32 odd, then even, funnelled in at the bottom."""
    acc = (acc << 4) | (odd.to(tl.uint32, bitcast=True) >> 28)
    return (acc << 4) | (even.to(tl.uint32, bitcast=True) >> 28)


@triton.jit
def _codes_in(acc, even, odd, r_R, FMT: tl.constexpr):
    """acc >> 8 with the low 4 bits of `_e2m1_lowbits` of even, then odd, funnelled in at the top."""
    acc = (acc >> 4) | (_e2m1_lowbits(even, r_R, FMT).to(tl.uint32, bitcast=True) << 28)
    return (acc >> 4) | (_e2m1_lowbits(odd, r_R, FMT).to(tl.uint32, bitcast=True) << 28)


@triton.jit
def _e4m3_multiplier(s_R):
    """(1 + 2^-14) / s within 2 ulp, `_e2m1_lowbits`' multiplier: PTX rcp.approx.ftz (1 ulp; s >= 2^-9 is
    never subnormal) and one multiply, where div.approx.f32 adds a subnormal guard of four instructions;
    the margins it must stay within are 2^-14 / 2^-13. Exact division under the interpreter."""
    if INTERPRET:
        r = 1.0 / s_R
    else:
        r = tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [s_R], dtype=tl.float32, is_pure=True,
                                      pack=1)  # fmt: skip
    return r * 1.00006103515625


@triton.jit
def _fp4_pack_two_groups(xw_ptr, q_ptr, s_ptr, n_pairs, ROWS: tl.constexpr, SRC: tl.constexpr):
    """E4M3/16 with TWO ADJACENT GROUPS PER THREAD: 64 bytes loaded as 4 chunks of 16 (MXFP4/32's
    access pattern, half as many threads each striding twice as far), two amaxes and scales, the two
    scale bytes stored as one int16 (s viewed as int16) and the 16 code bytes as two int64."""
    FMT: tl.constexpr = 1  # E4M3 scales only: the clamp words and the multiplier below are E4M3's
    g_R = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    mask_R = g_R < n_pairs
    offs_R4 = g_R[:, None] * 16 + tl.arange(0, 4)[None, :]
    w0 = tl.load(xw_ptr + offs_R4, mask=mask_R[:, None], other=0, eviction_policy="evict_first")
    w1 = tl.load(xw_ptr + offs_R4 + 4, mask=mask_R[:, None], other=0, eviction_policy="evict_first")
    w2 = tl.load(xw_ptr + offs_R4 + 8, mask=mask_R[:, None], other=0, eviction_policy="evict_first")
    w3 = tl.load(xw_ptr + offs_R4 + 12, mask=mask_R[:, None], other=0, eviction_policy="evict_first")
    sa_R = _group_scale(_group_amax_words(w0, w1, w0, w1, 16, SRC), FMT, True)
    sb_R = _group_scale(_group_amax_words(w2, w3, w2, w3, 16, SRC), FMT, True)
    scales = _scale_byte(sa_R, FMT) | (_scale_byte(sb_R, FMT) << 8)
    tl.store(s_ptr + g_R, scales.to(tl.int16), mask=mask_R)
    ta, tb = _e4m3_clamp_words(sa_R, SRC), _e4m3_clamp_words(sb_R, SRC)
    w0, w1 = _xorsign_abs_words(w0, ta, True, SRC), _xorsign_abs_words(w1, ta, True, SRC)
    w2, w3 = _xorsign_abs_words(w2, tb, True, SRC), _xorsign_abs_words(w3, tb, True, SRC)
    ra_R, rb_R = _e4m3_multiplier(sa_R), _e4m3_multiplier(sb_R)
    tl.store(q_ptr + 2 * g_R, _codes64(w0, w1, ra_R, FMT, SRC), mask=mask_R)
    tl.store(q_ptr + 2 * g_R + 1, _codes64(w2, w3, rb_R, FMT, SRC), mask=mask_R)


@triton.jit
def _fp4_pack_groups_kernel(
    xw_ptr, q_ptr, s_ptr, n_groups,
    FMT: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr, SRC: tl.constexpr, AMAX2: tl.constexpr,
):  # fmt: skip
    """FP4 quantise+pack of 16-bit x with ONE THREAD PER GROUP: the group is loaded as BLOCK/8 chunks
    of 4 words (16 bytes each, [R, 4] tensors that Triton lays out one row per thread), so the amax,
    the scale and its multiplier are computed once per group with no cross-thread shuffles, and the
    group's packed bytes leave as one (E4M3/16) or two (MXFP4/32) 8-byte stores. q is viewed as int64.
    The loads evict first (x is read once). AMAX2: the amax by `_group_amax_words`."""
    pid = tl.program_id(0)
    g_R = pid.to(tl.int64) * ROWS + tl.arange(0, ROWS)
    mask_R = g_R < n_groups
    WPG: tl.constexpr = BLOCK // 2
    offs_R4 = g_R[:, None] * WPG + tl.arange(0, 4)[None, :]
    w0 = tl.load(xw_ptr + offs_R4, mask=mask_R[:, None], other=0, eviction_policy="evict_first")
    w1 = tl.load(xw_ptr + offs_R4 + 4, mask=mask_R[:, None], other=0, eviction_policy="evict_first")
    if BLOCK == 32:
        w2 = tl.load(xw_ptr + offs_R4 + 8, mask=mask_R[:, None], other=0, eviction_policy="evict_first")
        w3 = tl.load(xw_ptr + offs_R4 + 12, mask=mask_R[:, None], other=0, eviction_policy="evict_first")
    else:
        w2, w3 = w0, w1
    if AMAX2:
        amax_R = _group_amax_words(w0, w1, w2, w3, BLOCK, SRC)
    else:
        e0, o0 = _halves_of_words(w0, SRC)
        e1, o1 = _halves_of_words(w1, SRC)
        amax = tl.maximum(tl.maximum(tl.abs(e0), tl.abs(o0)), tl.maximum(tl.abs(e1), tl.abs(o1)))
        if BLOCK == 32:
            e2, o2 = _halves_of_words(w2, SRC)
            e3, o3 = _halves_of_words(w3, SRC)
            amax = tl.maximum(amax, tl.maximum(tl.maximum(tl.abs(e2), tl.abs(o2)), tl.maximum(tl.abs(e3), tl.abs(o3))))
        amax_R = tl.max(amax, axis=1)
    s_R = _group_scale(amax_R, FMT, True)
    tl.store(s_ptr + g_R, _scale_byte(s_R, FMT).to(tl.uint8), mask=mask_R)
    if FMT == 1:
        t = _e4m3_clamp_words(s_R, SRC)
        w0, w1 = _xorsign_abs_words(w0, t, True, SRC), _xorsign_abs_words(w1, t, True, SRC)
        if BLOCK == 32:
            w2, w3 = _xorsign_abs_words(w2, t, True, SRC), _xorsign_abs_words(w3, t, True, SRC)
        r_R = _e4m3_multiplier(s_R)
    else:
        r_R = _pow2_inv(s_R)
    codes = _codes64(w0, w1, r_R, FMT, SRC)
    if BLOCK == 16:
        tl.store(q_ptr + g_R, codes, mask=mask_R)
    else:
        tl.store(q_ptr + 2 * g_R, codes, mask=mask_R)
        tl.store(q_ptr + 2 * g_R + 1, _codes64(w2, w3, r_R, FMT, SRC), mask=mask_R)


@triton.jit
def _qdq_chunk(x, s_R, r_R, FMT: tl.constexpr, OT: tl.constexpr):
    """One [R, 8] chunk of a 16-bit group: fake quant with the group's scale s (r: the exact 1/s of a
    UE8M0 scale, or fl(1/s) of an E4M3 one with the snap of `_scaled`), rounded to the output dtype."""
    if FMT == 0:
        q = _round_e4m3(tl.minimum(tl.maximum(x * r_R[:, None], -448.0), 448.0))
    else:
        q = _e2m1_qdq(x * r_R[:, None], FMT == 1)
    return cast_rne(q * s_R[:, None], OT)


@triton.jit
def _qdq_groups_kernel(x_ptr, y_ptr, n_groups, FMT: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    """`_qdq_kernel` for 16-bit x with one thread per group: chunks of 8 elements (16 bytes, [R, 8]
    tensors laid out one row per thread), the scale computed once per group, no shuffles."""
    pid = tl.program_id(0)
    g_R = pid.to(tl.int64) * ROWS + tl.arange(0, ROWS)
    m_R1 = (g_R < n_groups)[:, None]
    offs_R8 = g_R[:, None] * BLOCK + tl.arange(0, 8)[None, :]
    x0 = tl.load(x_ptr + offs_R8, mask=m_R1, other=0.0).to(tl.float32)
    x1 = tl.load(x_ptr + offs_R8 + 8, mask=m_R1, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.abs(x0), tl.abs(x1))
    if BLOCK == 32:
        x2 = tl.load(x_ptr + offs_R8 + 16, mask=m_R1, other=0.0).to(tl.float32)
        x3 = tl.load(x_ptr + offs_R8 + 24, mask=m_R1, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.maximum(tl.abs(x2), tl.abs(x3)))
    s_R = _group_scale(tl.max(amax, axis=1), FMT, True)
    if FMT == 1:
        r_R = tl.math.div_rn(tl.full(s_R.shape, 1.0, tl.float32), s_R)
    else:
        r_R = _pow2_inv(s_R)
    OT: tl.constexpr = y_ptr.dtype.element_ty
    tl.store(y_ptr + offs_R8, _qdq_chunk(x0, s_R, r_R, FMT, OT), mask=m_R1)
    tl.store(y_ptr + offs_R8 + 8, _qdq_chunk(x1, s_R, r_R, FMT, OT), mask=m_R1)
    if BLOCK == 32:
        tl.store(y_ptr + offs_R8 + 16, _qdq_chunk(x2, s_R, r_R, FMT, OT), mask=m_R1)
        tl.store(y_ptr + offs_R8 + 24, _qdq_chunk(x3, s_R, r_R, FMT, OT), mask=m_R1)


@triton.jit
def _unpack_word(w_R, s_R, OT: tl.constexpr):
    """int32 word [R] of 8 packed E2M1 codes (low nibble first) -> the 8 values · s as [R, 8] in OT:
    `_e2m1_of_nibble` and one multiply by the scale (exact: power-of-two or e4m3 x E2M1 products)."""
    v = _e2m1_of_nibble((w_R[:, None] >> (4 * tl.arange(0, 8))[None, :]) & 15)  # & 15: the SASS of before
    return cast_rne(v * s_R[:, None], OT)


@triton.jit
def _fp4_unpack_groups_kernel(qw_ptr, s_ptr, y_ptr, n_groups, FMT: tl.constexpr, BLOCK: tl.constexpr,
                              ROWS: tl.constexpr):  # fmt: skip
    """Inverse of `_fp4_pack_groups_kernel` with one thread per group: the group's packed words (q
    viewed as int32) in one load, each word expanded to 8 values stored as one 16-byte chunk."""
    pid = tl.program_id(0)
    g_R = pid.to(tl.int64) * ROWS + tl.arange(0, ROWS)
    mask_R = g_R < n_groups
    sb_R = tl.load(s_ptr + g_R, mask=mask_R, other=127).to(tl.int32)
    if FMT == 1:
        s_R = _e4m3_of_byte(sb_R)
    else:
        s_R = (sb_R << 23).to(tl.float32, bitcast=True)
    WPG: tl.constexpr = BLOCK // 8
    w = tl.load(qw_ptr + g_R[:, None] * WPG + tl.arange(0, WPG)[None, :], mask=mask_R[:, None], other=0)
    OT: tl.constexpr = y_ptr.dtype.element_ty
    offs_R8 = g_R[:, None] * BLOCK + tl.arange(0, 8)[None, :]
    if BLOCK == 16:
        w0, w1 = tl.split(w)
        tl.store(y_ptr + offs_R8, _unpack_word(w0, s_R, OT), mask=mask_R[:, None])
        tl.store(y_ptr + offs_R8 + 8, _unpack_word(w1, s_R, OT), mask=mask_R[:, None])
    else:
        w02, w13 = tl.split(tl.reshape(w, (ROWS, 2, 2)))
        w0, w2 = tl.split(w02)
        w1, w3 = tl.split(w13)
        tl.store(y_ptr + offs_R8, _unpack_word(w0, s_R, OT), mask=mask_R[:, None])
        tl.store(y_ptr + offs_R8 + 8, _unpack_word(w1, s_R, OT), mask=mask_R[:, None])
        tl.store(y_ptr + offs_R8 + 16, _unpack_word(w2, s_R, OT), mask=mask_R[:, None])
        tl.store(y_ptr + offs_R8 + 24, _unpack_word(w3, s_R, OT), mask=mask_R[:, None])


@triton.jit
def _dequant_kernel(q_ptr, s_ptr, y_ptr, n_groups, FMT: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    """Inverse of `_quant_pack_kernel`: codes + scale bytes -> values in y's dtype. (Stride-2 stores
    of the even / odd halves instead of tl.join measured 7-8x slower on an H200.)"""
    pid = tl.program_id(0)
    g_R = pid.to(tl.int64) * ROWS + tl.arange(0, ROWS)
    mask_R = g_R < n_groups
    sb_R = tl.load(s_ptr + g_R, mask=mask_R, other=127).to(tl.int32)
    if FMT == 1:
        s_R = _e4m3_of_byte(sb_R)
    else:
        s_R = (sb_R << 23).to(tl.float32, bitcast=True)
    out_ty = y_ptr.dtype.element_ty
    offs_RB = g_R[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    if FMT == 0:
        c_RB = tl.load(q_ptr + offs_RB, mask=mask_R[:, None], other=0).to(tl.int32)
        val_RB = _e4m3_of_byte(c_RB) * s_R[:, None]
    else:
        HALF: tl.constexpr = BLOCK // 2
        offs_RH = g_R[:, None] * HALF + tl.arange(0, HALF)[None, :]
        b_RH = tl.load(q_ptr + offs_RH, mask=mask_R[:, None], other=0).to(tl.int32)
        lo_RH = _e2m1_mag_of_code(b_RH & 7)
        lo_RH = tl.where((b_RH & 8) != 0, -lo_RH, lo_RH) * s_R[:, None]
        hi_RH = _e2m1_mag_of_code((b_RH >> 4) & 7)
        hi_RH = tl.where((b_RH & 128) != 0, -hi_RH, hi_RH) * s_R[:, None]
        val_RB = tl.reshape(tl.join(lo_RH, hi_RH), (ROWS, BLOCK))
    tl.store(y_ptr + offs_RB, cast_rne(val_RB, out_ty), mask=mask_R[:, None])


# ------------------------------------------------------------------------------------------------
# launchers


def _check(x: torch.Tensor, block: int) -> int:
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"quant kernels take bf16 / fp16 / fp32 input, got {x.dtype}")
    if not x.is_contiguous():
        raise ValueError(f"quant kernels need a contiguous input (strides {x.stride()}): pass x.contiguous()")
    if block not in (16, 32):
        raise ValueError(f"quant blocks are 16 (FP4-E4M3) or 32 (FP8, MXFP4), got {block}")
    if x.dim() == 0 or x.size(-1) % block:
        raise ValueError(f"the last dim of {list(x.shape)} must be a multiple of the block {block}")
    return x.numel() // block


def _launch_opts(num_warps: int | None = None) -> dict:
    # the interpreter rejects compiler options; on the GPU turn FMA contraction off for exactness
    # No FMA contraction: every product/sum must round exactly like the reference's separate ops.
    return {} if _interpreting() else {"num_warps": num_warps or CONFIG["num_warps"], "enable_fp_fusion": False}


def _groups_tile(kind: str, fmt: int, x: torch.Tensor) -> dict | None:
    """The per-group kernel's tile for this kind ("qdq", "pack", "unpack") and format, or None."""
    if not CONFIG["groups"] or x.element_size() != 2:
        return None
    return CONFIG[f"{kind}_groups"].get(fmt)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def qdq(x: torch.Tensor, fmt: int, block: int | None = None) -> torch.Tensor:
    """Fake quant (no autograd): x (bf16/fp16/fp32, contiguous, last dim % block == 0) -> same shape/dtype."""
    block = block or _DEFAULT_BLOCK[fmt]
    n_groups = _check(x, block)
    y = torch.empty_like(x)
    tile = _groups_tile("qdq", fmt, x)
    if n_groups and tile:
        rows = tile["rows"]
        grid = (triton.cdiv(n_groups, rows),)
        opts = _launch_opts(tile["num_warps"])
        _qdq_groups_kernel[grid](x, y, n_groups, FMT=fmt, BLOCK=block, ROWS=rows, **opts)
    elif n_groups:
        rows = CONFIG["rows"]
        grid = (triton.cdiv(n_groups, rows),)
        _qdq_kernel[grid](x, y, n_groups, FMT=fmt, BLOCK=block, ROWS=rows, **_launch_opts())
    return y


def quantize_packed(x: torch.Tensor, fmt: int, block: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., N] -> (codes, scale bytes [..., N/block] uint8).

    codes: fp8 -> uint8 e4m3fn bits [..., N] (`.view(torch.float8_e4m3fn)` gives torch's dtype);
    fp4 formats -> packed uint8 [..., N/2], low nibble = even element.
    """
    block = block or _DEFAULT_BLOCK[fmt]
    n_groups = _check(x, block)
    n = x.size(-1)
    codes_n = n if fmt == FMT_FP8 else n // 2
    q = torch.empty(*x.shape[:-1], codes_n, dtype=torch.uint8, device=x.device)
    s = torch.empty(*x.shape[:-1], n // block, dtype=torch.uint8, device=x.device)
    if not n_groups:
        return q, s
    tile = _groups_tile("pack", fmt, x) if fmt != FMT_FP8 else None  # FP4 packing only
    if tile:
        try:
            xw = x.view(torch.int32)
        except RuntimeError:  # storage offset not pair-aligned: the element kernel below
            xw = None
        if xw is not None:
            rows = tile["rows"]
            grid = (triton.cdiv(n_groups, rows),)
            src = 0 if x.dtype == torch.bfloat16 else 1
            opts = _launch_opts(tile["num_warps"])
            amax2 = CONFIG["pack_amax2"][fmt]
            if tile.get("two") and fmt == FMT_FP4_E4M3 and block == 16 and s.size(-1) % 2 == 0:
                grid = (triton.cdiv(n_groups // 2, rows),)
                _fp4_pack_two_groups[grid](xw, q.view(torch.int64), s.view(torch.int16), n_groups // 2, ROWS=rows,
                                           SRC=src, **opts)  # fmt: skip
                return q, s
            _fp4_pack_groups_kernel[grid](xw, q.view(torch.int64), s, n_groups, FMT=fmt, BLOCK=block, ROWS=rows,
                                          SRC=src, AMAX2=amax2, **opts)  # fmt: skip
            return q, s
    if fmt != FMT_FP8 and CONFIG["pairs"]:
        src = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}[x.dtype]
        try:
            xw = x.view(torch.int64 if src == 2 else torch.int32)
        except RuntimeError:  # storage offset not pair-aligned: the element kernel below
            xw = None
        if xw is not None:
            rows = CONFIG["rows_pairs"]
            grid = (triton.cdiv(n_groups, rows),)
            _fp4_pack_pairs_kernel[grid](xw, q, s, n_groups, FMT=fmt, BLOCK=block, ROWS=rows, SRC=src, **_launch_opts())
            return q, s
    rows = CONFIG["rows"]
    strided = CONFIG["strided"] if CONFIG["strided"] is not None else fmt == FMT_FP4_E4M3
    grid = (triton.cdiv(n_groups, rows),)
    _quant_pack_kernel[grid](x, q, s, n_groups, FMT=fmt, BLOCK=block, ROWS=rows, STRIDED=strided, **_launch_opts())
    return q, s


def dequantize_packed(q: torch.Tensor, s: torch.Tensor, fmt: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Inverse of `quantize_packed`: (codes, scale bytes) -> values [..., N] in `dtype`."""
    if not (q.is_contiguous() and s.is_contiguous()):
        raise ValueError("codes and scale bytes must be contiguous: pass .contiguous() copies")
    q = q.view(torch.uint8)
    s = s.view(torch.uint8)
    n = q.size(-1) * (1 if fmt == FMT_FP8 else 2)
    if q.shape[:-1] != s.shape[:-1] or s.size(-1) == 0 or n % s.size(-1) or n // s.size(-1) not in (16, 32):
        raise ValueError(f"codes {list(q.shape)} and scales {list(s.shape)} do not describe blocks of 16 or 32 "
                         f"(quantize_packed's layout: codes [..., N or N/2], scales [..., N/block])")  # fmt: skip
    block = n // s.size(-1)
    y = torch.empty(*q.shape[:-1], n, dtype=dtype, device=q.device)
    n_groups = s.numel()
    tile = _groups_tile("unpack", fmt, y) if fmt != FMT_FP8 else None
    if n_groups and tile:
        rows = tile["rows"]
        grid = (triton.cdiv(n_groups, rows),)
        opts = _launch_opts(tile["num_warps"])
        _fp4_unpack_groups_kernel[grid](q.view(torch.int32), s, y, n_groups, FMT=fmt, BLOCK=block, ROWS=rows, **opts)
    elif n_groups:
        rows = CONFIG["rows_dequant"]
        grid = (triton.cdiv(n_groups, rows),)
        _dequant_kernel[grid](q, s, y, n_groups, FMT=fmt, BLOCK=block, ROWS=rows, **_launch_opts())
    return y


def scale_bytes_to_float(s: torch.Tensor, fmt: int) -> torch.Tensor:
    """Scale bytes -> fp32 (UE8M0: 2^(b-127); E4M3: the e4m3fn value)."""
    if fmt == FMT_FP4_E4M3:
        return s.view(torch.float8_e4m3fn).float()
    return (s.to(torch.int32) << 23).view(torch.float32)


# ------------------------------------------------------------------------------------------------
# autograd: straight-through fake quant, registered as custom ops so torch.compile can trace them


@torch.library.custom_op("flashpost::qdq", mutates_args=())
def _qdq_op(x: torch.Tensor, fmt: int, block: int) -> torch.Tensor:
    return qdq(x.contiguous(), fmt, block)


@_qdq_op.register_fake
def _(x: torch.Tensor, fmt: int, block: int) -> torch.Tensor:
    return torch.empty_like(x)


def _qdq_backward(ctx, grad: torch.Tensor):
    return grad, None, None


_qdq_op.register_autograd(_qdq_backward)


def fp8_fake_quant(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """FP8 e4m3 QDQ, UE8M0 scale per `block` (Triton; straight-through gradient)."""
    return _qdq_op(x, FMT_FP8, block)


def fp4_e4m3_fake_quant(x: torch.Tensor, block: int = 16) -> torch.Tensor:
    """E2M1 QDQ, E4M3 scale per `block` (Triton; straight-through gradient)."""
    return _qdq_op(x, FMT_FP4_E4M3, block)


def mxfp4_fake_quant(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """E2M1 QDQ, UE8M0 scale per `block` (Triton; straight-through gradient)."""
    return _qdq_op(x, FMT_MXFP4, block)


def quantize_fp8_packed(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (e4m3fn code bytes uint8 [..., N], UE8M0 exponent bytes [..., N/block])."""
    return quantize_packed(x, FMT_FP8, block)


def quantize_fp4_e4m3_packed(x: torch.Tensor, block: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (packed E2M1 bytes [..., N/2], e4m3fn scale bytes [..., N/block])."""
    return quantize_packed(x, FMT_FP4_E4M3, block)


def quantize_mxfp4_packed(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (packed E2M1 bytes [..., N/2], UE8M0 exponent bytes [..., N/block])."""
    return quantize_packed(x, FMT_MXFP4, block)


def dequantize_fp8_packed(q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return dequantize_packed(q, s, FMT_FP8, dtype)


def dequantize_fp4_packed(
    q: torch.Tensor, s: torch.Tensor, scale_fmt: str, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """scale_fmt: "e4m3" (compressed KV, block 16) or "ue8m0" (MXFP4, block 32)."""
    if scale_fmt not in ("e4m3", "ue8m0"):
        raise ValueError(f"scale_fmt must be 'e4m3' (FP4-E4M3 scales) or 'ue8m0' (MXFP4), got {scale_fmt!r}")
    fmt = {"e4m3": FMT_FP4_E4M3, "ue8m0": FMT_MXFP4}[scale_fmt]
    return dequantize_packed(q, s, fmt, dtype)
