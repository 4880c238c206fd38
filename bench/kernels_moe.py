"""The MoE part of bench/kernels.py (`--only moe`): the grouped expert GEMMs of kernels/moe.py at
`small` sizes against the per-expert torch loop and dense cuBLAS GEMMs of the same FLOPs, their
assignment schedule against torch's sort, and a per-kernel tile sweep. Not run on its own; needs CUDA.
"""

from __future__ import annotations

import torch

from bench.device_timing import bench_ms, emit, rates


def bench_moe(copy_bw: float, quick: bool) -> None:
    """Grouped expert GEMMs at `small` sizes (D 1024, F 512, 32 experts top-4, 8192 tokens) against the
    per-expert torch loop and dense cuBLAS bf16 GEMMs of the same FLOPs ([N, D] @ [D, 2F], [N, F] @ [F, D])."""
    from kernels import moe as km

    T, D, Fi, E, K = 8192, 1024, 512, 32, 4
    N, dt, dev = T * K, torch.bfloat16, "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(T, D, device=dev, dtype=dt, generator=g).requires_grad_()
    idx = torch.randn(T, E, device=dev, generator=g).topk(K, dim=-1).indices.sort(-1).values
    wgt = (torch.rand(T, K, device=dev, generator=g) + 0.5).requires_grad_()
    mk = lambda *shape, fan: (torch.randn(*shape, device=dev, dtype=dt, generator=g) * fan**-0.5).requires_grad_()
    w1s, w3s, w2s = (
        [mk(Fi, D, fan=D) for _ in range(E)],
        [mk(Fi, D, fan=D) for _ in range(E)],
        [mk(D, Fi, fan=Fi) for _ in range(E)],
    )
    leaves = [x, wgt, *w1s, *w3s, *w2s]
    dy = torch.randn(T, K, D, device=dev, dtype=dt, generator=g)
    args = (x, wgt, idx, w1s, w3s, w2s, 10.0)
    flops_fwd = 6.0 * N * D * Fi
    y_ref = km.moe_ref(*args)
    g_ref = torch.autograd.grad(y_ref, leaves, dy)
    rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()

    # dense cuBLAS with the same FLOPs
    xd = torch.randn(N, D, device=dev, dtype=dt, generator=g).requires_grad_()
    w13d = mk(D, 2 * Fi, fan=D)
    w2d = mk(Fi, D, fan=Fi)
    dyd = torch.randn(N, D, device=dev, dtype=dt, generator=g)
    dense_fwd = lambda: torch.mm(torch.mm(xd, w13d)[:, :Fi], w2d)
    dense_fb = lambda: torch.autograd.grad(torch.mm(torch.mm(xd, w13d)[:, :Fi], w2d), (xd, w13d, w2d), dyd)
    dense_fwd_ms, dense_fb_ms = bench_ms(dense_fwd), bench_ms(dense_fb)
    emit({"kernel": "moe_dense_cublas_same_flops", "fwd": rates(dense_fwd_ms, flops=flops_fwd),
           "fwd_bwd": rates(dense_fb_ms, flops=3 * flops_fwd)})  # fmt: skip

    _bench_moe_schedule(km, idx, wgt, E)
    fwd = lambda: km.moe_experts(*args)
    fwd_bwd = lambda: torch.autograd.grad(km.moe_experts(*args), leaves, dy)
    _moe_kernel_sweep(km, x, wgt, idx, w1s, w3s, w2s, dy, tune=not quick)
    y = fwd()
    gs = fwd_bwd()
    check = {"y_rel_err": rel(y, y_ref), "grad_rel_err_max": max(rel(a, b) for a, b in zip(gs, g_ref))}
    rec = {"kernel": "moe_grouped_fwd", "T": T, "D": D, "F": Fi, "E": E, "K": K, "config": dict(km.CONFIG), **check}
    # drop the outputs that keep autograd graphs alive: their AccumulateGrad nodes for the leaves were
    # made on the default stream, and a captured backward reaching them waits on that stream, which
    # invalidates the capture (the fwd+bwd had been timed as eager launches because of it)
    del y, y_ref
    # the Triton calls are timed before the references, whose graph capture fails (they read expert
    # counts back to the host, so their lines are eager launches)
    tri_ms = {"fwd": bench_ms(fwd), "fwd_bwd": bench_ms(fwd_bwd)}
    for name, key, ref, dense_ms, fl in (("moe_grouped_fwd", "fwd", lambda: km.moe_ref(*args), dense_fwd_ms, flops_fwd),
                                         ("moe_grouped_fwd_bwd", "fwd_bwd",
                                          lambda: torch.autograd.grad(km.moe_ref(*args), leaves, dy), dense_fb_ms,
                                          3 * flops_fwd)):  # fmt: skip
        ms, ref_ms = tri_ms[key], bench_ms(ref)
        rec.update({"kernel": name, "triton": rates(ms, flops=fl), "torch_eager": rates(ref_ms, flops=fl)})
        rec.update({"speedup_vs_eager": round(ref_ms / ms, 2), "frac_of_dense_cublas": round(dense_ms / ms, 3)})
        emit(rec)
        rec = {"T": T, "D": D, "F": Fi, "E": E, "K": K}
    # where the time goes: GPU time per kernel over 5 fwd+bwd calls vs the wall time of those calls
    from torch.profiler import ProfilerActivity, profile

    # (in isolation the wall time is bound by the host: launches and autograd over 96 weight leaves)
    cases = (("fwd", fwd, flops_fwd, dense_fwd_ms), ("fwd_bwd", fwd_bwd, 3 * flops_fwd, dense_fb_ms))
    for name, fn, fl, dense_ms in cases:
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
        rows = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:30]
        per_call = {e.key[:60]: round(e.device_time_total / 5, 1) for e in rows if e.device_time_total > 0}
        gpu_us = sum(e.device_time_total for e in prof.key_averages()) / 5
        n_launch = sum(e.count for e in prof.key_averages()) / 5
        emit({"kernel": f"moe_{name}_gpu_time", "per_call_us": per_call, "gpu_us_per_call": round(gpu_us, 1),
               "kernels_per_call": n_launch,
               "TFLOP_s_on_gpu_time": round(fl / (gpu_us * 1e-6) / 1e12, 1),
               "frac_of_dense_cublas_gpu_time": round(dense_ms * 1e3 / gpu_us, 3)})  # fmt: skip


_MOE_CANDIDATES = {  # (BM, BN, BK, num_warps, num_stages)
    "up": [(128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 64, 64, 4, 4), (64, 128, 64, 4, 4), (128, 128, 32, 8, 4),
           (128, 64, 128, 8, 3)],
    "down": [(64, 128, 64, 4, 4), (128, 128, 64, 8, 3), (128, 128, 64, 4, 4), (128, 256, 64, 8, 3), (128, 64, 64, 4, 4),
             (64, 256, 64, 8, 3), (128, 128, 128, 8, 2), (64, 128, 128, 4, 3)],
    "dh": [(128, 64, 64, 8, 4), (128, 128, 64, 8, 3), (128, 64, 64, 4, 4), (64, 128, 64, 4, 4), (128, 128, 64, 8, 4),
           (64, 64, 64, 4, 4), (128, 64, 128, 8, 3)],
    "dx": [(128, 128, 64, 8, 4), (128, 256, 64, 8, 3), (128, 128, 64, 8, 3), (64, 128, 64, 4, 4), (128, 128, 64, 4, 4),
           (128, 64, 64, 4, 4), (64, 256, 64, 8, 3)],
    "wgrad": [(128, 256, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 64, 4, 4), (256, 128, 64, 8, 3),
              (128, 128, 32, 8, 4), (64, 128, 64, 4, 4), (128, 256, 32, 8, 4)],
}  # fmt: skip


def _bench_moe_schedule(km, idx, wgt, E) -> None:
    """The forward's assignment schedule (kernels/moe.py's _Schedule: a chunked counting sort in two
    Triton kernels) against the same tables from torch ops: a stable sort of narrow keys,
    searchsorted for the expert offsets, the routing weights gathered, the tile cumsums of the
    forward's BM."""
    bm = km.CONFIG["up"]["BM"]

    def torch_schedule():
        keys, order = idx.flatten().to(torch.uint8).sort(stable=True)
        offs = torch.searchsorted(keys, torch.arange(E + 1, dtype=keys.dtype, device=keys.device), out_int32=True)
        tile_cum = (((offs[1:] - offs[:-1]).long() + bm - 1) // bm).cumsum(0).to(torch.int32)
        wgt_N = wgt.detach().float().flatten().index_select(0, order)
        return order.to(torch.int32), (order // idx.size(1)).to(torch.int32), wgt_N, offs, tile_cum

    def triton_schedule():
        s = km._Schedule(idx, wgt, E)
        return s.slot_N, s.tok_N, s.wgt_N, s.offs, s.tile_cum(bm)

    same = all(torch.equal(a, b) for a, b in zip(triton_schedule(), torch_schedule()))
    tri_ms, ref_ms = bench_ms(triton_schedule), bench_ms(torch_schedule)
    emit({"kernel": "moe_schedule", "assignments": idx.numel(), "experts": E, "same_tables": same,
          "triton_us": round(tri_ms * 1e3, 1), "torch_sort_searchsorted_us": round(ref_ms * 1e3, 1),
          "speedup": round(ref_ms / tri_ms, 2)})  # fmt: skip


def _moe_kernel_sweep(km, x, wgt, idx, w1s, w3s, w2s, dy, tune: bool) -> None:
    """Each grouped GEMM launched alone on prepared operands (the fwd+bwd wall time is bound by the
    host, so timing the whole call would pick configs by launch noise): its TFLOP/s per config, the
    best kept in km.CONFIG when `tune`, else the current config timed once."""
    E = len(w1s)
    Fi, D = w1s[0].shape
    sched = km._Schedule(idx, wgt, E)
    N = sched.N
    w1, w1ofs = km._weight_offsets([w.detach() for w in w1s])
    w3, w3ofs = km._weight_offsets([w.detach() for w in w3s])
    w2, w2ofs = km._weight_offsets([w.detach() for w in w2s])
    xd = x.detach()
    wgt_N = sched.wgt_N
    dev, dt = x.device, x.dtype
    gu = torch.empty(N, 2 * Fi, dtype=dt, device=dev)
    h = torch.empty(N, Fi, dtype=dt, device=dev)
    km._up(sched, xd, w1, w1ofs, w3, w3ofs, wgt_N, gu, h, 10.0, km.CONFIG["up"])
    y = torch.empty(N, D, dtype=dt, device=dev)
    dyN = dy.reshape(N, D)
    dgu = torch.randn(N, 2 * Fi, dtype=dt, device=dev)
    dx_N = torch.empty(N, D, dtype=dt, device=dev)
    flop = 2.0 * N * D * Fi  # one [N, D] x [D, F] product

    def launch(role, cfg):
        if role == "up":
            return lambda: km._up(sched, xd, w1, w1ofs, w3, w3ofs, wgt_N, gu, h, 10.0, cfg), 2 * flop
        if role == "down":
            return lambda: km._rows_mm(sched, h, None, w2, w2ofs, y, sched.slot_N, Fi, D, 1, Fi, cfg), flop
        if role == "dh":
            n_ft = Fi // km._tile(cfg, Fi, "BN")
            part = torch.zeros(N, n_ft, dtype=torch.float32, device=dev)
            dgu_out = torch.empty_like(gu)
            return (lambda: km._rows_mm(sched, dyN, sched.slot_N, w2, w2ofs, dgu_out, None, D, Fi, Fi, 1, cfg,
                                        swiglu=(gu, wgt_N, part), limit=10.0)), flop  # fmt: skip
        if role == "dx":
            return (lambda: km._rows_mm(sched, dgu, None, w1, w1ofs, dx_N, sched.slot_N, Fi, D, D, 1, cfg, b2=w3,
                                        b2ofs=w3ofs)), 2 * flop  # fmt: skip
        return (lambda: (km._wgrad(sched, dgu, None, xd, sched.tok_N, 2 * Fi, D, dt, cfg),
                         km._wgrad(sched, dyN, sched.slot_N, h, None, D, Fi, dt, cfg))), 3 * flop  # fmt: skip

    keys = ("BM", "BN", "BK", "num_warps", "num_stages")
    summary = {}
    for role in ("up", "down", "dh", "dx", "wgrad"):
        cands = [dict(zip(keys, c)) for c in _MOE_CANDIDATES[role]] if tune else [km.CONFIG[role]]
        best = None
        for cfg in cands:
            fn, fl = launch(role, cfg)
            try:
                fn()
                ms = bench_ms(fn, rep=30)
            except Exception as e:
                emit({"kernel": f"moe_{role}", "config": cfg, "error": f"{type(e).__name__}: {str(e)[:200]}"})
                continue
            emit({"kernel": f"moe_{role}", "config": cfg, "sweep": True, **rates(ms, flops=fl)})
            if best is None or ms < best[1]:
                best = (cfg, ms, fl)
        if best is not None:
            km.CONFIG[role] = best[0]
            summary[role] = {"config": best[0], **rates(best[1], flops=best[2])}
    emit({"kernel": "moe_per_kernel_best", "tuned": tune, **summary})
