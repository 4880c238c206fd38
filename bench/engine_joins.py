"""What a session joining a running decode batch costs the host: `RaggedBatch.extend` (the new rows copied
in after the batch's own) against what a join did before it (every row's cache split out of the batch and
the batch rebuilt with the joiner), side by side in one process.

    python -m bench.engine_joins --device cpu --flavor tiny --sessions 16 64 --prompt-lens 900 1200

Sessions (random weights, seeded prompts of mixed lengths) are prefilled by an InferenceEngine; a batch
of all but --joiners of them is built, then timed: extend by the joiners, and split + rebuild with them
(each --reps times, the median kept; device work synchronised). On CUDA the batches live on a GraphPool's
storage as the engine's graph batches do (extend then writes the new rows into its padding rows; no graph
is captured here). JSON lines {sessions, joiners, flavor,
device, prompt_lens, extend_ms, split_rebuild_ms, fields (cache tensors a batch holds)}. Not here: the
decode steps themselves (bench/engine_throughput.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

import torch  # noqa: E402

from bench.engine_throughput import OVERRIDES, _sync, mixed_prompts  # noqa: E402
from bench.model_step import build_model  # noqa: E402
from model.config import get_flavor  # noqa: E402
from model.engine import InferenceEngine  # noqa: E402
from model.ragged_cache import GraphPool, RaggedBatch  # noqa: E402
from model.tokenizer import Tokenizer  # noqa: E402


def _timed(fn, device: torch.device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def run(model, device, prompts: list[list[int]], joiners: int, reps: int) -> dict:
    engine = InferenceEngine(model, Tokenizer.default(), max_sessions=len(prompts), device=device)
    sids = [engine.start(p) for p in prompts]
    engine.prefill(sids)
    caches = [engine.cache(s) for s in sids]
    stay, join = caches[:-joiners], caches[-joiners:]
    max_tokens = max(map(len, prompts)) + 64
    hasher = model.engram_hasher
    pool = GraphPool() if device.type == "cuda" else None

    def batch(rows):
        with torch.inference_mode(pool is None):  # as the engine makes its decode batches
            return RaggedBatch(model, rows, max_tokens, pool=pool, hasher=hasher)

    def extend_ms() -> float:
        b, done = batch(stay), []
        t = _timed(lambda: done.append(b.extend(join)), device)
        if not done[0]:  # on graph storage: more rows than the bucket of the batch's own rows holds
            raise SystemExit(f"{len(join)} joiners do not fit the storage of a {len(stay)}-row batch: pick --sessions "
                             f"and --joiners that stay inside one bucket (model/ragged_cache.py GRAPH_BUCKETS)")
        b.split()  # frees its storage for the next batch of its layout
        return t

    def split_rebuild_ms() -> float:
        b, out = batch(stay), []
        t = _timed(lambda: out.append(batch(b.split() + join)), device)
        out[0].split()
        return t

    times = {"extend": [], "split_rebuild": []}
    for _ in range(reps):  # alternated: a slow spell of the machine costs both
        times["extend"].append(extend_ms())
        times["split_rebuild"].append(split_rebuild_ms())
    lens = [len(p) for p in prompts]
    return {"sessions": len(prompts), "joiners": joiners, "device": str(device), "prompt_lens": [min(lens), max(lens)],
            "extend_ms": round(statistics.median(times["extend"]) * 1e3, 3),
            "split_rebuild_ms": round(statistics.median(times["split_rebuild"]) * 1e3, 3),
            "fields": len(batch(stay).fields())}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--flavor", default="tiny", choices=("debug", "tiny", "small"))
    p.add_argument("--impl", default="torch", choices=("torch", "triton"))
    p.add_argument("--sessions", type=int, nargs="+", default=[16, 64])
    p.add_argument("--joiners", type=int, default=1)
    p.add_argument("--prompt-lens", type=int, nargs=2, default=[900, 1200], metavar=("LO", "HI"))
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    args = get_flavor(a.flavor, impl=a.impl, **OVERRIDES.get(a.flavor, {}))
    model = build_model(args, device)
    for n in a.sessions:
        if n <= a.joiners:
            raise SystemExit(f"--sessions {n} must exceed --joiners {a.joiners}")
        prompts = mixed_prompts(args, n, *a.prompt_lens, seed=n)
        row = run(model, device, prompts, a.joiners, a.reps)
        print(json.dumps({**row, "flavor": a.flavor, "impl": a.impl}), flush=True)


if __name__ == "__main__":
    main()
