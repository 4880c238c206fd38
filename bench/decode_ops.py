"""How many ops one ragged decode step runs, by part: what a compiled decode step compiles (every layer,
the attention layout, the head, the n-gram hash of the new tokens: model/ragged_cache.py compile_decode,
compile_step_hashes) and what stays eager around them (embedding, rope gathers, the forward's own
indexing). Eager, each op is one kernel launch on CUDA, so the parts outside the layers are kernels a
step saves once they are compiled; the whole step's count is the reference the parts add up to.

    python -m bench.decode_ops --flavor small --sessions 64

Sessions (random weights, seeded prompts of mixed lengths) are prefilled by an InferenceEngine on the
CPU; their caches become one RaggedBatch and one eager decode step is counted under a TorchDispatchMode
(aten ops that are not views). JSON lines {flavor, impl, sessions, prompt_lens, ops: {layers, layout,
ngram_hash, head, rest}, total, outside_layers, compiled_outside_layers}. Not here: kernel times
(bench/engine_throughput.py --profile), the compiled step's own kernels (inductor fuses on the device).
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from bench.engine_throughput import OVERRIDES, mixed_prompts  # noqa: E402
from bench.model_step import build_model  # noqa: E402
from model.attention import build_ragged_layout  # noqa: E402
from model.config import get_flavor  # noqa: E402
from model.engine import InferenceEngine  # noqa: E402
from model.ragged_cache import RaggedBatch  # noqa: E402
from model.tokenizer import Tokenizer  # noqa: E402
from model.transformer import ragged_head, run_layer  # noqa: E402


class _CountOps(TorchDispatchMode):
    """Non-view aten ops, by the part of the step that ran them (`part`, set by `_tagged`)."""

    def __init__(self):
        super().__init__()
        self.part = "rest"
        self.counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.counts[self.part] += 1
        return func(*args, **(kwargs or {}))


def _tagged(mode: _CountOps, part: str, fn):
    @functools.wraps(fn)
    def run(*args, **kwargs):
        outer, mode.part = mode.part, part
        try:
            return fn(*args, **kwargs)
        finally:
            mode.part = outer

    return run


@torch.inference_mode()
def count(model, prompts: list[list[int]]) -> dict:
    engine = InferenceEngine(model, Tokenizer.default(), max_sessions=len(prompts), device="cpu")
    sids = [engine.start(p) for p in prompts]
    engine.generate(sids, 1, temperature=0.0, stop_ids=())  # prefill, and each session's first token
    hasher = engine.ngram_hasher
    mode = _CountOps()
    forward = functools.partial(model.forward_ragged, layer_fn=_tagged(mode, "layers", run_layer),
                                layout_fn=_tagged(mode, "layout", build_ragged_layout),
                                head_fn=_tagged(mode, "head", ragged_head))  # fmt: skip
    steps = None if hasher is None else _tagged(mode, "ngram_hash", hasher.step_hashes)
    caches = [engine.cache(s) for s in sids]
    batch = RaggedBatch(model, caches, max(map(len, prompts)) + 64, forward=forward, hasher=hasher, step_hashes=steps)
    ids = [engine.tokens(s)[-1] for s in sids]
    with mode:
        batch.decode(ids)
    ops = {k: mode.counts.get(k, 0) for k in ("layers", "layout", "ngram_hash", "head", "rest")}
    lens = [len(p) for p in prompts]
    return {"sessions": len(prompts), "prompt_lens": [min(lens), max(lens)], "ops": ops, "total": sum(ops.values()),
            "outside_layers": sum(ops.values()) - ops["layers"],
            "compiled_outside_layers": ops["layout"] + ops["ngram_hash"] + ops["head"]}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavor", default="small", choices=("debug", "tiny", "small"))
    p.add_argument("--impl", default="torch", choices=("torch", "triton"))
    p.add_argument("--sessions", type=int, nargs="+", default=[64])
    p.add_argument("--prompt-lens", type=int, nargs=2, default=[20, 60], metavar=("LO", "HI"))
    a = p.parse_args()
    args = get_flavor(a.flavor, impl=a.impl, **OVERRIDES.get(a.flavor, {}))
    model = build_model(args, torch.device("cpu"))
    for n in a.sessions:
        row = count(model, mixed_prompts(args, n, *a.prompt_lens, seed=n))
        print(json.dumps({"flavor": a.flavor, "impl": a.impl, **row}), flush=True)


if __name__ == "__main__":
    main()
