"""The element-format arithmetic of kernels/quant.py's kernels: @triton.jit helpers on the IEEE-754
bits of fp32 values (fp32 in, fp32 or int32 out): RNE casts to fp8 / bf16, E4M3 and E2M1 rounding and
codes, power-of-two and E4M3 group scales and their stored bytes, and the exact scaled division. Each
shortcut here is checked exhaustively against the reference arithmetic of model/quant.py by
tests/kernels/test_quant.py through the kernels that use it.
Not here: kernels, launchers or tile configs (kernels/quant.py).
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

# Under TRITON_INTERPRET=1 the fp8 / bf16 casts are emulated on the bits (the interpreter's own casts
# truncate); compiled for the GPU the hardware RNE-satfinite conversions are used. Both round to
# nearest-even, which the parity tests check with torch.equal on each side.
INTERPRET = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")


@triton.jit
def cast_rne(x, DTYPE: tl.constexpr):
    """fp32 -> DTYPE with round-to-nearest-even. For bf16 the rounding is done on the bits first,
    because the Triton interpreter's own fp32->bf16 cast truncates (the GPU cast is already RNE,
    so it is used as is there). NaN payloads are not preserved by the emulation."""
    if INTERPRET and DTYPE == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536  # -65536 == ~0xFFFF
        y = bits.to(tl.float32, bitcast=True).to(DTYPE)
    else:
        y = x.to(DTYPE)
    return y


@triton.jit
def _round_e4m3_mag(a):
    """Magnitude a >= 0 (<= 448, fp32) -> nearest e4m3fn magnitude, round-to-nearest-even."""
    bits = a.to(tl.int32, bitcast=True)
    e = (bits >> 23) & 0xFF
    # normal e4m3 (a >= 2^-6, fp32 biased exponent >= 121): keep 3 mantissa bits, RNE on the bits
    rn = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576  # -1048576 == ~0xFFFFF
    normal = rn.to(tl.float32, bitcast=True)
    # subnormal e4m3: integer multiples of 2^-9; RNE shift of the 24-bit significand
    m = (bits & 0x7FFFFF) | 0x800000
    sh = tl.minimum(141 - e, 31)
    sh = tl.maximum(sh, 1)
    q = (m + ((1 << (sh - 1)) - 1) + ((m >> sh) & 1)) >> sh
    sub = q.to(tl.float32) * 0.001953125  # 2^-9, exact
    return tl.where(e >= 121, normal, sub)


@triton.jit
def _e4m3_code_of_mag(r):
    """Exact e4m3 magnitude r (fp32) -> 7-bit e4m3fn code (exponent field << 3 | mantissa)."""
    bits = r.to(tl.int32, bitcast=True)
    e = (bits >> 23) & 0xFF
    normal = ((e - 120) << 3) | ((bits >> 20) & 7)
    sub = (r * 512.0).to(tl.int32)
    return tl.where(e >= 121, normal, sub)


@triton.jit
def _round_e4m3(v):
    """fp32 v (|v| <= 448) -> nearest e4m3fn value as fp32, RNE, sign (also of zero) kept."""
    if INTERPRET:
        mag = _round_e4m3_mag(tl.abs(v))
        r = tl.where(v.to(tl.int32, bitcast=True) < 0, -mag, mag)
    else:
        r = v.to(tl.float8e4nv).to(tl.float32)  # cvt.rn.satfinite
    return r


@triton.jit
def _e4m3_byte(v):
    """fp32 v (|v| <= 448) -> e4m3fn bit pattern (int32 0..255), RNE."""
    if INTERPRET:
        mag = _round_e4m3_mag(tl.abs(v))
        sign = (v.to(tl.int32, bitcast=True) < 0).to(tl.int32)
        b = _e4m3_code_of_mag(mag) | (sign << 7)
    else:
        b = v.to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.int32)
    return b


@triton.jit
def _e4m3_of_byte(c):
    """e4m3fn bit pattern (int32) -> fp32 value."""
    if INTERPRET:
        e = (c >> 3) & 15
        m = (c & 7).to(tl.float32)
        normal = ((e + 120) << 23).to(tl.float32, bitcast=True) * (1.0 + m * 0.125)
        mag = tl.where(e > 0, normal, m * 0.001953125)
        v = tl.where((c & 128) != 0, -mag, mag)
    else:
        v = c.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    return v


@triton.jit
def _pow2_inv(s):
    """Exact 1/s for a power of two s in [2^-126, 2^126] (x·(1/s) then equals the IEEE x/s)."""
    e = (s.to(tl.int32, bitcast=True) >> 23) & 0xFF
    return ((254 - e) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _e2m1_mag_of_code(c):
    """3-bit E2M1 code (int32) -> magnitude {0, .5, 1, 1.5, 2, 3, 4, 6} (fp32)."""
    hi = tl.where(c == 4, 2.0, tl.where(c == 5, 3.0, tl.where(c == 6, 4.0, 6.0)))
    return tl.where(c < 4, c.to(tl.float32) * 0.5, hi)


@triton.jit
def _e2m1_of_nibble(c):
    """int32 whose low 4 bits are an E2M1 code (bit 3 the sign; higher bits ignored) -> its signed
    value, fp32. The code's 3 magnitude bits moved to fp32 bit 22 are the value times 2^-126 exactly
    (code 1: the subnormal 2^-127; 2..7: exponent c >> 1, mantissa bit c & 1), so one multiply by
    2^126 gives it, exact."""
    return (((c & 7) << 22) | ((c & 8) << 28)).to(tl.float32, bitcast=True) * 8.507059173023462e37  # 2^126


@triton.jit
def _pow2_ceil(x):
    """2^ceil(log2(x)) for a positive normal fp32 x, on the bits (official fast_round_scale)."""
    bits = x.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    return (e << 23).to(tl.float32, bitcast=True)


@triton.jit
def _group_scale(amax, FMT: tl.constexpr, X16: tl.constexpr = False):
    """Per-group amax (fp32) -> fp32 scale exact in its storage format. X16: amax is a 16-bit
    (bf16 / fp16) value, for which amax·fl(1/6) rounds to the same e4m3 scale as the IEEE amax/6
    (checked over every bf16 and fp16 value: a tie t of the e4m3 grid has <= 5 significant bits, so
    amax = 6t is caught exactly, and amax ≠ 6t puts amax/6 >= 2^-11·t away from it, far beyond the
    one-ulp error of the multiply); a multiply instead of a division."""
    if FMT == 0:
        s = _pow2_ceil(tl.maximum(amax, 1e-4) * (1.0 / 448.0))
    elif FMT == 1:
        if X16:
            amax_d6 = tl.maximum(amax, 0.01171875) * (1.0 / 6.0)
        else:
            amax_d6 = tl.math.div_rn(tl.maximum(amax, 0.01171875), tl.full(amax.shape, 6.0, tl.float32))
        s = _round_e4m3(tl.minimum(amax_d6, 448.0))  # > 0: the hardware RNE cast on the GPU
    else:
        s = _pow2_ceil(tl.maximum(amax, 6.0 * 1.1754943508222875e-38) * (1.0 / 6.0))
    return s


@triton.jit
def _scale_byte(s, FMT: tl.constexpr):
    """fp32 scale -> storage byte: UE8M0 biased exponent, or e4m3fn bits."""
    if FMT == 1:
        b = _e4m3_byte(s)
    else:
        b = (s.to(tl.int32, bitcast=True) >> 23) & 0xFF
    return b


@triton.jit
def _e2m1_parts(v, SNAP: tl.constexpr):
    """|v| clamped to 6 (snapped to a multiple of 2^-14 with SNAP, see _scaled) and rounded to the E2M1
    grid in ONE float add: the grid step is 0.5 below 2, 1 in [2, 4) and 2 in [4, 6], and adding
    C = 2^(22+k)·(1 + 6·2^-23) (k = max(exponent, 0), i.e. the exponent of max(mag, 1), read off the
    bits) leaves exactly step-sized ulps, so the add itself is the RNE rounding (C's mantissa is even,
    so the result's parity is the code's). Returns (C, mag + C): the rounded value is (mag + C) - C,
    and the code n + 2k (n: the multiple of the step) is the low 4 bits of b + (b >> 22) for the bits
    b = ((149 + k) << 23) + 6 + n of mag + C (6 + n + 298 + 2k = n + 2k mod 16). Checked equal to the table
    rounding for every fp32 in [0, 8]; fewer instructions than two paths and a select (issue-bound)."""
    mag = tl.minimum(tl.abs(v), 6.0)
    if SNAP:
        mag = (mag + 768.0) - 768.0
    # one add-max on the exponent field: (22 << 23) + 6 == 184549382, (149 << 23) + 6 == 1249902598
    c = tl.maximum((mag.to(tl.int32, bitcast=True) & 0x7F800000) + 184549382, 1249902598)
    return c.to(tl.float32, bitcast=True), mag + c.to(tl.float32, bitcast=True)


@triton.jit
def _e2m1_qdq(v, SNAP: tl.constexpr):
    """x/s (fp32) -> rounded E2M1 value (fp32), sign kept (also of zero), magnitude clamped to 6."""
    c, sc = _e2m1_parts(v, SNAP)
    r = sc - c
    sign = v.to(tl.int32, bitcast=True) & -2147483648
    return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _e2m1_code(v, SNAP: tl.constexpr):
    """x/s (fp32) -> 4-bit E2M1 code (bit 3 = sign bit of v)."""
    c, sc = _e2m1_parts(v, SNAP)
    b = sc.to(tl.int32, bitcast=True)
    code = (b + (b >> 22)) & 7
    return code | ((v.to(tl.int32, bitcast=True) >> 28) & 8)


@triton.jit
def _scaled(x, s_R, FMT: tl.constexpr, RECIP: tl.constexpr):
    """x [R, B] / s [R]: a multiply by the exact reciprocal for power-of-two (UE8M0) scales; for E4M3
    scales an IEEE division, or with RECIP (16-bit x, E2M1 targets only) x·fl(1/s), whose E2M1
    rounding after SNAP equals that of x/s: x has <= 11 significant bits and t·s <= 7 bits for a tie
    t of the grid (1, 3, 5 or 7 times a power of two) times s (4 bits), so x ≠ t·s means
    |x/s - t| >= 2^-11·t >= 2^-13 (ties are >= 0.25), while x·fl(1/s) is within 6·2^-22 of x/s: snapping
    |v| <= 6 to the nearest multiple of 2^-14 puts exact ties back on the tie and moves nothing across
    one. One division per group instead of one per element."""
    if FMT == 1 and RECIP:
        r_R = tl.math.div_rn(tl.full(s_R.shape, 1.0, tl.float32), s_R)
        v = x * r_R[:, None]
    elif FMT == 1:
        v = tl.math.div_rn(x, tl.broadcast_to(s_R[:, None], x.shape))
    else:
        v = x * _pow2_inv(s_R)[:, None]
    return v
