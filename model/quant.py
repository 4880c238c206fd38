"""Storage-format simulation for V4.1's low-precision activations and caches (spec §3.10).

Fake quantisers with straight-through gradients for QAT (FP8 e4m3 with UE8M0 scales per 32,
FP4 E2M1 with E4M3 scales per 16, MXFP4 = E2M1 with UE8M0 scales per 32), plus the pure
`quantize_*` / `dequantize_*` pairs and E2M1 nibble packing used by the packed inference cache.
Everything is computed in fp32 exactly like the official kernels, so a fake-quantised value and a
packed-then-unpacked one are bit-identical. Weight quantisation and block-scaled GEMMs are not here.
"""

import struct
from collections.abc import Callable

import torch

QDQ = Callable[[torch.Tensor, int], torch.Tensor]

FP8_MAX = 448.0
FP4_MAX = 6.0
FP8_AMAX_FLOOR = 1e-4
FP4_E4M3_AMAX_FLOOR = 6 * 2.0**-9  # amax/6 = 2^-9, the smallest e4m3 subnormal, so s is never 0
MXFP4_AMAX_FLOOR = 6 * 2.0**-126  # amax/6 = 2^-126, the smallest normal fp32

# E2M1 magnitudes by 3-bit code; code bit 3 is the sign (the official FP4 table order).
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Midpoints between consecutive codes. At an exact tie round-to-nearest-even goes up only when the
# upper code is even: 0.75 -> 1, 1.75 -> 2, 3.5 -> 4 (and 0.25 -> 0, 1.25 -> 1, 2.5 -> 2, 5 -> 4).
_E2M1_MIDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_E2M1_TIE_UP = (False, True, False, True, False, True, False)

_tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
_byte_tables: dict[torch.device, torch.Tensor] = {}  # packed byte -> (low nibble's value, high nibble's)


def _e2m1_tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(signed value table [16], midpoints [7], tie-up flags [7]) on `device`, built once."""
    if device not in _tables:
        grid = torch.tensor(E2M1_GRID, dtype=torch.float32)
        _tables[device] = (
            torch.cat([grid, -grid]).to(device),
            torch.tensor(_E2M1_MIDS, dtype=torch.float32, device=device),
            torch.tensor(_E2M1_TIE_UP, dtype=torch.bool, device=device),
        )
    return _tables[device]


# ------------------------------------------------------------------------------------------------
# element formats


def round_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Nearest float8 e4m3fn value (RNE) as fp32, saturating at ±448 like the CUDA `satfinite` cast.

    torch's own cast is RNE but maps overflow to NaN (e4m3fn has no inf), hence the clamp first.
    """
    return x.float().clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()


def round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 value (RNE, sign kept, magnitude clamped to 6) as fp32.

    The grid has step 0.5 on [0, 2), 1 on [2, 4) and 2 on [4, 6]; `torch.round` is
    half-to-even, and on each segment an even multiple of the step is an even code, so rounding
    the scaled magnitude reproduces the E2M1 tie rule. Cross-checked against the code path below.
    """
    mag = x.float().abs().clamp(max=FP4_MAX)
    upper = torch.where(mag < 4, torch.round(mag), torch.round(mag * 0.5) * 2)
    val = torch.where(mag < 2, torch.round(mag * 2) * 0.5, upper)
    return torch.copysign(val, x.float())


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """4-bit E2M1 codes (uint8, bit 3 = sign, bits 0-2 index `E2M1_GRID`) of fp32 values in [-6, 6]."""
    _, mids, tie_up = _e2m1_tables(x.device)
    mag = x.float().abs().contiguous()
    # bucketize(right=False) counts midpoints strictly below mag; a tie sits exactly on mids[idx]
    idx = torch.bucketize(mag, mids)
    at = idx.clamp(max=len(_E2M1_MIDS) - 1)
    code = idx + ((idx < len(_E2M1_MIDS)) & (mag == mids[at]) & tie_up[at]).long()
    return code.to(torch.uint8) | (torch.signbit(x).to(torch.uint8) << 3)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """fp32 values of 4-bit E2M1 codes (uint8)."""
    table, _, _ = _e2m1_tables(codes.device)
    return table[codes.long()]


def e2m1_byte_values(packed: torch.Tensor) -> torch.Tensor:
    """fp32 values [..., 2K] of packed E2M1 bytes [..., K] (`pack_e2m1`'s layout, low nibble first):
    `e2m1_values(unpack_e2m1(packed))` in one lookup per byte of both its values (a [256, 2] table),
    ~2.5x faster on a CPU than splitting the nibbles first (decoding packed caches every step)."""
    if packed.device not in _byte_tables:
        table, _, _ = _e2m1_tables(packed.device)
        _byte_tables[packed.device] = torch.stack([table.repeat(16), table.repeat_interleave(16)], dim=-1)
    flat = packed.view(torch.uint8).reshape(-1).int()
    return _byte_tables[packed.device].index_select(0, flat).view(*packed.shape[:-1], 2 * packed.size(-1))


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., K] -> bytes [..., K/2]; the low nibble holds the even element (official layout).

    `.view(torch.float4_e2m1fn_x2)` on the result gives torch's packed FP4 dtype if needed.
    """
    assert codes.size(-1) % 2 == 0, "E2M1 packing needs an even last dim"
    return (codes[..., 0::2] & 0x0F) | ((codes[..., 1::2] & 0x0F) << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """bytes [..., K/2] -> uint8 codes [..., K] (inverse of `pack_e2m1`)."""
    packed = packed.view(torch.uint8)
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2)


def fast_round_scale(amax: torch.Tensor, inv_max: float) -> torch.Tensor:
    """2^ceil(log2(amax·inv_max)) in fp32, read off the IEEE-754 bits like the official kernel.

    `inv_max` is rounded to fp32 first (the kernels multiply by an fp32 reciprocal constant). An exact
    power of two has a zero mantissa and is returned unchanged. Inputs must be positive normals,
    which the amax floors guarantee.
    """
    inv_max_fp32 = struct.unpack("f", struct.pack("f", inv_max))[0]  # no device tensor, no sync
    # fp32 × (fp32-exact scalar) rounds once, whichever precision torch multiplies the scalar in
    x = (amax.float() * inv_max_fp32).contiguous()
    bits = x.view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    mantissa = bits & ((1 << 23) - 1)
    log2_ceil = exponent - 127 + (mantissa != 0).to(torch.int32)
    return ((log2_ceil + 127) << 23).view(torch.float32)


# ------------------------------------------------------------------------------------------------
# block quantisers: codes + fp32 scales (scales hold values exact in their storage format)


def _groups(x: torch.Tensor, block: int) -> torch.Tensor:
    assert x.size(-1) % block == 0, f"last dim {x.size(-1)} is not a multiple of the block {block}"
    return x.float().unflatten(-1, (-1, block))


def quantize_fp8(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """act_quant with UE8M0 scales: returns (e4m3 codes as torch.float8_e4m3fn [..., N],
    power-of-two fp32 scales [..., N/block])."""
    xg = _groups(x, block)
    scale = fast_round_scale(xg.abs().amax(dim=-1).clamp_min(FP8_AMAX_FLOOR), 1 / FP8_MAX)
    codes = (xg / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes.flatten(-2), scale


def quantize_fp4_e4m3(x: torch.Tensor, block: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """fp4_act_quant, E4M3-scale path (compressed main KV): returns (uint8 E2M1 codes [..., N],
    fp32 scales [..., N/block] that are exact e4m3 values)."""
    xg = _groups(x, block)
    scale = round_e4m3(xg.abs().amax(dim=-1).clamp_min(FP4_E4M3_AMAX_FLOOR) / FP4_MAX)
    codes = e2m1_codes((xg / scale.unsqueeze(-1)).clamp(-FP4_MAX, FP4_MAX))
    return codes.flatten(-2), scale


def quantize_mxfp4(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """fp4_act_quant, UE8M0-scale path (indexer q/k): returns (uint8 E2M1 codes [..., N],
    power-of-two fp32 scales [..., N/block])."""
    xg = _groups(x, block)
    scale = fast_round_scale(xg.abs().amax(dim=-1).clamp_min(MXFP4_AMAX_FLOOR), 1 / FP4_MAX)
    codes = e2m1_codes((xg / scale.unsqueeze(-1)).clamp(-FP4_MAX, FP4_MAX))
    return codes.flatten(-2), scale


def dequantize_fp8(
    codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of `quantize_fp8`: e4m3 codes [..., N] × scales [..., N/block] -> `dtype`."""
    block = codes.size(-1) // scale.size(-1)
    y = codes.float().unflatten(-1, (-1, block)) * scale.float().unsqueeze(-1)
    return y.flatten(-2).to(dtype)


def dequantize_fp4(
    codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of `quantize_fp4_e4m3` and `quantize_mxfp4` (both are E2M1 codes × fp32 scales)."""
    return _scaled(e2m1_values(codes), scale, dtype)


def dequantize_packed_fp4(
    packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """`dequantize_fp4(unpack_e2m1(packed), scale, dtype)`, reading the packed bytes directly."""
    return _scaled(e2m1_byte_values(packed), scale, dtype)


def _scaled(values: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    block = values.size(-1) // scale.size(-1)
    y = values.unflatten(-1, (-1, block)) * scale.float().unsqueeze(-1)
    return y.flatten(-2).to(dtype)


# ------------------------------------------------------------------------------------------------
# fake quant (QDQ) with straight-through gradients


def _qdq_fp8(x: torch.Tensor, block: int) -> torch.Tensor:
    xg = _groups(x, block)
    scale = fast_round_scale(xg.abs().amax(dim=-1).clamp_min(FP8_AMAX_FLOOR), 1 / FP8_MAX).unsqueeze(-1)
    return (round_e4m3(xg / scale) * scale).flatten(-2).to(x.dtype)


def _qdq_fp4_e4m3(x: torch.Tensor, block: int) -> torch.Tensor:
    xg = _groups(x, block)
    scale = round_e4m3(xg.abs().amax(dim=-1).clamp_min(FP4_E4M3_AMAX_FLOOR) / FP4_MAX).unsqueeze(-1)
    return (round_e2m1(xg / scale) * scale).flatten(-2).to(x.dtype)


def _qdq_mxfp4(x: torch.Tensor, block: int) -> torch.Tensor:
    xg = _groups(x, block)
    scale = fast_round_scale(xg.abs().amax(dim=-1).clamp_min(MXFP4_AMAX_FLOOR), 1 / FP4_MAX).unsqueeze(-1)
    return (round_e2m1(xg / scale) * scale).flatten(-2).to(x.dtype)


class _StraightThrough(torch.autograd.Function):
    """Forward: the exact QDQ value. Backward: identity (straight-through estimator).

    A custom Function rather than `x + (q - x).detach()`, because that sum is rounded in x's dtype
    and would not reproduce q bit-exactly in bf16.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, qdq: QDQ, block: int):
        return qdq(x, block)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None, None


def _fake_quant(x: torch.Tensor, qdq: QDQ, block: int) -> torch.Tensor:
    if x.requires_grad and torch.is_grad_enabled():
        return _StraightThrough.apply(x, qdq, block)
    return qdq(x, block)


def fp8_fake_quant(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """FP8 e4m3 QDQ with a UE8M0 scale per `block` along the last dim (window KV, Linear inputs)."""
    return _fake_quant(x, _qdq_fp8, block)


def fp4_e4m3_fake_quant(x: torch.Tensor, block: int = 16) -> torch.Tensor:
    """E2M1 QDQ with an E4M3 scale per `block` (compressed main KV, post-RoPE)."""
    return _fake_quant(x, _qdq_fp4_e4m3, block)


def mxfp4_fake_quant(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """E2M1 QDQ with a UE8M0 scale per `block` (indexer q and k, post-RoPE)."""
    return _fake_quant(x, _qdq_mxfp4, block)
