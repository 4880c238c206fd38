"""Benchmark of the Triton lightning-indexer scores (kernels/indexer.py) against the torch reference.

    python bench/indexer.py            # one H200: decode, prefill (fwd, fwd+bwd), restricted
    python bench/indexer.py --quick    # no tile sweep, no restricted case
    python bench/indexer.py --tiny     # CPU smoke run of the same code at tiny sizes (interpreter)
    python bench/indexer.py --no-compile  # the torch reference eager only

One JSON line per measurement: Triton (each swept tile config, then the best) and the torch
reference in eager mode and, for the forward (not with --no-compile), under torch.compile, with ms,
TFLOP/s (2·B·S·I·G·Di for the dots; x3 for fwd+bwd) and GB/s (the
bytes the op must move: q, k, w, mask, scores), then a max-abs-error line per case. Sizes: the
released config's index heads (flash_args: index_n_heads 32, index_head_dim 128); decode B 64, S 1,
G 8192 groups, all visible; prefill B 1, S 4096, G 1024, causal at ratio 4 (a tile no query sees
skips its dots); restricted: decode at G 65536 scoring only 2048 blocks of 8 groups per query.
bf16 q and k (the model's dtype), fp32 w. Not a test: the parity tests are tests/kernels/test_indexer.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DECODE_SWEEP = [
    {"BS": 1, "HB": 32, "BG": 64, "num_warps": 4, "num_stages": 2},
    {"BS": 1, "HB": 32, "BG": 128, "num_warps": 4, "num_stages": 2},
    {"BS": 1, "HB": 32, "BG": 128, "num_warps": 8, "num_stages": 3},
    {"BS": 1, "HB": 32, "BG": 256, "num_warps": 8, "num_stages": 2},
]
PREFILL_SWEEP = [
    {"BS": 64, "HB": 1, "BG": 128, "num_warps": 8, "num_stages": 2},
    {"BS": 128, "HB": 1, "BG": 64, "num_warps": 8, "num_stages": 2},
    {"BS": 128, "HB": 1, "BG": 128, "num_warps": 8, "num_stages": 2},
    {"BS": 64, "HB": 1, "BG": 64, "num_warps": 4, "num_stages": 3},
    {"BS": 32, "HB": 2, "BG": 128, "num_warps": 8, "num_stages": 2},
    {"BS": 16, "HB": 4, "BG": 128, "num_warps": 8, "num_stages": 2},
]
BWD_SWEEP = [
    {"BM": 64, "BG": 64, "num_warps": 4, "num_stages": 2},
    {"BM": 128, "BG": 64, "num_warps": 8, "num_stages": 2},
    {"BM": 64, "BG": 128, "num_warps": 8, "num_stages": 2},
]


COMPILE = {"on": True}  # --no-compile: the torch reference eager only (compiling takes minutes)


def _emit(rec: dict) -> None:
    print(json.dumps(rec), flush=True)


def _timer(device: str):
    """Median ms of fn(): on CUDA bench/device_timing.py's bench_ms (CUDA graph replays, L2 flushed before each:
    device time, not the host's launch cost), one timed call after a warm-up on CPU."""
    if device == "cuda":
        from bench.device_timing import bench_ms

        return bench_ms

    def once(fn):
        fn()
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3

    return once


def _rates(ms: float, nbytes: float, flops: float) -> dict:
    s = ms * 1e-3
    return {"ms": round(ms, 5), "TFLOP_s": round(flops / s / 1e12, 2), "GB_s": round(nbytes / s / 1e9, 1)}


def make_inputs(B: int, S: int, I: int, Di: int, G: int, causal: bool, device: str, seed: int = 0):
    """bf16 q [B,S,I,Di] and k [B,G,Di] on the MXFP4 grid (as under QAT), fp32 w, bool mask."""
    from model.quant import mxfp4_fake_quant

    g = torch.Generator(device=device).manual_seed(seed)
    q = mxfp4_fake_quant(torch.randn(B, S, I, Di, generator=g, device=device)).bfloat16()
    k = mxfp4_fake_quant(torch.randn(B, G, Di, generator=g, device=device)).bfloat16()
    w = torch.randn(B, S, I, generator=g, device=device) * (Di**-0.5 * I**-0.5)
    if causal:  # ratio G/S groups: query s sees groups completed by its position
        vis = torch.arange(G, device=device) * (S // G) + (S // G - 1) <= torch.arange(S, device=device)[:, None]
        vis = vis.expand(B, S, G)
    else:
        vis = torch.ones(B, S, G, dtype=torch.bool, device=device)
    return q, k, w, vis


def bench_scores(name, B, S, I, Di, G, causal, device, sweep, bwd_sweep, timer) -> None:
    """Forward (and fwd+bwd when bwd_sweep is not None) of one case: every config, best, eager."""
    from kernels import indexer as ki

    q, k, w, vis = make_inputs(B, S, I, Di, G, causal, device)
    flops = 2.0 * B * S * I * G * Di
    nbytes = q.numel() * 2 + k.numel() * 2 + w.numel() * 4 + vis.numel() + B * S * G * 4
    meta = {"case": name, "B": B, "S": S, "I": I, "Di": Di, "G": G, "causal": causal}
    best = _sweep(meta | {"op": "fwd"}, sweep, lambda cfg: ki.index_scores_fwd(q, k, w, vis, config=cfg), timer,
                  nbytes, flops)  # fmt: skip
    ref_ms = timer(lambda: ki.index_scores_ref(q, k, w, vis))
    _emit(meta | {"op": "fwd", "impl": "torch_eager", **_rates(ref_ms, nbytes, flops)})
    if best is not None:
        _emit(meta | {"op": "fwd", "speedup_vs_eager": round(ref_ms / best, 2)})
    if COMPILE["on"]:
        try:
            compiled = torch.compile(ki.index_scores_ref)
            compiled(q, k, w, vis)  # compile outside the timed region
            comp_ms = timer(lambda: compiled(q, k, w, vis))
            _emit(meta | {"op": "fwd", "impl": "torch_compile", **_rates(comp_ms, nbytes, flops)})
            if best is not None:
                _emit(meta | {"op": "fwd", "speedup_vs_compile": round(comp_ms / best, 2)})
        except Exception as e:  # report, keep benchmarking the rest
            _emit(meta | {"op": "fwd", "warning": f"torch.compile failed: {type(e).__name__}: {str(e)[:200]}"})
    out, ref = ki.index_scores(q, k, w, vis), ki.index_scores_ref(q, k, w, vis)
    fin = torch.isfinite(ref)
    err = (out[fin] - ref[fin]).abs().max().item() if fin.any() else 0.0
    _emit(meta | {"op": "fwd", "max_abs_err": err, "max_abs_ref": ref[fin].abs().max().item() if fin.any() else 0.0,
                  "same_inf": bool(torch.equal(torch.isinf(out), ~fin))})  # fmt: skip
    if bwd_sweep is None:
        return
    d = torch.randn(B, S, G, device=device)
    ins = [t.clone().requires_grad_() for t in (q, k, w)]
    best = _sweep(meta | {"op": "fwd+bwd"}, bwd_sweep,
                  lambda cfg: (ki.index_scores_fwd(q, k, w, vis), ki.index_scores_bwd(q, k, w, vis, d, config=cfg)),
                  timer, nbytes * 2, 3 * flops)  # fmt: skip
    ref_ms = timer(lambda: torch.autograd.grad(ki.index_scores_ref(*ins, vis), ins, d))
    _emit(meta | {"op": "fwd+bwd", "impl": "torch_eager", **_rates(ref_ms, nbytes * 2, 3 * flops)})
    if best is not None:
        _emit(meta | {"op": "fwd+bwd", "speedup_vs_eager": round(ref_ms / best, 2)})
    grads = torch.autograd.grad(ki.index_scores(*ins, vis), ins, d)
    grads_ref = torch.autograd.grad(ki.index_scores_ref(*ins, vis), ins, d)
    for n, a, b in zip(("dq", "dk", "dw"), grads, grads_ref):
        rel = ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()
        _emit(meta | {"op": "bwd", "grad": n, "max_rel_err": rel})


def _sweep(meta, configs, run, timer, nbytes, flops):
    """Times run(cfg) for each config (None = the shipped one); emits each; returns the best ms."""
    best = None
    for cfg in configs or [None]:
        try:
            ms = timer(lambda cfg=cfg: run(cfg))
        except Exception as e:  # a tile that does not fit: report, keep sweeping
            _emit(meta | {"impl": "triton", "config": cfg, "error": f"{type(e).__name__}: {str(e)[:200]}"})
            continue
        _emit(meta | {"impl": "triton", "config": cfg, **_rates(ms, nbytes, flops)})
        best = ms if best is None else min(best, ms)
    return best


def bench_restricted(B, I, Di, G, C, bs, device, timer) -> None:
    """Decode on a Reindex layer: restricted scores of C blocks of bs groups vs dense over all G."""
    from kernels import indexer as ki

    q, k, w, vis = make_inputs(B, 1, I, Di, G, False, device)
    nb = G // bs
    g = torch.Generator(device=device).manual_seed(1)
    blk = torch.rand(B, 1, nb, generator=g, device=device).argsort(-1)[..., :C].sort(-1).values
    N = C * bs
    flops = 2.0 * B * I * N * Di
    nbytes = q.numel() * 2 + B * N * Di * 2 + w.numel() * 4 + blk.numel() * 8 + B * N * (4 + 8)
    meta = {"case": "decode_restricted", "B": B, "I": I, "Di": Di, "G": G, "C": C, "block_size": bs}
    ms = timer(lambda: ki.index_scores_restricted(q, k, w, blk, bs, vis))
    _emit(meta | {"impl": "triton", **_rates(ms, nbytes, flops)})
    dense_ms = timer(lambda: ki.index_scores_fwd(q, k, w, vis))
    _emit(meta | {"impl": "triton_dense_all_G", "ms": round(dense_ms, 5)})
    ref_ms = timer(lambda: ki.index_scores_restricted_ref(q, k, w, blk, bs, vis))
    _emit(meta | {"impl": "torch_eager", **_rates(ref_ms, nbytes, flops)})
    (s, ids), (s_ref, ids_ref) = (
        ki.index_scores_restricted(q, k, w, blk, bs, vis),
        ki.index_scores_restricted_ref(q, k, w, blk, bs, vis),
    )
    _emit(meta | {"max_abs_err": (s - s_ref).abs().max().item(), "same_ids": bool(torch.equal(ids, ids_ref))})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="shipped tiles only, no restricted case")
    p.add_argument("--tiny", action="store_true", help="tiny sizes on CPU under TRITON_INTERPRET=1 (smoke run)")
    p.add_argument("--no-compile", action="store_true", help="time the torch reference eager only")
    a = p.parse_args()
    COMPILE["on"] = not a.no_compile
    if a.tiny:
        os.environ["TRITON_INTERPRET"] = "1"  # before kernels/ imports triton
        device = "cpu"
    elif not torch.cuda.is_available():
        sys.exit("needs CUDA (or --tiny for a CPU smoke run)")
    else:
        device = "cuda"
    from model.config import flash_args

    args = flash_args()
    I, Di = args.index_n_heads, args.index_head_dim
    timer = _timer(device)
    sweep = not a.quick
    if a.tiny:
        bench_scores("decode", 2, 1, 5, 32, 40, False, device, DECODE_SWEEP[:2], None, timer)
        bench_scores("prefill", 1, 24, 5, 32, 12, True, device, PREFILL_SWEEP[-2:], BWD_SWEEP[:2], timer)
        bench_restricted(2, 5, 32, 64, 4, 8, device, timer)
        return
    _emit({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "I": I, "Di": Di})
    bench_scores("decode", 64, 1, I, Di, 8192, False, device, DECODE_SWEEP if sweep else None, None, timer)
    bench_scores("prefill", 1, 4096, I, Di, 1024, True, device, PREFILL_SWEEP if sweep else None,
                 BWD_SWEEP if sweep else [None], timer)  # fmt: skip
    if sweep:
        bench_restricted(64, I, Di, 65536, args.candidate_topk_blocks, args.candidate_block_size, device, timer)


if __name__ == "__main__":
    main()
