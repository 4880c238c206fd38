"""Benchmark of the Triton kernels against their torch references, one JSON line per measurement.

    python bench/kernels.py [--quick] [--no-compile] [--eager-launch] [--only quant,mhc,mhc_decode,attn,moe,step]

For each kernel, in one process on one GPU: Triton time (best of a small tile sweep), the torch
reference eager and under `torch.compile`, achieved GB/s (bytes the op must move) or TFLOP/s, and
the fraction of the H200 peaks (4.8 TB/s HBM nominal, ~790 TFLOP/s dense bf16 measured) and of the
device-to-device copy bandwidth measured here. Times are device times (bench/device_timing.py):
each call is captured in a CUDA graph and its replays timed with L2 flushed before each
(`--eager-launch`: as launched from Python, which for decode-sized calls measures the host); the
quantize/pack and decode targets are also timed in steady state, back to back over rotating buffers
(`quantize_steady_state`, `sparse_attn_decode_steady_state`, `sparse_attn_decode_bounds_steady_state`
lines), which a single call after a zero-fill flush under-reports at these sizes (see device_timing.py).
Needs CUDA; it is not a test and checks nothing beyond a quick max-error line per kernel (the parity
tests are tests/kernels/).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.device_timing import OPTS, bench_ms, compare, emit, rates, stream_copy_ms, stream_ms, timing_floor  # noqa: E402
from bench.kernels_moe import bench_moe  # noqa: E402


def copy_bandwidth() -> float:
    x = torch.empty(2 * 1024**3 // 2, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    ms = bench_ms(lambda: y.copy_(x), graph=False)
    bw = 2 * x.numel() * 2 / (ms * 1e-3)
    emit({"kernel": "d2d_copy", "bytes": 2 * x.numel() * 2, **rates(ms, 2 * x.numel() * 2)})
    return bw


# ------------------------------------------------------------------------------------------------


def _pack_ref(quantize, fmt):
    """Torch reference for quantise+pack: the model/quant.py quantiser, nibble packing, scale bytes."""
    from kernels import quant as kq

    def fn(x):
        codes, s = quantize(x)
        if fmt == kq.FMT_FP8:
            return codes.view(torch.uint8), (s.view(torch.int32) >> 23).to(torch.uint8)
        if fmt == kq.FMT_FP4_E4M3:
            return kq.pack_e2m1_ref(codes), s.to(torch.float8_e4m3fn).view(torch.uint8)
        return kq.pack_e2m1_ref(codes), (s.view(torch.int32) >> 23).to(torch.uint8)

    return fn


def _pack_bytes(n: int, fmt: int, block: int) -> int:
    """Bytes a quantise+pack of n 16-bit values moves: the input, the codes (1 byte per value for FP8,
    a nibble for FP4) and one scale byte per block."""
    from kernels import quant as kq

    return 2 * n + (n if fmt == kq.FMT_FP8 else n // 2) + n // block


def _bench_quant_format(x, name, tri, ref, fmt, block, copy_bw):
    from kernels import quant as kq

    n, shape = x.numel(), tuple(x.shape)
    # one-thread-per-group kernels (16-bit inputs) and, for comparison, the earlier tile kernels
    tiles = ((128, 4), (256, 4), (256, 8), (512, 8))
    grp = lambda kern: [{"groups": True, kern: {fmt: {"rows": r, "num_warps": w}}} for r, w in tiles]
    qdq_cfgs = grp("qdq_groups") + [{"groups": False, "rows": r, "num_warps": w} for r, w in ((128, 4), (256, 8))]
    # (each swept config replaces its kernel's whole format -> tile map; `default` restores it)
    pack_tiles = ((32, 1), (64, 2), (128, 2), (128, 4), (256, 4), (256, 8))  # small tiles won on the H200
    pack_cfgs = [{"groups": True, "pack_groups": {fmt: {"rows": r, "num_warps": w}}} for r, w in pack_tiles] + [
        {"groups": False, "pairs": True, "rows_pairs": r, "num_warps": 4} for r in (128, 256)
    ]
    if fmt == kq.FMT_FP4_E4M3:  # two groups per thread (MXFP4/32's access pattern)
        two = ((32, 1), (64, 2), (64, 4), (128, 4), (256, 8))
        pack_cfgs += [{"groups": True, "pack_groups": {fmt: {"rows": r, "num_warps": w, "two": True}}} for r, w in two]
    if fmt == kq.FMT_FP8:  # no FP8 groups pack kernel: the tile kernel is the one timed
        pack_cfgs = [{"rows": r, "num_warps": w} for r, w in ((128, 4), (256, 4), (256, 8))]
    default = dict(kq.CONFIG)

    def sweep_of(fn, cfgs):
        def run(cfg):
            kq.CONFIG.update(cfg)
            return fn()

        return [(cfg, lambda cfg=cfg: run(cfg)) for cfg in cfgs]

    y_ref = ref(x)
    qdq_sweep = sweep_of(lambda: tri(x), qdq_cfgs)
    compare(f"fake_quant_{name}", None, lambda: ref(x), 4 * n, None, copy_bw, qdq_sweep,
             check=lambda y: torch.equal(y, y_ref), rounds=2, shape=shape)  # fmt: skip
    kq.CONFIG.update(default)

    q_tri = {kq.FMT_FP8: kq.quantize_fp8_packed, kq.FMT_FP4_E4M3: kq.quantize_fp4_e4m3_packed}.get(
        fmt, kq.quantize_mxfp4_packed
    )
    q_ref = _pack_ref(
        {kq.FMT_FP8: kq.quantize_fp8_ref, kq.FMT_FP4_E4M3: kq.quantize_fp4_e4m3_ref}.get(fmt, kq.quantize_mxfp4_ref),
        fmt,
    )
    qr, sr = q_ref(x)
    nbytes = _pack_bytes(n, fmt, block)
    pack_sweep = sweep_of(lambda: q_tri(x), pack_cfgs)
    compare(f"quantize_pack_{name}", None, lambda: q_ref(x), nbytes, None, copy_bw, pack_sweep,
             check=lambda o: torch.equal(o[0], qr) and torch.equal(o[1], sr), rounds=2, shape=shape)  # fmt: skip
    kq.CONFIG.update(default)

    qt, st = q_tri(x)
    sf = kq.scale_bytes_to_float(sr, fmt)
    if fmt == kq.FMT_FP8:
        deq = lambda: kq.dequantize_fp8_packed(qt, st)
        deq_ref = lambda: kq.dequantize_fp8_ref(qr.view(torch.float8_e4m3fn), sf, torch.bfloat16)
    else:
        sfmt = "e4m3" if fmt == kq.FMT_FP4_E4M3 else "ue8m0"
        deq = lambda: kq.dequantize_fp4_packed(qt, st, sfmt)
        deq_ref = lambda: kq.dequantize_fp4_ref(kq.unpack_e2m1_ref(qr), sf, torch.bfloat16)
    deq_cfgs = [{"groups": False, "rows_dequant": 64}, {"groups": False, "rows_dequant": 128}]
    if fmt != kq.FMT_FP8:
        deq_cfgs = grp("unpack_groups") + deq_cfgs
    compare(f"dequantize_unpack_{name}", None, deq_ref, nbytes, None, copy_bw, sweep_of(deq, deq_cfgs),
             check=lambda y: torch.equal(y, y_ref), rounds=2, shape=shape)  # fmt: skip
    kq.CONFIG.update(default)


def bench_quant(copy_bw: float, quick: bool) -> None:
    from kernels import quant as kq

    shapes = [(16384, 4096)]  # 128 MiB of bf16
    for shape in shapes:
        x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        for name, tri, ref, fmt, block in [
            ("fp8", kq.fp8_fake_quant, kq.fp8_fake_quant_ref, kq.FMT_FP8, 32),
            ("fp4_e4m3", kq.fp4_e4m3_fake_quant, kq.fp4_e4m3_fake_quant_ref, kq.FMT_FP4_E4M3, 16),
            ("mxfp4", kq.mxfp4_fake_quant, kq.mxfp4_fake_quant_ref, kq.FMT_MXFP4, 32),
        ]:
            _bench_quant_format(x, name, tri, ref, fmt, block, copy_bw)
        del x
        torch.cuda.empty_cache()
    _quant_steady_state(quick)


def _quant_steady_state(quick: bool) -> None:
    """The packs and fake quants in steady state (bench/device_timing.py's stream_ms: back-to-back
    calls over four input tensors, >= 256 MiB together) at 64 and 128 MiB of bf16 (and 512 MiB
    without --quick), beside a copy kernel moving the E4M3/16 pack's bytes: the figures the
    75%-of-HBM target is read from (one call after a zero-fill flush under-reports ops this small)."""
    from kernels import quant as kq

    for mib in (64, 128) if quick else (64, 128, 512):
        n = mib * 2**20 // 2
        xs = [torch.randn(n // 4096, 4096, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
        e4m3_bytes = _pack_bytes(n, kq.FMT_FP4_E4M3, 16)
        rec = {"kernel": "quantize_steady_state", "input_MiB": mib, "buffer_sets": len(xs)}
        for name, fn, nbytes in (
            ("pack_fp8", kq.quantize_fp8_packed, _pack_bytes(n, kq.FMT_FP8, 32)),
            ("pack_fp4_e4m3", kq.quantize_fp4_e4m3_packed, e4m3_bytes),
            ("pack_mxfp4", kq.quantize_mxfp4_packed, _pack_bytes(n, kq.FMT_MXFP4, 32)),
            ("fake_quant_fp8", kq.fp8_fake_quant, 4 * n),
            ("fake_quant_fp4_e4m3", kq.fp4_e4m3_fake_quant, 4 * n),
            ("fake_quant_mxfp4", kq.mxfp4_fake_quant, 4 * n),
        ):
            rec[name] = rates(stream_ms([lambda x=x, fn=fn: fn(x) for x in xs]), nbytes)
        del xs
        rec["copy_kernel_same_bytes_as_pack_fp4_e4m3"] = rates(stream_copy_ms(e4m3_bytes // 2), e4m3_bytes)
        emit(rec)
        torch.cuda.empty_cache()


def bench_mhc(copy_bw: float, quick: bool) -> None:
    from kernels import mhc as km
    from model.mhc import init_hc_params

    T, D = (4096, 5120) if quick else (8192, 5120)
    dt = torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(0)
    p = init_hc_params(D, 4, device="cuda")
    f = torch.randn(T, D, device="cuda", dtype=dt)
    res = torch.randn(T, 4, D, device="cuda", dtype=dt)
    post = 2 * torch.rand(T, 4, device="cuda", generator=g)
    comb = torch.rand(T, 4, 4, device="cuda", generator=g)
    pc = torch.rand(T, 4, device="cuda", generator=g)
    ins = [f, res, post, comb, pc, p["fn"], p["scale"], p["base"]]
    kw = {"norm_eps": 1e-20, "hc_eps": 1e-6}
    default, default_fwd = dict(km.CONFIG), dict(km.FWD_CONFIG)
    fwd = lambda: km.hc_post_mixes_pre(*ins, **kw)
    fwd_ref = lambda: km.hc_post_mixes_pre_ref(*ins, **kw)
    o, r = fwd(), fwd_ref()
    err = {
        "x_new_equal": torch.equal(o[0], r[0]),
        "x_in_equal": torch.equal(o[1], r[1]),
        "coef_max_err": max((a - b).abs().max().item() for a, b in zip(o[2:], r[2:])),
    }
    # bytes the fused boundary must move: f + 4 streams in, 4 streams + x_in out (10·D per token)
    nbytes_fwd = T * 10 * D * 2
    sweep = []
    for bt, bd, nw, ns, npr in ((32, 64, 4, 1, 1024), (32, 64, 4, 2, 1024), (64, 64, 8, 1, 1024),
                                (16, 64, 4, 1, 2048), (64, 32, 4, 1, 1024), (128, 32, 8, 1, 1024),
                                (64, 64, 4, 1, 512), (32, 32, 4, 1, 2048)):  # fmt: skip
        cfg = {"BT": bt, "BD": bd, "num_warps": nw, "num_stages": ns, "programs": npr}

        def run(cfg=cfg):
            km.FWD_CONFIG.update(cfg)
            return fwd()

        sweep.append((cfg, run))
    check = lambda o: [
        torch.equal(o[0], r[0]),
        torch.equal(o[1], r[1]),
        max((a - b).abs().max().item() for a, b in zip(o[2:], r[2:])),
    ]
    compare("mhc_fwd", None, fwd_ref, nbytes_fwd, None, copy_bw, sweep, check=check, T=T, D=D, **err)
    km.FWD_CONFIG.update(default_fwd)  # the fwd+bwd sweep below tunes the backward's CONFIG

    leaves = [t.clone().requires_grad_() for t in ins]
    grads = [torch.randn_like(t) for t in r]

    def fwd_bwd(impl):
        outs = impl(*leaves, **kw)
        return torch.autograd.grad(outs, leaves, grads)

    # forward (10·D) + backward (reads f, 4 res, 4 stream grads, x_in grad; writes f and 4 res grads: 15·D)
    nbytes_fb = T * 25 * D * 2
    sweep = []
    for bt, bd, nw, npr in ((32, 64, 4, 1024), (32, 64, 8, 1024), (16, 64, 4, 2048), (64, 32, 4, 1024),
                            (32, 32, 4, 2048), (64, 64, 8, 1024)):  # fmt: skip
        cfg = {"BT": bt, "BD": bd, "num_warps": nw, "num_stages": 1, "programs": npr}

        def run(cfg=cfg):
            km.CONFIG.update(cfg)
            return fwd_bwd(km.hc_post_mixes_pre)

        sweep.append((cfg, run))
    g_ref = fwd_bwd(km.hc_post_mixes_pre_ref)
    rel_err = lambda gs: max(
        ((a.float() - b.float()).abs().max() / b.float().abs().max()).item() for a, b in zip(gs, g_ref)
    )
    compiled_ref = torch.compile(km.hc_post_mixes_pre_ref)
    compare("mhc_fwd_bwd", None, lambda: fwd_bwd(km.hc_post_mixes_pre_ref), nbytes_fb, None, copy_bw, sweep,
             compiled_fn=lambda: fwd_bwd(compiled_ref), check=rel_err, T=T, D=D)  # fmt: skip
    km.CONFIG.update(default)


def bench_mhc_decode(copy_bw: float, quick: bool) -> None:
    """The fused mHC forward boundary at decode shapes: `small`'s width, the tokens of one decode step (1,
    64 and 256 sessions). Sweeps the finalize's token tile (FWD_CONFIG["BT_FINALIZE"]): a step's
    Sinkhorn runs on cdiv(T, tile) programs, so the tile decides how many of them share its 64 rows."""
    from kernels import mhc as km
    from model.mhc import init_hc_params

    D, dt = 1024, torch.bfloat16
    default_fwd = dict(km.FWD_CONFIG)
    p = init_hc_params(D, 4, device="cuda")
    kw = {"norm_eps": 1e-20, "hc_eps": 1e-6}
    for T in (1, 64) if quick else (1, 64, 256):
        g = torch.Generator(device="cuda").manual_seed(T)
        ins = [torch.randn(T, D, device="cuda", dtype=dt), torch.randn(T, 4, D, device="cuda", dtype=dt),
               2 * torch.rand(T, 4, device="cuda", generator=g), torch.rand(T, 4, 4, device="cuda", generator=g),
               torch.rand(T, 4, device="cuda", generator=g), p["fn"], p["scale"], p["base"]]  # fmt: skip
        km.FWD_CONFIG.update({**default_fwd, "BT_FINALIZE": 64})  # the forward's own tile: the baseline
        base_out = km.hc_post_mixes_pre(*ins, **kw)
        sweep = []
        for fin in (64, 32, 16, 8):
            cfg = {**default_fwd, "BT_FINALIZE": fin}

            def run(cfg=cfg, ins=ins):
                km.FWD_CONFIG.update(cfg)
                return km.hc_post_mixes_pre(*ins, **kw)

            sweep.append((cfg, run))
        # the streams must be the 64 tile's bit for bit; the coefficients (each token's Sinkhorn) may round
        # differently with the tile's layout: their largest difference from the 64 tile's
        check = lambda o, base_out=base_out: [
            torch.equal(o[0], base_out[0]),
            torch.equal(o[1], base_out[1]),
            max((a - b).abs().max().item() for a, b in zip(o[2:], base_out[2:])),
        ]
        ref = lambda ins=ins: km.hc_post_mixes_pre_ref(*ins, **kw)
        compare("mhc_fwd_decode", None, ref, T * 10 * D * 2, None, copy_bw, sweep, check=check, rounds=3, T=T, D=D)
    km.FWD_CONFIG.update(default_fwd)


def bench_attn(copy_bw: float, quick: bool) -> None:

    split = {"BH": 64, "BK": 64, "BDK": "full", "DV": 512, "num_warps": 8, "num_stages": 2}
    decode_configs = [{**split, "SPLIT": "auto"}, {**split, "SPLIT": 1}, {**split, "SPLIT": 3},
                      {**split, "BK": 32, "SPLIT": "auto"}, {**split, "num_stages": 1, "SPLIT": "auto"},
                      {**split, "BK": 32, "num_stages": 3, "SPLIT": "auto"},
                      {**split, "BK": 32, "num_stages": 4, "SPLIT": "auto"},
                      {**split, "BK": 16, "num_stages": 6, "SPLIT": "auto"},
                      # whole rows for q·k, half of each row for p·v per program: 128 programs, no partials
                      {**split, "DV": 256, "SPLIT": 1}, {**split, "BK": 32, "DV": 256, "num_stages": 3, "SPLIT": 1},
                      {**split, "BK": 32, "DV": 256, "num_stages": 3, "num_warps": 4, "SPLIT": 1},
                      # its neighbours (index halves x column halves, SPLIT 2 / 4 at DV 256: 57-80 us)
                      {**split, "BK": 32, "DV": 256, "num_stages": 2, "num_warps": 4, "SPLIT": 1},
                      {**split, "BK": 16, "DV": 256, "num_stages": 4, "num_warps": 4, "SPLIT": 1}]  # fmt: skip
    # (4 stages of 32-index blocks or 2 of 64 need 256 KB of shared memory at DV 256 / 4 warps: no fit)
    configs = [
        {"BH": 64, "BK": 64, "BDK": 64, "DV": 256, "num_warps": 8, "num_stages": 1},
        {"BH": 64, "BK": 64, "BDK": 64, "DV": 128, "num_warps": 4, "num_stages": 1},
        {"BH": 64, "BK": 32, "BDK": 64, "DV": 256, "num_warps": 4, "num_stages": 2},
        {"BH": 64, "BK": 64, "BDK": 128, "DV": 256, "num_warps": 8, "num_stages": 1},
        {"BH": 64, "BK": 32, "BDK": "full", "DV": 512, "num_warps": 8, "num_stages": 1},
        {"BH": 64, "BK": 32, "BDK": "full", "DV": 512, "num_warps": 8, "num_stages": 2},
        {"BH": 64, "BK": 64, "BDK": "full", "DV": 512, "num_warps": 8, "num_stages": 1},
        {"BH": 32, "BK": 64, "BDK": 64, "DV": 256, "num_warps": 4, "num_stages": 1},
    ]
    cases = [("decode", 64, 1, 2048)] + ([] if quick else [("train_fwd", 1, 2048, 4096)])
    for name, B, M, N in cases:
        cfgs = decode_configs + configs if name == "decode" else configs
        _bench_attn_case(name, B, M, N, cfgs, copy_bw)
        torch.cuda.empty_cache()
    _bench_attn_packed(copy_bw)
    if not quick:  # --quick: the decode cases only
        _bench_attn_bwd(2048, copy_bw)
        torch.cuda.empty_cache()


def _bench_attn_packed(copy_bw):
    """Decode against a packed cache (B 64, H 64, 128 window + 512 packed FP4 main-KV entries of a
    2048-entry bank): the picked entries decoded once into a staging buffer and read by the dense
    kernel (STAGE), or decoded per element inside the attention kernel, against unpacking the bank
    first (LayerCache.bank's torch unpack, then the dense kernel: the path without `ckv`), and
    against the dense kernel on a bank already held unpacked."""
    from kernels import sparse_attn as ks
    from model.packed_cache import pack_main_kv, unpack_main_kv
    from model.quant import fp4_e4m3_fake_quant

    B, H, Dh, T, G, W, KC = 64, 64, 512, 128, 2048, 128, 512
    g = torch.Generator(device="cuda").manual_seed(2)
    q = torch.randn(B, 1, H, Dh, device="cuda", dtype=torch.bfloat16, generator=g)
    win = torch.randn(B, T, Dh, device="cuda", dtype=torch.bfloat16, generator=g)
    ckv = pack_main_kv(fp4_e4m3_fake_quant(torch.randn(B, G, Dh, device="cuda", generator=g)))
    sink = torch.randn(H, device="cuda", generator=g)
    top = torch.argsort(torch.rand(B, 1, G, device="cuda", generator=g), dim=-1)[..., :KC] + T
    idxs = torch.cat([torch.arange(W, device="cuda").expand(B, 1, W), top], dim=-1).to(torch.int32).contiguous()
    scale = Dh**-0.5
    dense = torch.cat([win, unpack_main_kv(ckv, torch.bfloat16)], dim=1)
    on_dense = lambda kv: ks.sparse_attn_fwd(q, kv, sink, idxs, scale)
    unpack_then_dense = lambda: on_dense(torch.cat([win, unpack_main_kv(ckv, q.dtype)], 1))
    nbytes = B * (W * Dh * 2 + KC * ckv.size(-1)) + 2 * q.numel() * 2 + idxs.numel() * 4
    staged, fused = ks.PACKED_CONFIG, ks.PACKED_FUSED_CONFIG
    best = None
    for cfg in (staged, {**staged, "BK": 64, "num_stages": 1, "num_warps": 8}, {**staged, "BK": 16, "num_stages": 4},
                fused, {**fused, "BK": 64, "num_stages": 2}, {**fused, "BK": 32}, {**fused, "SPLIT": 1}):  # fmt: skip
        packed = lambda cfg=cfg: ks.sparse_attn_fwd(q, win, sink, idxs, scale, cfg, ckv=ckv)
        try:  # the same tiles on the unpacked rows give the same bits
            same = torch.equal(packed(), ks.sparse_attn_fwd(q, dense, sink, idxs, scale, cfg))
            ms = bench_ms(packed)
        except Exception as e:
            emit({"kernel": "sparse_attn_decode_packed", "config": cfg, "error": f"{type(e).__name__}: {e}"[:240]})
            continue
        emit({"kernel": "sparse_attn_decode_packed", "config": cfg, "sweep": True, "same_as_dense_on_unpacked": same,
               **rates(ms, nbytes, copy_bw=copy_bw)})  # fmt: skip
        if best is None or ms < best[1]:
            best = (cfg, ms)
    rec = {"kernel": "sparse_attn_decode_packed", "B": B, "H": H, "window": W, "packed_picks": KC, "bank": G,
           "bytes_read": nbytes, "config": best[0], "packed": rates(best[1], nbytes, copy_bw=copy_bw),
           "unpack_bank_then_dense_ms": round(bench_ms(unpack_then_dense), 5),
           "dense_on_unpacked_ms": round(bench_ms(lambda: on_dense(dense)), 5)}  # fmt: skip
    rec["speedup_vs_unpack_then_dense"] = round(rec["unpack_bank_then_dense_ms"] / best[1], 2)
    emit(rec)


def _bench_attn_bwd(M, copy_bw):
    """Training step shape: forward + backward (Triton kernels vs autograd through the reference)."""
    from kernels import sparse_attn as ks

    B, H, Dh, K, N = 1, 64, 512, 512 + 128, 4096
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(B, M, H, Dh, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    kv = torch.randn(B, N, Dh, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    sink = torch.randn(H, device="cuda", generator=g).requires_grad_()
    idxs = torch.argsort(torch.rand(B, M, N, device="cuda", generator=g), dim=-1)[..., :K].to(torch.int32)
    do = torch.randn(B, M, H, Dh, device="cuda", dtype=torch.bfloat16, generator=g)
    scale = Dh**-0.5

    def step(fn):
        return torch.autograd.grad(fn(q, kv, sink, idxs, scale), (q, kv, sink), do)

    g_ref = step(ks.sparse_attn_ref)
    rel = lambda gs: max(
        ((a.float() - b.float()).abs().max() / b.float().abs().max()).item() for a, b in zip(gs, g_ref)
    )
    sweep = []
    for bh, bk, nw in ((16, 32, 8), (32, 32, 8), (16, 16, 4)):
        cfg = {"BH": bh, "BK": bk, "num_warps": nw, "num_stages": 1}

        def run(cfg=cfg):
            ks.BWD_CONFIG.update(cfg)
            return step(ks.sparse_attn)

        sweep.append((cfg, run))
    flops = 4 * B * M * H * K * Dh * 3.5  # fwd 2 GEMMs; bwd recomputes S and does 4 more (dq, dp, dk, dv)
    compiled_ref = torch.compile(ks.sparse_attn_ref)
    compare("sparse_attn_train_fwd_bwd", None, lambda: step(ks.sparse_attn_ref), None, flops, copy_bw, sweep,
             compiled_fn=lambda: step(compiled_ref), check=rel, B=B, M=M, H=H, Dh=Dh, K=K, N=N)  # fmt: skip


def _attn_inputs(B, M, H, Dh, N, K, seed):
    """bf16 q [B,M,H,Dh], kv [B,N,Dh], sink [H] and indices [B,M,K]: distinct rows per query (as
    top-k + window give), the last 7 slots -1."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, M, H, Dh, device="cuda", dtype=torch.bfloat16, generator=g)
    kv = torch.randn(B, N, Dh, device="cuda", dtype=torch.bfloat16, generator=g)
    sink = torch.randn(H, device="cuda", generator=g)
    idxs = torch.argsort(torch.rand(B, M, N, device="cuda", generator=g), dim=-1)[..., :K].to(torch.int32)
    idxs[..., -7:] = -1
    return q, kv, sink, idxs


def _bench_attn_case(name, B, M, N, configs, copy_bw):
    from kernels import sparse_attn as ks

    H, Dh, K = 64, 512, 512 + 128
    q, kv, sink, idxs = _attn_inputs(B, M, H, Dh, N, K, seed=0)
    scale = Dh**-0.5
    ref = lambda: ks.sparse_attn_ref(q, kv, sink, idxs, scale)
    o_ref = ref().float()
    err = (ks.sparse_attn_fwd(q, kv, sink, idxs, scale).float() - o_ref).abs().max().item()
    rows_read = min(B * M * K, B * N) if M > 1 else B * M * K  # decode: every gathered row once
    nbytes = rows_read * Dh * 2 + 2 * q.numel() * 2 + idxs.numel() * 4
    flops = 4 * B * M * H * K * Dh
    sweep = [(cfg, lambda cfg=cfg: ks.sparse_attn_fwd(q, kv, sink, idxs, scale, cfg)) for cfg in configs]
    check = lambda o: round((o.float() - o_ref).abs().max().item(), 5)
    meta = {"B": B, "M": M, "H": H, "Dh": Dh, "K": K, "N": N, "max_abs_err_default_cfg": err}
    rounds = 3 if M == 1 else 1  # decode configs differ by a few us: rank them over rounds
    compare(f"sparse_attn_{name}", None, ref, nbytes, flops, copy_bw, sweep, check=check, rounds=rounds, **meta)
    if M == 1:
        # four independent (q, kv, indices) sets, 128 MiB of KV each, for the steady-state timings
        sets = [_attn_inputs(B, 1, H, Dh, N, K, seed=10 + i) for i in range(4)]
        _decode_steady_state(sets, nbytes)
        _decode_bounds(kv, idxs, copy_bw, sets)


def _decode_steady_state(sets, nbytes):
    """The decode case with the shipped config in steady state (bench/device_timing.py's stream_ms):
    the sets called back to back."""
    from kernels import sparse_attn as ks

    Dh = sets[0][1].size(-1)
    calls = [lambda args=args: ks.sparse_attn_fwd(*args, Dh**-0.5) for args in sets]
    emit({"kernel": "sparse_attn_decode_steady_state", "buffer_sets": len(calls), "bytes_read": nbytes,
          "config": ks.DECODE_CONFIG, "triton": rates(stream_ms(calls), nbytes)})  # fmt: skip


def _decode_bounds(kv, idxs, copy_bw, sets):
    """What the decode case's memory side can reach without its dots: the same rows gathered by a
    probe kernel that only sums them, its gathers streamed num_stages - 1 blocks ahead like the
    attention kernel's (indices loaded a block ahead; 4 programs per row, 16 rows per load), by a
    probe that loads one 32-row tile per program, and a device copy of as many bytes (read + write).
    Then in steady state over the sets: the looped probe at the decode kernel's 128 programs (2 per
    row, 32 rows per load), the one-shot probe at its best tile (16 rows, one warp: 40 programs per
    row), and a copy kernel of as many bytes."""
    import triton
    import triton.language as tl

    @triton.jit
    def gather_rows_probe(idx_ptr, kv_ptr, o_ptr, N, K, DH: tl.constexpr, ROWS: tl.constexpr, SPLIT: tl.constexpr):
        row, s = tl.program_id(0).to(tl.int64), tl.program_id(1)
        d_D = tl.arange(0, DH)
        acc = tl.zeros((ROWS, DH), tl.float32)
        chunk = tl.cdiv(tl.cdiv(K, SPLIT), ROWS) * ROWS
        k_lo, k_hi = s * chunk, tl.minimum(K, (s + 1) * chunk)
        k_K = k_lo + tl.arange(0, ROWS)
        next_K = tl.load(idx_ptr + row * K + k_K, mask=k_K < k_hi, other=-1)
        for k0 in tl.range(k_lo, k_hi, ROWS, num_stages=3):
            idx_K = next_K.to(tl.int64)
            k_K = k0 + ROWS + tl.arange(0, ROWS)
            next_K = tl.load(idx_ptr + row * K + k_K, mask=k_K < k_hi, other=-1)
            ok_K = idx_K >= 0
            rows_K = kv_ptr + (row * N + tl.where(ok_K, idx_K, 0)) * DH
            acc += tl.load(rows_K[:, None] + d_D[None, :], mask=ok_K[:, None], other=0.0).to(tl.float32)
        tl.store(o_ptr + (s * tl.num_programs(0) + row) * DH + d_D, tl.sum(acc, axis=0))

    @triton.jit
    def gather_tile_probe(idx_ptr, kv_ptr, o_ptr, N, K, DH: tl.constexpr, CH: tl.constexpr):
        # no loop: each program loads one [CH, DH] tile of gathered rows (the most loads in flight)
        row, s = tl.program_id(0).to(tl.int64), tl.program_id(1)
        d_D = tl.arange(0, DH)
        k_K = s * CH + tl.arange(0, CH)
        idx_K = tl.load(idx_ptr + row * K + k_K, mask=k_K < K, other=-1).to(tl.int64)
        ok_K = idx_K >= 0
        rows_K = kv_ptr + (row * N + tl.where(ok_K, idx_K, 0)) * DH
        x = tl.load(rows_K[:, None] + d_D[None, :], mask=ok_K[:, None], other=0.0).to(tl.float32)
        tl.store(o_ptr + (s * tl.num_programs(0) + row) * DH + d_D, tl.sum(x, axis=0))

    B, N, Dh = kv.shape
    K = idxs.size(-1)
    out = torch.empty(triton.cdiv(K, 32), B, Dh, device=kv.device)
    probe = lambda: gather_rows_probe[(B, 4)](idxs, kv, out, N, K, DH=Dh, ROWS=16, SPLIT=4, num_warps=4)
    # the best of an earlier sweep on the H200 (54 looped tiles: rows per load, splits, stages, warps; one-shot
    # tiles of 8-128 rows): looped 41.7%, one-shot 43.5% of HBM
    tile_probe = lambda: gather_tile_probe[(B, triton.cdiv(K, 32))](idxs, kv, out, N, K, DH=Dh, CH=32, num_warps=2)
    gathered = B * K * Dh * kv.element_size()
    src = torch.empty(gathered, dtype=torch.uint8, device=kv.device)
    dst = torch.empty_like(src)
    rows = (idxs[:, 0].long().clamp(min=0) + torch.arange(B, device=kv.device)[:, None] * N).flatten()
    flat = kv.view(B * N, Dh)
    copy_ms = bench_ms(lambda: dst.copy_(src), graph=False)
    emit({"kernel": "sparse_attn_decode_bounds", "bytes_gathered": gathered,
           "gather_only_probe": rates(bench_ms(probe), gathered, copy_bw=copy_bw),
           "gather_only_probe_one_tile_per_program": rates(bench_ms(tile_probe), gathered, copy_bw=copy_bw),
           "torch_index_select_read_plus_write": rates(bench_ms(lambda: flat.index_select(0, rows)), 2 * gathered),
           "copy_same_bytes": rates(copy_ms, 2 * gathered, copy_bw=copy_bw)})  # fmt: skip
    # steady state; each call sums into outputs of its own (stream_ms keeps captured outputs apart)
    looped = [lambda kv=s[1], ix=s[3]: gather_rows_probe[(B, 2)](ix, kv, torch.empty(2, B, Dh, device=kv.device),
                                                                  N, K, DH=Dh, ROWS=32, SPLIT=2, num_warps=4)
              for s in sets]  # fmt: skip
    one_shot = [lambda kv=s[1], ix=s[3]: gather_tile_probe[(B, triton.cdiv(K, 16))](
        ix, kv, torch.empty(triton.cdiv(K, 16), B, Dh, device=kv.device), N, K, DH=Dh, CH=16, num_warps=1)
        for s in sets]  # fmt: skip
    emit({"kernel": "sparse_attn_decode_bounds_steady_state", "bytes_gathered": gathered,
          "gather_only_probe_128_programs": rates(stream_ms(looped), gathered),
          "gather_only_probe_one_tile_of_16_rows_per_program": rates(stream_ms(one_shot), gathered),
          "copy_kernel_same_bytes": rates(stream_copy_ms(gathered), 2 * gathered)})  # fmt: skip


def bench_step(copy_bw: float, quick: bool, dtype: torch.dtype = torch.bfloat16) -> None:
    """One `small` training step (batch 1 x 4096, bench/model_step.py's loss) with impl torch and
    impl triton on the same weights and tokens: step time (the best of rounds that alternate the
    impls, each the mean of n steps) and the two losses. `--step-dtype float32`:
    fp32 weights with TF32 matmuls, as the demo trains `small` on a GPU."""
    import time

    import torch.nn.functional as F

    from bench.model_step import random_engram_inputs
    from model.config import get_flavor
    from model.transformer import Transformer

    torch.manual_seed(0)
    seqlen = 2048 if quick else 4096
    prev = torch.get_default_dtype()
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = dtype == torch.float32 or tf32
    torch.set_default_dtype(dtype)
    try:  # built and initialised on the GPU (a CPU init of 1.4B parameters takes minutes)
        with torch.device("cuda"):
            models = {impl: Transformer(get_flavor("small", impl=impl)) for impl in ("torch", "triton")}
            models["torch"].init_weights()
    finally:
        torch.set_default_dtype(prev)
    models["triton"].load_state_dict(models["torch"].state_dict())
    ids = torch.randint(0, models["torch"].args.vocab_size, (1, seqlen + 1), device="cuda")
    engram_inputs = random_engram_inputs(models["torch"].args, 1, seqlen, torch.device("cuda"))
    rec = {
        "kernel": "small_train_step",
        "batch": 1,
        "seqlen": seqlen,
        "dtype": str(dtype).removeprefix("torch."),
        "tf32": torch.backends.cuda.matmul.allow_tf32,
    }
    steps = {}
    for impl, model in models.items():

        def step(model=model):
            out = model(ids[:, :-1], engram_inputs=engram_inputs)
            loss = F.cross_entropy(out.logits.flatten(0, 1).float(), ids[:, 1:].flatten()) + out.indexer_loss
            loss.backward()
            model.zero_grad(set_to_none=True)
            return loss.detach()

        steps[impl] = step
        # the first steps compile kernels and grow the caching allocator (a Triton step measured
        # 410 ms after two warm-up steps, 338 ms once warm): three before any timing
        rec[impl] = {"loss": round(step().item(), 5)}
        for _ in range(2):
            step()
    n = 3 if quick else 5
    for _ in range(2 if quick else 3):  # rounds alternate the impls; the best round counts
        for impl, step in steps.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(n):
                step()
            torch.cuda.synchronize()
            rec[impl].setdefault("rounds_ms", []).append(round((time.perf_counter() - t0) / n * 1e3, 2))
    for impl in steps:
        rec[impl]["step_ms"] = min(rec[impl]["rounds_ms"])
    rec["speedup"] = round(rec["torch"]["step_ms"] / rec["triton"]["step_ms"], 3)
    torch.backends.cuda.matmul.allow_tf32 = tf32
    emit(rec)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="smaller shapes, fewer cases")
    ap.add_argument("--only", default="quant,mhc,attn,moe")
    ap.add_argument("--no-compile", action="store_true", help="time the torch references eager only")
    ap.add_argument("--eager-launch", action="store_true", help="time calls as launched, not as CUDA graph replays")
    ap.add_argument(
        "--step-dtype",
        choices=("bfloat16", "float32"),
        default="bfloat16",
        help="the `step` bench's weights (float32: with TF32 matmuls, as the demo trains)",
    )
    args = ap.parse_args()
    OPTS["no_compile"] = args.no_compile
    OPTS["eager_launch"] = args.eager_launch
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "bench/kernels.py needs a CUDA GPU"}))
        return
    import triton

    emit({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__})
    copy_bw = copy_bandwidth()
    emit(timing_floor())
    only = set(args.only.split(","))
    benches = (
        ("moe", bench_moe),
        ("quant", bench_quant),
        ("attn", bench_attn),
        ("mhc", bench_mhc),
        ("mhc_decode", bench_mhc_decode),
        ("step", functools.partial(bench_step, dtype=getattr(torch, args.step_dtype))),
    )
    for name, fn in benches:
        if name in only:
            try:
                fn(copy_bw, args.quick)
            except Exception as e:
                emit({"kernel": name, "error": f"{type(e).__name__}: {str(e)[:300]}"})


if __name__ == "__main__":
    main()
