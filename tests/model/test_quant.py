"""Bit-exactness of the FP8/FP4 simulations against hand-written references (spec §3.10)."""

import math

import pytest
import torch

from model.quant import (
    E2M1_GRID,
    dequantize_fp4,
    dequantize_fp8,
    e2m1_codes,
    e2m1_values,
    fast_round_scale,
    fp4_e4m3_fake_quant,
    fp8_fake_quant,
    mxfp4_fake_quant,
    pack_e2m1,
    quantize_fp4_e4m3,
    quantize_fp8,
    quantize_mxfp4,
    round_e2m1,
    round_e4m3,
    unpack_e2m1,
)


def _e4m3_positive_values() -> list[tuple[float, int]]:
    """Every finite non-negative e4m3fn value with its code (0x7F is NaN)."""
    out = []
    for code in range(0x7F):
        exp, man = code >> 3, code & 7
        val = man * 2.0**-9 if exp == 0 else (1 + man / 8) * 2.0 ** (exp - 7)
        out.append((val, code))
    return out


def _ref_round_e4m3(x: float) -> float:
    """Nearest e4m3fn, ties to the even code, saturating at 448 (pure Python)."""
    mag = min(abs(x), 448.0)
    best = min(_e4m3_positive_values(), key=lambda vc: (abs(vc[0] - mag), vc[1] & 1))
    return math.copysign(best[0], x)


def _ref_round_e2m1(x: float) -> float:
    mag = min(abs(x), 6.0)
    code = min(range(8), key=lambda c: (abs(E2M1_GRID[c] - mag), c & 1))
    return math.copysign(E2M1_GRID[code], x)


# ---- element formats ---------------------------------------------------------------------------

TIES = [(0.25, 0.0), (0.75, 1.0), (1.25, 1.0), (1.75, 2.0), (2.5, 2.0), (3.5, 4.0), (5.0, 4.0)]


@pytest.mark.parametrize("x,expected", TIES)
def test_e2m1_ties_round_to_even(x, expected):
    t = torch.tensor([x, -x])
    assert round_e2m1(t).tolist() == [expected, -expected]
    assert e2m1_values(e2m1_codes(t)).tolist() == [expected, -expected]


def test_e2m1_matches_reference_on_grid_neighbourhood_and_clamps():
    vals = [v for g in E2M1_GRID for v in (g, g + 1e-3, g - 1e-3)]
    vals += [0.26, 2.49, 2.51, 4.99, 5.01, 6.5, 100.0]
    t = torch.tensor(vals + [-v for v in vals])
    expected = torch.tensor([_ref_round_e2m1(v) for v in t.tolist()])
    assert torch.equal(round_e2m1(t), expected)
    assert torch.equal(e2m1_values(e2m1_codes(t.clamp(-6, 6))), expected)
    assert round_e2m1(torch.tensor([7.0, -1e9])).tolist() == [6.0, -6.0]


def test_e2m1_codes_are_official_encoding():
    # code = sign<<3 | index into the magnitude grid; negatives have bit 3 set
    grid = torch.tensor(E2M1_GRID)
    assert e2m1_codes(grid).tolist() == list(range(8))
    assert e2m1_codes(-grid[1:]).tolist() == list(range(9, 16))


def test_e4m3_matches_reference_including_ties_and_saturation():
    pos = sorted(v for v, _ in _e4m3_positive_values())
    mids = [(a + b) / 2 for a, b in zip(pos, pos[1:])]  # every tie, subnormal ones included
    rnd = torch.randn(2000, generator=torch.Generator().manual_seed(0)) * 50
    xs = pos + mids + rnd.tolist() + [449.0, 463.9, 464.0, 500.0, 1e6]
    t = torch.tensor(xs + [-x for x in xs], dtype=torch.float32)
    expected = torch.tensor([_ref_round_e4m3(v) for v in t.tolist()])
    assert torch.equal(round_e4m3(t), expected)
    # spot-checks of the rule itself
    spots = torch.tensor([1 + 1 / 16, 1 + 3 / 16, 2.0**-10, 3 * 2.0**-10, 1e6])
    assert round_e4m3(spots).tolist() == [1.0, 1.25, 0.0, 2.0**-8, 448.0]


# ---- scales ------------------------------------------------------------------------------------


def test_fast_round_scale_powers_of_two_unchanged_and_rounds_up():
    amax = torch.tensor([448.0, 448.0 * 2**-10, 448.0 * 3, 449.0, 447.0])
    s = fast_round_scale(amax, 1 / 448)
    # 448 * fp32(1/448) is exactly 1 only if the reciprocal rounding lands there; check the rule itself
    x = (amax * torch.tensor(1 / 448, dtype=torch.float32)).tolist()
    assert s.tolist() == [2.0 ** math.ceil(math.log2(v)) for v in x]
    pow2 = torch.tensor([2.0**k for k in range(-120, 120, 7)])
    assert torch.equal(fast_round_scale(pow2, 1.0), pow2)
    just_above = pow2 * (1 + 2**-23)
    assert torch.equal(fast_round_scale(just_above, 1.0), pow2 * 2)


def test_scale_floors():
    zeros = torch.zeros(1, 32)
    _, s8 = quantize_fp8(zeros)
    assert s8.item() == fast_round_scale(torch.tensor(1e-4), 1 / 448).item()
    _, s4 = quantize_fp4_e4m3(torch.zeros(1, 16))
    assert s4.item() == 2.0**-9  # e4m3(6·2^-9 / 6)
    _, smx = quantize_mxfp4(torch.zeros(1, 32))
    assert smx.item() == fast_round_scale(torch.tensor(6 * 2.0**-126), 1 / 6).item()
    assert smx.item() > 0
    # all-zero groups dequantise to zero rather than NaN
    for fq in (fp8_fake_quant, mxfp4_fake_quant):
        assert torch.equal(fq(torch.zeros(2, 32)), torch.zeros(2, 32))
    assert torch.equal(fp4_e4m3_fake_quant(torch.zeros(2, 16)), torch.zeros(2, 16))


def test_e4m3_scale_is_rounded_and_values_clamped():
    # amax = 6·1.05 -> scale e4m3(1.05) = 1.0 < 1.05, so the amax element divides to 6.3 and clamps
    x = torch.zeros(16)
    x[0], x[1] = 6 * 1.05, -2.2
    codes, s = quantize_fp4_e4m3(x.unsqueeze(0))
    assert s.item() == 1.0
    assert dequantize_fp4(codes, s)[0, :2].tolist() == [6.0, -2.0]


# ---- fake quant vs quantize/dequantize -----------------------------------------------------------

FORMATS = [
    (fp8_fake_quant, quantize_fp8, dequantize_fp8, 32),
    (fp4_e4m3_fake_quant, quantize_fp4_e4m3, dequantize_fp4, 16),
    (mxfp4_fake_quant, quantize_mxfp4, dequantize_fp4, 32),
]


def _sample(dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 5, 128, generator=g) * torch.logspace(-6, 3, 128)  # many magnitudes per row
    x[0, 0, :32] = 0  # an all-zero group
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fake,quant,dequant,block", FORMATS)
def test_fake_quant_equals_dequant_of_packed_quant(fake, quant, dequant, block, dtype):
    x = _sample(dtype)
    y = fake(x, block)
    assert y.dtype == dtype and y.shape == x.shape
    codes, scale = quant(x, block)
    assert scale.shape == (*x.shape[:-1], x.size(-1) // block)
    if codes.dtype == torch.uint8:  # FP4: go through the byte packing the cache uses
        packed = pack_e2m1(codes)
        assert packed.shape[-1] == x.size(-1) // 2
        codes = unpack_e2m1(packed)
    assert torch.equal(dequant(codes, scale, dtype), y)


@pytest.mark.parametrize("fake,quant,dequant,block", FORMATS)
def test_fake_quant_is_idempotent_and_close(fake, quant, dequant, block):
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(2))
    y = fake(x, block)
    assert torch.equal(fake(y, block), y)
    rel = ((y - x).norm() / x.norm()).item()
    assert rel < (0.05 if fake is fp8_fake_quant else 0.2)
    assert rel > 0  # it does quantise


def test_fake_quant_matches_elementwise_reference():
    # fp32 input so that the reference sees the same x; one group per row, scale from the rules
    x = torch.randn(6, 32, generator=torch.Generator().manual_seed(3)) * 3
    amax = x.abs().amax(-1).tolist()
    y8, y4 = fp8_fake_quant(x).tolist(), mxfp4_fake_quant(x).tolist()
    for r in range(6):
        s8 = fast_round_scale(torch.tensor(amax[r]), 1 / 448).item()
        s4 = fast_round_scale(torch.tensor(amax[r]), 1 / 6).item()
        for c in range(32):
            v = x[r, c].item()
            assert y8[r][c] == _ref_round_e4m3(v / s8) * s8
            assert y4[r][c] == _ref_round_e2m1(v / s4) * s4


def test_straight_through_gradient_is_identity():
    for fake, _, _, block in FORMATS:
        x = torch.randn(2, 64, dtype=torch.bfloat16, requires_grad=True)
        g = torch.randn(2, 64, dtype=torch.bfloat16)
        (fake(x, block) * g).sum().backward()
        assert torch.equal(x.grad, g)


def test_pack_unpack_round_trip_and_nibble_order():
    codes = torch.randint(0, 16, (7, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(4))
    packed = pack_e2m1(codes)
    assert packed.dtype == torch.uint8 and packed.shape == (7, 32)
    assert torch.equal(unpack_e2m1(packed), codes)
    assert pack_e2m1(torch.tensor([0x3, 0xA], dtype=torch.uint8)).item() == 0xA3  # even -> low nibble
    assert torch.equal(unpack_e2m1(packed.view(torch.float4_e2m1fn_x2)), codes)


def test_block_must_divide_last_dim():
    with pytest.raises(AssertionError):
        fp8_fake_quant(torch.randn(4, 48))


def test_byte_values_equal_the_nibble_values_for_every_byte():
    """e2m1_byte_values (one lookup per packed byte, what packed caches decode with) equals splitting
    the nibbles and looking each code up, for all 256 bytes; dequantize_packed_fp4 equals dequantize_fp4."""
    from model.quant import dequantize_packed_fp4, e2m1_byte_values, e2m1_values, unpack_e2m1

    every = torch.arange(256, dtype=torch.uint8).view(8, 32)
    assert torch.equal(e2m1_byte_values(every), e2m1_values(unpack_e2m1(every)))
    scale = torch.rand(8, 4) + 0.5  # one scale per 16 values
    assert torch.equal(dequantize_packed_fp4(every, scale, torch.bfloat16),
                       dequantize_fp4(unpack_e2m1(every), scale, torch.bfloat16))  # fmt: skip
