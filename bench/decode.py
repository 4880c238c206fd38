"""Plain (non-speculative) prefill and decode throughput through `model.engine.InferenceEngine`.

    python bench/decode.py                                   # debug and tiny on CPU, batch 1 and 4
    python bench/decode.py --flavor tiny --batch 8 --prompt-len 256 --new-tokens 64 --threads 2

Prints one JSON line per (flavor, batch): {flavor, device, dtype, batch, prompt_len, new_tokens,
prefill_s, prefill_tokens_per_s, decode_s, decode_ms_per_step, decode_tokens_per_s, forward_calls,
cache_bytes_per_session}. Every batch row is its own session with a prompt of the same length, so
the engine runs them as one batch (its policy, model/engine.py). Prefill = `engine.prefill` of all
prompts; decode = `engine.generate(..., temperature=1, no stop ids)`, sampling and bookkeeping
included, the first token (from the prefill logits) included. Random weights, random prompts.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

import torch  # noqa: E402

from bench.model_step import build_model  # noqa: E402
from model.config import ModelArgs, get_flavor  # noqa: E402
from model.engine import InferenceEngine  # noqa: E402
from model.tokenizer import Tokenizer  # noqa: E402

# (prompt_len, new_tokens) per flavor; debug runs on the default tokenizer so its Engram can hash
DEFAULTS = {"debug": (64, 32), "tiny": (256, 32), "small": (2048, 128)}
OVERRIDES = {"debug": {"vocab_size": 4096, "engram_compressed_vocab_size": 2742}}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def bench(args: ModelArgs, flavor: str, device: torch.device, batch: int, prompt_len: int, new_tokens: int) -> dict:
    model = build_model(args, device)
    engine = InferenceEngine(model, Tokenizer.default(), max_sessions=batch + 1, device=device,
                             max_seq_len=prompt_len + new_tokens + 8)  # fmt: skip
    g = torch.Generator().manual_seed(0)
    lo = 32 if args.vocab_size > 32 else 0  # no special tokens in the prompts
    # warm-up on a separate session (first-call allocations, rope tables)
    warm = engine.start(torch.randint(lo, args.vocab_size, (prompt_len,), generator=g).tolist())
    engine.generate([warm], 2, temperature=1.0, stop_ids=(), seed=0)
    engine.close(warm)
    sids = [engine.start(torch.randint(lo, args.vocab_size, (prompt_len,), generator=g).tolist()) for _ in range(batch)]
    calls0 = engine.stats["forward_calls"]
    _sync(device)
    t0 = time.perf_counter()
    engine.prefill(sids)
    _sync(device)
    t1 = time.perf_counter()
    outs = engine.generate(sids, new_tokens, temperature=1.0, stop_ids=(), seed=1)
    _sync(device)
    t2 = time.perf_counter()
    n_new = sum(len(o.token_ids) for o in outs)
    return {
        "flavor": flavor,
        "device": str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
        "dtype": str(model.embed.weight.dtype).removeprefix("torch."),
        "batch": batch,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "prefill_s": round(t1 - t0, 4),
        "prefill_tokens_per_s": round(batch * prompt_len / (t1 - t0), 1),
        "decode_s": round(t2 - t1, 4),
        "decode_ms_per_step": round((t2 - t1) / new_tokens * 1e3, 2),
        "decode_tokens_per_s": round(n_new / (t2 - t1), 1),
        "forward_calls": engine.stats["forward_calls"] - calls0,
        "cache_bytes_per_session": engine.cache_bytes(sids[0]),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--flavor", action="append", choices=sorted(DEFAULTS), help="repeatable")
    p.add_argument("--batch", type=int, action="append", help="repeatable (default: 1 and 4)")
    p.add_argument("--prompt-len", type=int)
    p.add_argument("--new-tokens", type=int)
    p.add_argument("--device", default=None, help="cpu / cuda (default: cpu for debug/tiny, cuda for small)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ns = p.parse_args(argv)
    if ns.threads:
        torch.set_num_threads(ns.threads)
    flavors = ns.flavor or ["debug", "tiny"]
    for flavor in flavors:
        device = torch.device(ns.device or ("cuda" if flavor == "small" else "cpu"))
        prompt_len, new_tokens = DEFAULTS[flavor]
        args = get_flavor(flavor, **OVERRIDES.get(flavor, {}))
        for batch in ns.batch or [1, 4]:
            row = bench(args, flavor, device, batch, ns.prompt_len or prompt_len, ns.new_tokens or new_tokens)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
