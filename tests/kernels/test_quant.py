"""Bit-exact parity of the Triton quantisers (kernels/quant.py) with the torch references (model/quant.py).

On a CPU-only machine the kernels run under TRITON_INTERPRET=1 (set in tests/kernels/conftest.py);
with a GPU the `gpu`-marked variants run compiled on CUDA (`pytest -m gpu`).
"""

import pytest
import torch

from kernels import quant as kq

FAKE = {
    "fp8": (kq.fp8_fake_quant, kq.fp8_fake_quant_ref, 32),
    "fp4_e4m3": (kq.fp4_e4m3_fake_quant, kq.fp4_e4m3_fake_quant_ref, 16),
    "mxfp4": (kq.mxfp4_fake_quant, kq.mxfp4_fake_quant_ref, 32),
}
PACK = {
    "fp8": (kq.FMT_FP8, kq.quantize_fp8_packed, kq.quantize_fp8_ref, 32),
    "fp4_e4m3": (kq.FMT_FP4_E4M3, kq.quantize_fp4_e4m3_packed, kq.quantize_fp4_e4m3_ref, 16),
    "mxfp4": (kq.FMT_MXFP4, kq.quantize_mxfp4_packed, kq.quantize_mxfp4_ref, 32),
}


def _wide_range(shape, dtype, device, seed=0) -> torch.Tensor:
    """Gaussian rows spanning 1e-30 .. 1e4 in magnitude, some all-zero and some tiny groups."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    rows = x.view(-1, shape[-1])
    rows *= torch.logspace(-30, 4, rows.size(0))[:, None]
    rows[0] = 0.0
    if rows.size(0) > 2:
        rows[1, : shape[-1] // 2] = -0.0
    return x.to(dtype).to(device)


def _ties(block: int, fmt: str, device) -> torch.Tensor:
    """Groups whose elements sit exactly on rounding ties (and sub-normal e4m3 ties) of each format."""
    if fmt == "fp8":
        # scale 1 (amax 448): midpoints between e4m3 neighbours, normal and subnormal
        vals = [448.0, 1.0625, 1.1875, -1.0625, 3.0 * 2**-10, 2**-10, -(2**-10), 5 * 2**-10, 240.0 + 8]
        vals += [2**-6 - 2**-10, 0.0, -0.0, 17.0, 19.0, 2**-7 * 1.0625, 2**-7 * 1.1875]
    else:
        # amax 6 -> scale 1 for both FP4 formats; the E2M1 ties and their negatives
        vals = [
            6.0,
            0.25,
            0.75,
            1.25,
            1.75,
            2.5,
            3.5,
            5.0,
            -0.25,
            -0.75,
            -1.25,
            -1.75,
            -2.5,
            -3.5,
            -5.0,
            -0.0,
        ]
    vals = (vals * block)[:block]
    base = torch.tensor(vals, dtype=torch.float32)
    # the same pattern at several power-of-two magnitudes (scale moves, ties stay ties)
    groups = [base * 2.0**k for k in (-20, -8, -3, 0, 5, 17)]
    return torch.stack(groups).to(torch.bfloat16).to(device)


@pytest.mark.parametrize("fmt", list(FAKE))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(3, 64), (2, 5, 96), (257, 32)])
def test_fake_quant_bit_exact(device, fmt, dtype, shape):
    tri, ref, _ = FAKE[fmt]
    if dtype == torch.float16:
        x = _wide_range(shape, torch.float32, device).clamp(-6e4, 6e4).to(dtype)
    else:
        x = _wide_range(shape, dtype, device)
    y = tri(x)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert torch.equal(y, ref(x))


@pytest.mark.parametrize("fmt", list(FAKE))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fake_quant_both_kernels_16bit(device, fmt, dtype, monkeypatch):
    """16-bit inputs through the tile kernel and through the per-group one."""
    monkeypatch.setitem(kq.CONFIG, "groups", True)
    monkeypatch.setitem(kq.CONFIG, "qdq_groups", {fmt_: {"rows": 32, "num_warps": 4} for fmt_ in range(3)})
    tri, ref, _ = FAKE[fmt]
    x = _wide_range((65, 64), torch.float32, device).clamp(-6e4, 6e4).to(dtype)
    assert torch.equal(tri(x), ref(x))
    monkeypatch.setitem(kq.CONFIG, "groups", False)
    tri, ref, _ = FAKE[fmt]
    x = _wide_range((65, 64), torch.float32, device).clamp(-6e4, 6e4).to(dtype)
    assert torch.equal(tri(x), ref(x))


@pytest.mark.parametrize("fmt", list(FAKE))
def test_fake_quant_ties(device, fmt):
    tri, ref, block = FAKE[fmt]
    x = _ties(block, fmt, device)
    assert torch.equal(tri(x), ref(x))


@pytest.mark.parametrize("fmt", list(FAKE))
def test_fake_quant_all_bf16_values(device, fmt):
    """Every finite bf16 bit pattern, shuffled into groups (covers all exponent/mantissa corners)."""
    tri, ref, block = FAKE[fmt]
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    x = bits.view(torch.bfloat16)
    x = x[torch.isfinite(x)]
    x = x[torch.randperm(x.numel(), generator=torch.Generator().manual_seed(1))]
    x = x[: x.numel() // block * block].view(-1, block).to(device)
    assert torch.equal(tri(x), ref(x))


def test_fake_quant_straight_through(device):
    x = _wide_range((4, 64), torch.bfloat16, device).requires_grad_()
    g = torch.randn(4, 64, dtype=torch.bfloat16, device=device)
    for tri, ref, _ in FAKE.values():
        y = tri(x)
        assert torch.equal(y, ref(x.detach()))
        (gx,) = torch.autograd.grad(y, x, g)
        assert torch.equal(gx, g)


@pytest.mark.parametrize("fmt", list(PACK))
@pytest.mark.parametrize(
    "shape,path,dtype",
    [
        ((4, 64), "split", torch.bfloat16),
        ((3, 2, 128), "strided", torch.bfloat16),
        ((129, 32), "pairs", torch.bfloat16),
        ((5, 64), "pairs", torch.float16),
        ((3, 96), "pairs", torch.float32),
        ((6, 32), "strided", torch.float16),
        ((131, 64), "groups", torch.bfloat16),
        ((5, 96), "groups", torch.float16),
        ((131, 64), "groups2", torch.bfloat16),
        ((5, 96), "groups2", torch.float16),
    ],
)
def test_quantize_pack_bit_exact(device, fmt, shape, path, dtype, monkeypatch):
    # every fp4 pack path: one load + tl.split, stride-2 loads, (even, odd) pairs as one word, one
    # thread per group (16-bit inputs; also the unpack and fake-quant kernels of that layout)
    monkeypatch.setitem(kq.CONFIG, "strided", path == "strided")
    monkeypatch.setitem(kq.CONFIG, "pairs", path == "pairs")
    monkeypatch.setitem(kq.CONFIG, "groups", path in ("groups", "groups2"))
    # several programs, a partial last one; groups2: E4M3/16 packs two groups per thread
    tile = {"rows": 64, "num_warps": 4, "two": path == "groups2"}
    for kern in ("qdq_groups", "pack_groups", "unpack_groups"):
        monkeypatch.setitem(kq.CONFIG, kern, {f: tile for f in (kq.FMT_FP8, kq.FMT_FP4_E4M3, kq.FMT_MXFP4)})
    code, tri, ref, block = PACK[fmt]
    if dtype == torch.float16:
        x = _wide_range(shape, torch.float32, device).clamp(-6e4, 6e4).to(dtype)
    else:
        x = _wide_range(shape, dtype, device)
    q, s = tri(x)
    rq, rs = ref(x)
    assert s.dtype == torch.uint8 and s.shape == rs.shape
    assert torch.equal(kq.scale_bytes_to_float(s, code), rs)
    if code == kq.FMT_FP8:
        assert torch.equal(q, rq.view(torch.uint8))
        y_ref = kq.dequantize_fp8_ref(rq, rs, torch.bfloat16)
        y = kq.dequantize_fp8_packed(q, s)
    else:
        assert q.shape == (*shape[:-1], shape[-1] // 2)
        assert torch.equal(q, kq.pack_e2m1_ref(rq))
        assert torch.equal(kq.unpack_e2m1_ref(q), rq)
        y_ref = kq.dequantize_fp4_ref(rq, rs, torch.bfloat16)
        y = kq.dequantize_fp4_packed(q, s, "e4m3" if code == kq.FMT_FP4_E4M3 else "ue8m0")
    assert torch.equal(y, y_ref)
    # the packed round trip is the fake quant, bit for bit
    assert torch.equal(y, FAKE[fmt][1](x).to(torch.bfloat16))


@pytest.mark.parametrize("fmt", list(PACK))
def test_quantize_pack_ties(device, fmt):
    code, tri, ref, block = PACK[fmt]
    x = _ties(block, fmt, device)
    q, s = tri(x)
    rq, rs = ref(x)
    assert torch.equal(kq.scale_bytes_to_float(s, code), rs)
    assert torch.equal(q, rq.view(torch.uint8) if code == kq.FMT_FP8 else kq.pack_e2m1_ref(rq))


def test_scale_byte_layout(device):
    """Stored scale bytes are the e4m3fn bit pattern / the UE8M0 biased exponent."""
    x = torch.full((1, 32), 3.0, dtype=torch.bfloat16, device=device)
    _, s8 = kq.quantize_fp8_packed(x)  # amax 3 -> 3/448 -> 2^-7 -> byte 120
    assert s8.tolist() == [[120]]
    _, s4 = kq.quantize_fp4_e4m3_packed(x)  # 3/6 = 0.5 -> e4m3 0x30
    assert s4.tolist() == [[0x30, 0x30]]
    q, smx = kq.quantize_mxfp4_packed(x)  # 3/6 -> 2^-1 -> byte 126; 3/0.5 = 6 -> code 7 -> 0x77
    assert smx.tolist() == [[126]] and q.unique().tolist() == [0x77]


def test_launchers_reject_bad_inputs(device):
    x = torch.randn(4, 64, device=device, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="contiguous"):
        kq.quantize_fp4_e4m3_packed(x.t())
    with pytest.raises(ValueError, match="blocks are 16"):
        kq.quantize_fp8_packed(x, block=8)
    with pytest.raises(ValueError, match="bf16 / fp16 / fp32"):
        kq.fp8_fake_quant(x.to(torch.int32))
    with pytest.raises(ValueError, match="multiple of the block 32"):
        kq.quantize_mxfp4_packed(x[:, :48].contiguous())
    q, s = kq.quantize_fp4_e4m3_packed(x)
    with pytest.raises(ValueError, match="blocks of 16 or 32"):
        kq.dequantize_fp4_packed(q, s[:, :3].contiguous(), "e4m3")
    with pytest.raises(ValueError, match="scale_fmt"):
        kq.dequantize_fp4_packed(q, s, "e8m0")


@pytest.mark.parametrize("path", ["pairs", "groups"])
def test_fp4_e4m3_pack_block32(device, path, monkeypatch):
    """E4M3 scales over groups of 32 (not the default 16): the per-group kernel clamps all four 16-byte
    chunks to 6·s; the rows reach subnormal scales, where x/s runs far past 6."""
    monkeypatch.setitem(kq.CONFIG, "pairs", path == "pairs")
    monkeypatch.setitem(kq.CONFIG, "groups", path == "groups")
    x = _wide_range((67, 64), torch.bfloat16, device)
    q, s = kq.quantize_fp4_e4m3_packed(x, block=32)
    rq, rs = kq.quantize_fp4_e4m3_ref(x, 32)
    assert torch.equal(kq.scale_bytes_to_float(s, kq.FMT_FP4_E4M3), rs)
    assert torch.equal(q, kq.pack_e2m1_ref(rq))


@pytest.mark.parametrize("fmt", ["fp4_e4m3", "mxfp4"])
def test_quantize_pack_all_bf16_values(device, fmt):
    """Every finite bf16 bit pattern through the FP4 pack (the reciprocal + snap path of E4M3/16)."""
    code, tri, ref, block = PACK[fmt]
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    x = bits.view(torch.bfloat16)
    x = x[torch.isfinite(x)]
    x = x[torch.randperm(x.numel(), generator=torch.Generator().manual_seed(2))]
    x = x[: x.numel() // block * block].view(-1, block).to(device)
    q, s = tri(x)
    rq, rs = ref(x)
    assert torch.equal(kq.scale_bytes_to_float(s, code), rs)
    assert torch.equal(q, kq.pack_e2m1_ref(rq))


def _e4m3_scale_ties(device) -> torch.Tensor:
    """For every normal E4M3 scale s in range: a group of 16 with amax 6·s (so the scale is s) holding
    t·s for every E2M1 tie t (±): x/s lands exactly on the tie, which x·fl(1/s) may miss by an ulp."""
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    rows = []
    for code in range(0x08, 0x7F):  # e4m3fn normals
        s = torch.tensor(code, dtype=torch.uint8).view(torch.float8_e4m3fn).float().item()
        vals = [6.0 * s] + [t * s for t in ties] + [-t * s for t in ties] + [0.5 * s]
        rows.append(vals)
    x = torch.tensor(rows, dtype=torch.float32)
    return x[(x.abs().amax(1) < 3e38)].to(torch.bfloat16).to(device)


def test_fp4_e4m3_exact_ties_under_non_power_of_two_scales(device):
    x = _e4m3_scale_ties(device)
    assert torch.equal(kq.fp4_e4m3_fake_quant(x), kq.fp4_e4m3_fake_quant_ref(x))
    q, s = kq.quantize_fp4_e4m3_packed(x)
    rq, rs = kq.quantize_fp4_e4m3_ref(x)
    assert torch.equal(q, kq.pack_e2m1_ref(rq))


def _tie_neighbours(fmt: str, dtype: torch.dtype, device, n_groups: int = 512, seed: int = 3) -> torch.Tensor:
    """Random groups whose elements sit on, or one ulp (of `dtype`) either side of, t·s for every E2M1
    grid value and tie t, with the group's scale s random (amax 6·s pins it) and random signs and zeros."""
    g = torch.Generator().manual_seed(seed)
    block = 16 if fmt == "fp4_e4m3" else 32
    if fmt == "fp4_e4m3":  # every e4m3 scale whose 6·s and t·s stay finite and normal enough in dtype
        codes = torch.arange(1, 0x7F, dtype=torch.int32).to(torch.uint8)
        scales = codes.view(torch.float8_e4m3fn).float()
    else:
        scales = 2.0 ** torch.arange(-120, 120, dtype=torch.float32)
    if dtype == torch.float16:
        scales = scales[(scales >= 2.0**-10) & (scales <= 4096.0)]
    s = scales[torch.randint(scales.numel(), (n_groups,), generator=g)]
    t = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0])
    vals = t[torch.randint(t.numel(), (n_groups, block), generator=g)] * s[:, None]
    vals[:, 0] = 6.0 * s
    x = vals.to(dtype)
    step = torch.randint(-1, 2, (n_groups, block), generator=g, dtype=torch.int16)
    step[:, 0] = 0
    bits = x.view(torch.int16)
    x = torch.where((x != 0) & (step != 0), (bits + step).view(dtype), x)
    sign = torch.randint(0, 2, (n_groups, block), generator=g).bool()
    return torch.where(sign, -x, x).to(device)


@pytest.mark.parametrize("fmt", ["fp4_e4m3", "mxfp4"])
@pytest.mark.parametrize("path", ["pairs", "groups", "groups2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp4_pack_paths_all_values_and_ties(device, fmt, path, dtype, monkeypatch):
    """The 16-bit FP4 pack kernels on every finite bit pattern of the dtype, on values at and one ulp
    around every t·s (t a grid value or tie, s the group scale), and on the E4M3 scale-tie groups
    (groups2: two groups per thread, rows of two groups)."""
    if path == "groups2" and fmt == "mxfp4":
        pytest.skip("two groups per thread is an E4M3/16 layout")
    monkeypatch.setitem(kq.CONFIG, "pairs", path == "pairs")
    monkeypatch.setitem(kq.CONFIG, "groups", path != "pairs")
    tile = {"rows": 64, "num_warps": 4, "two": path == "groups2"}
    monkeypatch.setitem(kq.CONFIG, "pack_groups", {kq.FMT_FP4_E4M3: tile, kq.FMT_MXFP4: tile})
    code, tri, ref, block = PACK[fmt]
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    x = bits.view(dtype)
    x = x[torch.isfinite(x)]
    x = x[torch.randperm(x.numel(), generator=torch.Generator().manual_seed(4))]
    inputs = [x[: x.numel() // block * block].view(-1, block).to(device), _tie_neighbours(fmt, dtype, device)]
    if fmt == "fp4_e4m3" and dtype == torch.bfloat16:
        inputs.append(_e4m3_scale_ties(device))
    for x in inputs:
        if path == "groups2":  # an even number of groups: the last repeated if needed
            x = torch.cat([x, x[-1:]])[: x.shape[0] + x.shape[0] % 2].reshape(-1, 2 * block)
        q, s = tri(x)
        rq, rs = ref(x)
        assert torch.equal(kq.scale_bytes_to_float(s, code), rs)
        assert torch.equal(q, kq.pack_e2m1_ref(rq))
