"""Rollout-engine decode throughput with mixed prompt lengths, against its memory floor and a peer.

    python -m bench.engine_throughput --device cpu --flavor debug --quick      # the CPU check a test runs
    python -m bench.engine_throughput --device cpu --flavor tiny --sessions 1 16 --prefill-mode both
    python -m bench.engine_throughput --device cpu --flavor tiny --sessions 1 16 64
    python -m bench.engine_throughput --device cuda --flavor small --impl triton  # 1, 16, 64, 256 sessions

One JSON line per (engine, sessions), one process. Every session has its own prompt, lengths drawn
uniformly from [--min-prompt, --max-prompt] (seeded), random weights and prompt ids. After
a warm-up (the same prompts in sessions of their own, through the same calls: the same batch bucket
and bank sizes, so on CUDA every graph the timed call replays is captured, and compiled, there),
`engine.prefill` (timed) and one token drawn from its logits, then the timed `generate(..., 1)` and
`generate(..., new_tokens)` (no stop ids, T = --temperature, default 1: a rollout's draw; 0 greedy): its
sessions lack only their newest token, so every token costs one decode step, sampling and bookkeeping
included, and the decode time is the difference of the two calls over new_tokens - 1 steps, as the
baseline's is (a call's own set-up, building the batch from its sessions and splitting the tokens back,
is then in neither; call_ms says what it is). --repeats runs (default 3)
of fresh sessions each: a row reports the run of median decode time, and every run's ms_per_step in
ms_per_step_runs (one run's step varied by up to a fifth between processes on one GPU). Rows {engine: "flashpost",
cuda_graphs, compile_decode (the inductor-compiled decode step, --compile; its compiles fall in
warmup_s), overlap_decode (each decode step launched from the last step's sampled tokens before the
host reads them, --overlap; on by default with graphs), prefill_mode (full-stack
or CED prefill, --prefill-mode; a CED prefill counts as one forward), packed_cache (live caches as
packed bytes, the rollout workers' default, --packed-cache), flavor, device, impl,
sessions, prompt_lens (min, max, distinct), new_tokens, prefill_s, prefill_forwards, warmup_s,
graph_captures, temperature, decode_s, decode_tokens_per_s, ms_per_step, call_ms (a call's time beyond its
steps), forwards_per_decode_step (model calls
per decode step), bytes_per_step (weights a decode step touches at this batch + every session's
cache, packed format), copy_gb_per_s (a device copy measured in this run) and floor_ms_per_step =
bytes / copy rate}. On CUDA both the graph and the eager engine run (--cuda-graphs); graph engines
compile their decode layers as the engine does by default (--compile off: uncompiled graph engines,
--compile both: the two side by side, the uncompiled first; a compile that fails is an "error" row);
--quick runs both prefill modes. A compiled engine's row adds what dynamo did for it: graph_breaks, compiled_graphs,
compiled_frames (frames compiled: one per kind of layer and batch shape) and compile_s (seconds in
dynamo and inductor, which fall in warm-up). On CPU, --compile applies to the eager engine.
With `transformers` importable (and not --quick), a row {engine: "hf_generate", ...} per session
count and temperature, after that count's engine rows: one dense Llama-style model of about the same
active parameters (random weights, the same prompts left-padded, static cache, whose decode step
transformers compiles; --hf-new-tokens new tokens forced with min_new_tokens, after a warm-up generate of the
same length; --repeats runs too; greedy at --temperature 0, else sampled at it from the whole vocabulary, no
top-k or top-p, as the engine draws).
With --spec-cost, a row {engine: "speculation_cost", sessions, t_verify_ms (k = 0..K), t_draft_ms,
t_plain_ms (the engine's plain decode step, CUDA graphs on CUDA), break_even (tokens a speculative
step of each k must emit to match it), best_speedup (every draft accepted), speculation_on (what
`generate_speculative` decides)} per session count: the cost model of model/speculative.py.
With --profile, after each engine row a row {engine: "profile", sessions, cuda_graphs, compile_decode,
steps, wall_ms_per_step, kernel_busy_ms_per_step (the union of the device kernels' intervals: what
the device did), kernels_per_step, top_kernels [name, ms per step, calls per step], top_host
[function, own ms per step, calls per step] (cProfile over the same steps, run again without the
device profiler)}: where a decode step's time goes, device or host.
Not here: speculative decoding itself (bench/decode.py --speculative), prefill throughput (bench/prefill.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

import torch  # noqa: E402

from bench.model_step import build_model  # noqa: E402
from model.accounting import active_params  # noqa: E402
from model.config import ModelArgs, default_tokenizer_fit, get_flavor  # noqa: E402
from model.engine import InferenceEngine  # noqa: E402
from model.speculative import SpeculativeConfig  # noqa: E402
from model.tokenizer import Tokenizer  # noqa: E402

# (min prompt, max prompt, new tokens) per flavor; --quick shrinks them
DEFAULTS = {"debug": (8, 48, 16), "tiny": (32, 256, 32), "small": (256, 2047, 128)}
QUICK = {"sessions": (1, 4), "lens": (5, 20), "new_tokens": 6}
PROFILE_STEPS, PROFILE_TOP = 8, 25  # --profile: decode steps profiled, functions and kernels listed
OVERRIDES = {f: default_tokenizer_fit() for f in ("debug", "small")}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def mixed_prompts(args: ModelArgs, n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(32, args.vocab_size, (m,), generator=g).tolist() for m in lens]


def copy_gb_per_s(device: torch.device) -> float:
    """Device copy rate (read + write counted once each), measured now."""
    n = (256 if device.type == "cuda" else 32) * 2**20
    src, dst = torch.empty(n, dtype=torch.uint8, device=device), torch.empty(n, dtype=torch.uint8, device=device)
    dst.copy_(src)
    _sync(device)
    reps, t0 = 10, time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    _sync(device)
    return 2 * n * reps / (time.perf_counter() - t0) / 1e9


def decode_bytes(args: ModelArgs, model, engine: InferenceEngine, sids: list[int]) -> int:
    """Bytes one decode step reads: the weights touched (active experts per token, all of them once
    the batch reaches every expert) and the sessions' caches (packed size)."""
    itemsize = model.embed.weight.element_size()
    act = {k: v for k, v in active_params(args, "decode").items() if k not in ("total", "backbone")}
    experts = act.get("routed_experts", 0)
    touched = min(experts * len(sids), experts * args.n_routed_experts // args.n_activated_experts)
    weights = (sum(act.values()) - experts + touched) * itemsize
    cache = sum(sum(engine.cache_bytes(s).values()) for s in sids)
    return int(weights + cache)


def dynamo_totals() -> dict:
    """What dynamo has done in this process so far (cumulative: rows take differences)."""
    from torch._dynamo.utils import compilation_time_metrics, counters

    return {"graph_breaks": sum(counters["graph_break"].values()),
            "compiled_graphs": counters["stats"].get("unique_graphs", 0),
            "compiled_frames": counters["frames"].get("ok", 0),
            "compile_s": sum(compilation_time_metrics.get("_compile.compile_inner", []))}  # fmt: skip


def run_engine(args, flavor, device, model, prompts, new_tokens, copy_rate, graphs: bool, prefill_mode: str,
               compiled: bool | None = None, packed: bool = False, profile: list | None = None,
               overlap: bool | None = None, repeats: int = 1, temperature: float = 1.0) -> dict:  # fmt: skip
    n, T = len(prompts), temperature
    before = dynamo_totals()
    engine = InferenceEngine(model, Tokenizer.default(), max_sessions=n + 1, device=device, cuda_graphs=graphs,
                             max_seq_len=max(map(len, prompts)) + new_tokens + 2 * PROFILE_STEPS + 8,
                             prefill_mode=prefill_mode, compile_decode=compiled, packed_cache=packed,
                             overlap_decode=overlap)  # fmt: skip
    compiled = engine._decode_forward is not None  # None above: the engine's own choice
    # warm-up: sessions of the same prompts, through the same calls as the timed ones: a decode batch's
    # banks are sized from its longest row plus the call's new tokens (ragged_cache.bank_tokens'
    # rungs), so a shorter warm-up could size them differently and leave the timed call to capture its
    # graphs, and a compiled engine to compile every kind of layer again, inside the measurement
    _sync(device)
    tw = time.perf_counter()
    warm = [engine.start(p) for p in prompts]
    for k in (1, 1, new_tokens):  # the timed calls' sizes: the draw from the prefill, one step, new_tokens steps
        engine.generate(warm, k, temperature=T, stop_ids=(), seed=0)
    for sid in warm:
        engine.close(sid)
    _sync(device)
    t1w = time.perf_counter()
    runs, sids = [], []  # (prefill s, decode s, tokens, forwards, call s) of each timed run
    for _ in range(repeats):  # fresh sessions of the same prompts each run: the same batch and bank sizes
        for sid in sids:
            engine.close(sid)
        sids = [engine.start(p) for p in prompts]
        calls_p = engine.stats["forward_calls"]
        t0 = time.perf_counter()
        engine.prefill(sids)
        _sync(device)
        t1 = time.perf_counter()
        prefill_forwards = engine.stats["forward_calls"] - calls_p
        # one token drawn from the prefill's logits (no forward): the timed call's sessions then lack only
        # their newest token, and each of its tokens costs one decode step
        engine.generate(sids, 1, temperature=T, stop_ids=(), seed=1)
        # a call of one decode step, then one of new_tokens: the decode time is their difference, over
        # new_tokens - 1 steps, so a call's own set-up (the batch built from the sessions, the tokens split
        # back to them) counts once in neither, as the baseline's generate(n) - generate(1) does
        elapsed = []
        for k in (1, new_tokens):
            calls0 = engine.stats["forward_calls"]
            _sync(device)
            t2 = time.perf_counter()
            outs = engine.generate(sids, k, temperature=T, stop_ids=(), seed=1)
            _sync(device)
            elapsed.append(time.perf_counter() - t2)
        decode_s = elapsed[1] - elapsed[0]
        step_s = decode_s / (new_tokens - 1)
        runs.append((t1 - t0, decode_s, sum(len(o.token_ids) for o in outs) - len(outs),
                     engine.stats["forward_calls"] - calls0, elapsed[0] - step_s))
    prefill_s, decode_s, tokens, forwards, call_s = sorted(runs, key=lambda r: r[1])[len(runs) // 2]  # the median
    nbytes = decode_bytes(args, model, engine, sids)
    lens = [len(p) for p in prompts]
    dyn = {k: round(v - before[k], 2) for k, v in dynamo_totals().items()} if compiled else {}
    if profile is not None:  # after every counter of the row is read
        profile.append(profile_steps(engine, sids, device, T))
    return {
        "engine": "flashpost", "cuda_graphs": graphs, "compile_decode": compiled,
        "overlap_decode": engine.overlap_decode, "prefill_mode": prefill_mode,
        "packed_cache": packed, "flavor": flavor,
        "device": _device_name(device), "impl": args.impl, "sessions": n,
        "prompt_lens": [min(lens), max(lens), len(set(lens))],
        "new_tokens": new_tokens, "prefill_s": round(prefill_s, 4), "prefill_forwards": prefill_forwards,
        "warmup_s": round(t1w - tw, 4), "graph_captures": engine.graphs.captures if engine.graphs else 0,
        "temperature": T, "decode_s": round(decode_s, 4), "decode_tokens_per_s": round(tokens / decode_s, 1),
        "ms_per_step": round(decode_s / (new_tokens - 1) * 1e3, 3),
        "ms_per_step_runs": [round(r[1] / (new_tokens - 1) * 1e3, 3) for r in runs],
        "call_ms": round(call_s * 1e3, 3),
        "forwards_per_decode_step": round(forwards / new_tokens, 3),
        "bytes_per_step": nbytes, "copy_gb_per_s": round(copy_rate, 1),
        "floor_ms_per_step": round(nbytes / (copy_rate * 1e9) * 1e3, 4), **dyn,
    }  # fmt: skip


def profile_steps(engine: InferenceEngine, sids: list[int], device: torch.device, temperature: float = 1.0) -> dict:
    """PROFILE_STEPS decode steps under the device profiler (kernel time), then as many under cProfile
    (the host's own time per function)."""
    import cProfile
    import pstats

    from bench.learner_gpu import busy_seconds

    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    _sync(device)
    t0 = time.perf_counter()
    with torch.profiler.profile(activities=acts) as prof:
        engine.generate(sids, PROFILE_STEPS, temperature=temperature, stop_ids=(), seed=2)
        _sync(device)
    wall = time.perf_counter() - t0
    kernels: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start:
            k = kernels.setdefault(e.name[:90], [0.0, 0])
            k[0] += (e.time_range.end - e.time_range.start) / 1e3
            k[1] += 1
    busy_s, n_kernels = busy_seconds(prof) if device.type == "cuda" else (0.0, 0)
    host = cProfile.Profile()
    host.enable()
    engine.generate(sids, PROFILE_STEPS, temperature=temperature, stop_ids=(), seed=3)
    _sync(device)
    host.disable()
    stats = pstats.Stats(host).stats  # (file, line, fn) -> (calls, primitive calls, own s, cumulative s, callers)
    own = sorted(stats.items(), key=lambda kv: -kv[1][2])[:PROFILE_TOP]
    n = PROFILE_STEPS
    return {"engine": "profile", "sessions": len(sids), "cuda_graphs": engine.graphs is not None,
            "compile_decode": engine._decode_forward is not None, "steps": n,
            "wall_ms_per_step": round(wall / n * 1e3, 3), "kernel_busy_ms_per_step": round(busy_s / n * 1e3, 3),
            "kernels_per_step": round(n_kernels / n, 1),
            "top_kernels": [[k, round(v[0] / n, 4), round(v[1] / n, 1)]
                            for k, v in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:PROFILE_TOP]],
            "top_host": [[f"{Path(f).name}:{line}:{fn}", round(v[2] / n * 1e3, 4), round(v[0] / n, 1)]
                         for (f, line, fn), v in own]}  # fmt: skip


def run_spec_cost(model, device, n: int, graphs: bool) -> dict:
    """The speculation cost model of n rows as a speculative engine measures it (the drafter is random:
    acceptance is not measured here, only what it would have to be)."""
    engine = InferenceEngine(model, Tokenizer.default(), max_sessions=n + 1, device=device, cuda_graphs=graphs,
                             speculative=SpeculativeConfig())  # fmt: skip
    cost = engine.speculation_cost(n)
    ms = 1e3
    return {"engine": "speculation_cost", "sessions": n, "cuda_graphs": graphs,
            "t_verify_ms": [round(t * ms, 3) for t in cost.t_verify], "t_draft_ms": round(cost.t_draft * ms, 3),
            "t_plain_ms": round(cost.plain_time * ms, 3), "break_even": [round(x, 2) for x in cost.break_even()],
            "best_speedup": round(cost.best_speedup(), 3),
            "speculation_on": cost.best_speedup() >= engine.speculative.min_speedup}  # fmt: skip


def run_hf(args, device, prompts, new_tokens, repeats: int = 1,
           temperatures: Sequence[float] = (1.0,)) -> list[dict]:
    """transformers `generate` on a dense Llama of about the same active parameters (static cache): one row per
    temperature, drawing as the engine does (greedy at 0, else from the whole distribution at it), one model."""
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as e:
        if isinstance(e, ModuleNotFoundError) and e.name == "transformers":
            return []  # not installed: no baseline rows
        # installed but not importable, e.g. its optional `kernels` resolved to this repository's package
        return [{"engine": "hf_generate", "sessions": len(prompts), "error": f"transformers does not import: {e}"}]
    act = sum(v for k, v in active_params(args, "decode").items() if k not in ("total", "backbone"))
    layers, dim = args.n_layers, args.dim
    inter = max(64, int((act / layers - 4 * dim * dim) / (3 * dim)))  # attention 4 D^2, MLP 3 D I per layer
    cfg = LlamaConfig(vocab_size=args.vocab_size, hidden_size=dim, intermediate_size=inter,
                      num_hidden_layers=layers, num_attention_heads=args.n_heads, num_key_value_heads=args.n_heads,
                      max_position_embeddings=max(map(len, prompts)) + new_tokens + 8, pad_token_id=0)  # fmt: skip
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
    lens = torch.tensor([len(p) for p in prompts], device=device)
    mask = (torch.arange(width, device=device)[None, :] >= (width - lens)[:, None]).long()
    rows, steps, params = [], new_tokens - 1, sum(p.numel() for p in model.parameters())
    for temperature in temperatures:
        draw = ({"do_sample": False} if temperature == 0 else  # no top-k (its default is 50) or top-p: the engine's
                {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0})
        kw = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, **draw,
              "cache_implementation": "static"}  # fmt: skip
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, **kw)  # warm-up: compiles the static-cache step
            model.generate(input_ids=ids, attention_mask=mask, **{**kw, "max_new_tokens": 1, "min_new_tokens": 1})
            runs = []
            for _ in range(repeats):
                times = []
                for n in (1, new_tokens):  # prefill alone, then the whole generate: decode = the difference
                    _sync(device)
                    t0 = time.perf_counter()
                    model.generate(input_ids=ids, attention_mask=mask, **{**kw, "max_new_tokens": n,
                                                                          "min_new_tokens": n})
                    _sync(device)
                    times.append(time.perf_counter() - t0)
                runs.append((times[0], times[1] - times[0]))
        prefill_s, dt = sorted(runs, key=lambda r: r[1])[len(runs) // 2]  # the median run
        rows.append({"engine": "hf_generate", "device": _device_name(device), "sessions": len(prompts),
                     "temperature": temperature, "params": params,
                     "new_tokens": new_tokens, "prefill_s": round(prefill_s, 4), "decode_s": round(dt, 4),
                     "ms_per_step": round(dt / steps * 1e3, 3),
                     "ms_per_step_runs": [round(d / steps * 1e3, 3) for _, d in runs],
                     "decode_tokens_per_s": round(len(prompts) * steps / dt, 1)})  # fmt: skip
    return rows


def _device_name(device: torch.device) -> str:
    return str(device) if device.type == "cpu" else torch.cuda.get_device_name(device)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--flavor", default="debug", choices=sorted(DEFAULTS))
    p.add_argument("--impl", default="torch", choices=("torch", "triton"))
    p.add_argument("--sessions", type=int, nargs="+", default=None, help="default 1 16 64 256")
    p.add_argument("--new-tokens", type=int, default=None)
    p.add_argument("--prompt-lens", type=int, nargs=2, default=None, metavar=("LO", "HI"),
                   help="prompt lengths drawn from [LO, HI] (default per flavor; the demo's are ~900-1200)")
    p.add_argument("--quick", action="store_true", help="1 and 4 sessions, short prompts: a test's check")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    p.add_argument("--hf-new-tokens", type=int, default=None, help="new tokens of the baseline (default: --new-tokens)")
    p.add_argument("--cuda-graphs", default="both", choices=("on", "off", "both", "none"),
                   help="CUDA: the engine with decode graphs, eager, both, or none (baseline only)")  # fmt: skip
    p.add_argument("--compile", default=None, choices=("on", "off", "both"),
                   help="graph engines (CPU: the engine): the compiled decode step, the uncompiled, both "
                        "(default: the engine's own choice, compiled with graphs, uncompiled on CPU)")  # fmt: skip
    p.add_argument("--overlap", default=None, choices=("on", "off", "both"),
                   help="graph engines: decode steps launched before the host reads the last step's tokens, or "
                        "not, or both (default: the engine's own choice, on with graphs)")  # fmt: skip
    p.add_argument("--spec-cost", action="store_true", help="also the speculation cost model per session count")
    p.add_argument("--prefill-mode", default=None, choices=("full", "ced", "both"),
                   help="the engine's prompt prefill (default: full; --quick: both)")  # fmt: skip
    p.add_argument("--packed-cache", default="off", choices=("on", "off", "both"),
                   help="sessions' live caches as packed bytes (the rollout default; QAT models) or dense")  # fmt: skip
    p.add_argument("--temperature", type=float, nargs="+", default=[1.0],
                   help="both engines draw at each temperature given (0: greedy); default 1, a rollout's draw")
    p.add_argument("--profile", action="store_true", help="a row of each engine's device kernels and host functions")
    p.add_argument("--repeats", type=int, default=None,
                   help="timed runs of each row, the median reported (default 3; --quick: 1)")  # fmt: skip
    a = p.parse_args(argv)
    a.repeats = (1 if a.quick else 3) if a.repeats is None else a.repeats
    if a.repeats < 1:
        raise SystemExit(f"--repeats {a.repeats}: give at least 1 timed run")
    if min(a.temperature) < 0:
        raise SystemExit(f"--temperature {a.temperature}: give 0 (greedy) or more")
    if a.threads:
        torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    args = get_flavor(a.flavor, impl=a.impl, **OVERRIDES.get(a.flavor, {}))
    lo, hi, new = DEFAULTS[a.flavor]
    sessions = a.sessions or (1, 16, 64, 256)
    if a.quick:
        (lo, hi), new, sessions = QUICK["lens"], QUICK["new_tokens"], a.sessions or QUICK["sessions"]
    new = a.new_tokens or new
    if new < 2:
        raise SystemExit(f"--new-tokens {new}: the decode time is generate(n) - generate(1), so give at least 2")
    lo, hi = a.prompt_lens or (lo, hi)
    model = build_model(args, device)
    rate = copy_gb_per_s(device)
    modes = {"on": (True,), "off": (False,), "both": (True, False), "none": ()}[a.cuda_graphs]
    modes = modes if device.type == "cuda" else (False,)
    # None: the engine's own choice; "both": the baseline first
    compiles = {None: (None,), "on": (True,), "off": (False,), "both": (False, True)}[a.compile]
    overlaps = {None: (None,), "on": (True,), "off": (False,), "both": (False, True)}[a.overlap]
    engines = [(g, c, o) for g in modes for c in (compiles if g or device.type == "cpu" else (False,))
               for o in (overlaps if g else (None,))]  # fmt: skip
    prefill = a.prefill_mode or ("both" if a.quick else "full")
    prefill_modes = ("full", "ced") if prefill == "both" else (prefill,)
    packs = {"on": (True,), "off": (False,), "both": (False, True)}[a.packed_cache]
    for n in sessions:
        prompts = mixed_prompts(args, n, lo, hi, seed=n)
        for T, (graphs, compiled, overlap) in [(T, e) for T in a.temperature for e in engines]:
            for pm, packed in [(pm, pk) for pm in prefill_modes for pk in packs]:
                prof = [] if a.profile else None
                try:
                    row = run_engine(args, a.flavor, device, model, prompts, new, rate, graphs, pm, compiled, packed,
                                     prof, overlap, a.repeats, T)
                except Exception as e:  # a compile failure is a result too; the other rows still run
                    if not compiled:  # the default path (None) and uncompiled engines fail loudly
                        raise
                    row = {"engine": "flashpost", "cuda_graphs": graphs, "compile_decode": True, "sessions": n,
                           "error": f"{type(e).__name__}: {str(e)[:2000]}"}  # fmt: skip
                print(json.dumps(row), flush=True)
                for extra in prof or ():
                    print(json.dumps(extra), flush=True)
        if a.spec_cost and model.mtp is not None:
            print(json.dumps(run_spec_cost(model, device, n, bool(modes) and modes[0])), flush=True)
        if not (a.quick or a.no_hf):
            for row in run_hf(args, device, prompts, a.hf_new_tokens or new, a.repeats, a.temperature):
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
