"""How bench/kernels.py times device work and reports rates: CUDA-graph replays after an L2 flush
(`bench_ms`), steady-state back-to-back calls over rotating buffers (`stream_ms`), the JSON lines.

Not a benchmark itself and not a test. Two timings, because they disagree for ops of a few tens of
microseconds (measured on the H200):
- `bench_ms` times one call per graph replay, after zero-filling a 256 MB buffer so that the op's
  inputs are not in L2. It ranks tile configs well, but it charges the op for two things that are
  not its traffic: the flush leaves L2 full of dirty lines, whose write-back (up to the 50 MB of
  L2) then happens while the op runs, and every replay pays ~4 us of launch latency between the
  events (a one-element kernel times 4.2-4.6 us this way, 1.1 us back to back). The E4M3/16 pack of
  a 64 MiB tensor reads 63% of HBM this way (an eager device copy of the same bytes 70%), 70% after
  a read-only flush (clean lines; the copy 79%).
- `stream_ms` times what an op costs inside a stream of work: one graph of back-to-back calls
  cycling over independent buffer sets whose footprint far exceeds L2, each call writing outputs of
  its own, so every call reads cold inputs and pays for the write-back of as many dirty lines as it
  leaves (its predecessor's), and kernels start on each other's heels. The same 64 MiB pack (two
  groups per thread, as timed above): 72.0% of HBM; 78-80% if consecutive calls share their output
  memory, whose lines then stay dirty in L2 and are overwritten without a write-back.
"""

from __future__ import annotations

import json

import torch

HBM_PEAK = 4.8e12
BF16_PEAK = 790e12
# --no-compile: skip the torch.compile references (minutes of compiling); --eager-launch: time every
# call as launched from Python instead of replaying its CUDA graph
OPTS = {"no_compile": False, "eager_launch": False}
_FLUSH_BYTES = 256 * 1024**2  # > the H200's 50 MB L2


def bench_ms(fn, warmup: int = 10, rep: int = 50, graph: bool = True) -> float:
    """Median milliseconds of fn() on the device, L2 flushed before every run. fn is captured once
    in a CUDA graph and the replays are timed, so the host's cost of launching it is not counted:
    on the lent host a split-decode attention call spends ~160 us in Python (config merge,
    allocations, two Triton launchers) against ~40 us on the device, and eager timing
    (triton.testing.do_bench) then measures the host whenever it exceeds the flush's ~70 us of
    slack. Falls back to eager launches when fn cannot be captured (host syncs), and says so.
    graph=False for device copies: captured, a copy becomes a copy-engine node (58% of HBM on the
    H200 against 89% for the copy kernel an eager call runs)."""
    from triton.testing import do_bench

    if graph and not OPTS["eager_launch"]:
        try:
            return _graph_ms(fn, warmup, rep)
        except Exception as e:  # not capturable: time it as launched
            emit({"note": f"eager-launch timing (no CUDA graph: {type(e).__name__}: {str(e)[:120]})"})
    return do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def _graph_ms(fn, warmup: int, rep: int) -> float:
    graph = _capture([fn] * 3, [fn])
    flush = torch.empty(_FLUSH_BYTES, dtype=torch.int8, device="cuda")
    return _replay_median_ms(graph, warmup, rep, before=flush.zero_)


def stream_ms(fns, rounds: int = 4, reps: int = 20) -> float:
    """Milliseconds per call in steady state: fns (one closure per independent buffer set, together
    far larger than L2) called `rounds` times over, back to back in one CUDA graph; events around
    each replay, divided by the calls. No flush: by the time a set comes round again the other sets'
    traffic has evicted it (each set should move more than L2 holds, or there should be enough sets)."""
    calls = [fn for _ in range(rounds) for fn in fns]
    return _replay_median_ms(_capture(fns, calls), 3, reps) / len(calls)


def stream_copy_ms(nbytes: int, sets: int = 4) -> float:
    """stream_ms of a copy kernel reading nbytes and writing as many, over `sets` source buffers: the
    ceiling a memory-bound op of those bytes is read against. torch.bitwise_not on int64, because a
    captured .copy_ becomes a copy-engine node (58% of HBM on the H200) rather than a kernel."""
    srcs = [torch.empty(nbytes // 8, dtype=torch.int64, device="cuda") for _ in range(sets)]
    return stream_ms([lambda src=src: torch.bitwise_not(src) for src in srcs])


def _capture(warm_calls, calls) -> torch.cuda.CUDAGraph:
    """One CUDA graph of `calls`, after `warm_calls` on a side stream (compilation and allocator
    growth stay outside the capture). Every call's outputs stay alive until the capture ends, so
    each captured call writes memory of its own: a call reusing its predecessor's output memory
    would overwrite lines still dirty in L2 (kept there while evict-first inputs stream past) and
    skip their write-back."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for fn in warm_calls:
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = [fn() for fn in calls]
    del outputs
    return graph


def _replay_median_ms(graph, warmup: int, reps: int, before=None) -> float:
    """Median milliseconds of a replay, events around each; `before` runs ahead of each, untimed."""
    for _ in range(warmup):
        graph.replay()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        if before is not None:
            before()
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    times = sorted(start.elapsed_time(end) for start, end in events)
    graph.reset()
    return times[len(times) // 2]


def emit(rec: dict) -> None:
    print(json.dumps(rec), flush=True)


def rates(ms: float, nbytes: float | None = None, flops: float | None = None, copy_bw: float | None = None):
    out = {"ms": round(ms, 5)}
    if nbytes is not None:
        bw = nbytes / (ms * 1e-3)
        out |= {"GB_s": round(bw / 1e9, 1), "frac_hbm_peak": round(bw / HBM_PEAK, 3)}
        if copy_bw:
            out["frac_copy_bw"] = round(bw / copy_bw, 3)
    if flops is not None:
        tf = flops / (ms * 1e-3)
        out |= {"TFLOP_s": round(tf / 1e12, 1), "frac_bf16_peak": round(tf / BF16_PEAK, 3)}
    return out


def try_compile(fn, wrap: bool = True):
    try:
        cfn = torch.compile(fn) if wrap else fn
        cfn()  # compile now, outside the timed region
        return cfn
    except Exception as e:  # report, keep benchmarking the rest
        emit({"warning": f"torch.compile failed: {type(e).__name__}: {str(e)[:200]}"})
        return None


def compare(
    name: str,
    triton_fn,
    eager_fn,
    nbytes=None,
    flops=None,
    copy_bw=None,
    sweep=None,
    compiled_fn=None,
    check=None,
    rounds=1,
    **meta,
):
    """Time triton_fn (or each (config, fn) of sweep, keeping the best), eager_fn, and eager_fn under
    torch.compile (or `compiled_fn`, a callable that builds the compiled variant itself). `check`
    maps a Triton output to an accuracy figure reported with each swept config."""
    rec = {"kernel": name, **meta}
    best = None
    live, times = [], {}
    for i, (cfg, fn) in enumerate(sweep or [(None, triton_fn)]):
        try:
            out = fn()
            acc = {} if check is None else {"check": check(out)}
        except Exception as e:
            emit({"kernel": name, "config": cfg, "error": f"{type(e).__name__}: {str(e)[:200]}"})
            continue
        live.append((i, cfg, fn, acc))
    # the configs timed round-robin `rounds` times, each keeping its best: a slow spell of the
    # machine then costs every config a round instead of ranking the configs by when they ran
    for _ in range(rounds):
        for i, _cfg, fn, _acc in live:
            times.setdefault(i, []).append(bench_ms(fn))
    for i, cfg, _fn, acc in live:
        ms = min(times[i])
        if sweep:
            spread = {"ms_rounds": [round(t, 5) for t in times[i]]} if rounds > 1 else {}
            emit({"kernel": name, "config": cfg, "sweep": True, **acc, **rates(ms, nbytes, flops, copy_bw), **spread})
        if best is None or ms < best[1]:
            best = (cfg, ms)
    if best is None:
        return
    rec["config"] = best[0]
    rec["triton"] = rates(best[1], nbytes, flops, copy_bw)
    eager_ms = bench_ms(eager_fn)
    rec["torch_eager"] = rates(eager_ms, nbytes, flops, copy_bw)
    rec["speedup_vs_eager"] = round(eager_ms / best[1], 2)
    cfn = None
    if not OPTS["no_compile"]:
        cfn = try_compile(eager_fn) if compiled_fn is None else try_compile(compiled_fn, wrap=False)
    if cfn is not None:
        comp_ms = bench_ms(cfn)
        rec["torch_compile"] = rates(comp_ms, nbytes, flops, copy_bw)
        rec["speedup_vs_compile"] = round(comp_ms / best[1], 2)
    emit(rec)


def timing_floor() -> dict:
    """What each timing adds to any op: a one-element kernel timed by `bench_ms` (one call per
    replay: the launch latency between the events) and by `stream_ms` (back to back, 64 calls per
    replay, which spreads the replay's own launch over them)."""
    tiny = torch.zeros(1, device="cuda")
    return {"kernel": "timing_floor", "one_call_per_replay_us": round(bench_ms(lambda: tiny.add_(1)) * 1e3, 2),
            "back_to_back_us": round(stream_ms([lambda: tiny.add_(1)], rounds=64) * 1e3, 2)}  # fmt: skip
