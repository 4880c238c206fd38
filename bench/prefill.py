"""CED prefill (decoder bounded replay, model/ced.py) vs full-stack prefill: wall time and the work proxy.

    python -m bench.prefill                                           # tiny on CPU at 256, 512, 1024
    python -m bench.prefill --flavor small --device cuda               # 1K, 4K, 16K on one H200 (bf16)
    python -m bench.prefill --flavor tiny --lengths 256 1024 4096 --threads 2

One JSON line per prompt length: {flavor, device, dtype, impl, n, chunk, full_s, ced_s, time_ratio (ced / full),
work_ratio, decoder_tokens_ced, loadavg}. Both paths consume the same random prompt from an empty
cache in chunks of --chunk through `encode_incremental` and compute the head at the last position
only; `full_s` / `ced_s` are the best of --repeats runs after one warm-up. work_ratio is the layer-token
proxy (n_enc N + n_dec min(N, W)) / (n_layers N), for the released 40 layers (20N + 20 min(N,128)) / 40N;
it ignores that attention per token grows with N, the head and the embedding. Lengths beyond the
flavor's max_seq_len raise it for the run (RoPE tables are computed for any length). Random weights.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

import torch  # noqa: E402

from bench.model_step import build_model, random_engram_inputs  # noqa: E402
from model.ced import ced_prefill, decoder_work, full_prefill  # noqa: E402
from model.config import get_flavor  # noqa: E402
from model.transformer import ModelCache  # noqa: E402

DEFAULT_LENGTHS = {"debug": [64, 256], "tiny": [256, 512, 1024], "small": [1024, 4096, 16384]}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def bench_length(model, n: int, chunk: int, repeats: int, device: torch.device) -> dict:
    a = model.args
    ids = torch.randint(0, a.vocab_size, (1, n), device=device)

    def engram(pos: int, chunk_ids: torch.Tensor) -> dict | None:
        return random_engram_inputs(a, 1, chunk_ids.size(1), device)

    def run(fn) -> tuple[float, int]:
        best, n_dec = float("inf"), 0
        for _ in range(repeats + 1):  # the first run warms up
            cache = ModelCache(encoder_out_len=a.window_size)
            _sync(device)
            t0 = time.perf_counter()
            _, _, n_dec = fn(model, ids, 0, cache, chunk=chunk, engram_inputs=engram)
            _sync(device)
            best = min(best, time.perf_counter() - t0)
            del cache
        return best, n_dec

    full_s, _ = run(full_prefill)
    ced_s, n_dec = run(ced_prefill)
    work = decoder_work(n, a.window_size, a.n_encoder_layers, a.n_layers - a.n_encoder_layers)
    return {
        "n": n,
        "chunk": chunk,
        "full_s": round(full_s, 4),
        "ced_s": round(ced_s, 4),
        "time_ratio": round(ced_s / full_s, 4),
        "work_ratio": round(work["ratio"], 4),
        "decoder_tokens_ced": n_dec,
        "loadavg": [round(x, 2) for x in os.getloadavg()],
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavor", default="tiny", choices=sorted(DEFAULT_LENGTHS))
    p.add_argument("--device", default="cpu")
    p.add_argument("--lengths", type=int, nargs="+", default=None)
    p.add_argument("--chunk", type=int, default=2048, help="prefill chunk (tokens per encoder call)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--impl", choices=("torch", "triton"), default=None, help="kernels (default: triton on cuda)")
    opts = p.parse_args(argv)
    if opts.threads:
        torch.set_num_threads(opts.threads)
    device = torch.device(opts.device)
    lengths = opts.lengths or DEFAULT_LENGTHS[opts.flavor]
    impl = opts.impl or ("triton" if device.type == "cuda" else "torch")
    args = get_flavor(opts.flavor, impl=impl, max_seq_len=max(max(lengths), get_flavor(opts.flavor).max_seq_len))
    model = build_model(args, device).eval()
    dtype = str(model.embed.weight.dtype).removeprefix("torch.")
    head = {"flavor": opts.flavor, "device": str(device), "dtype": dtype, "impl": impl}
    head["threads"] = torch.get_num_threads()
    for n in lengths:
        print(json.dumps({**head, **bench_length(model, n, opts.chunk, opts.repeats, device)}), flush=True)


if __name__ == "__main__":
    main()
