"""The learner's training step on one GPU: wall time per `trainer=sft` update and how much of it the GPU
is busy, for issue-sized `small` batches.

    python3 bench/learner_gpu.py --flavor small --impl triton --seq 2048 --docs 1 --steps 5
    PYTHONPATH=<other checkout> python3 bench/learner_gpu.py ...     # the same bench against that tree

Builds the flavor's policy (seeded weights, model.overrides impl=--impl) on cuda and an `rl.learner.Learner`
(DeepSpeed engine, ZeRO 0, the trainer's defaults: Muon compiled, simulated replay on), packs --docs
synthetic demonstrations of --seq tokens (4 assistant turns of 64 tokens each, loss on those), runs
--warmup updates (compiles, allocator, optimiser state), then --steps timed `Learner.train_step` calls, the
last of them under torch.profiler. GPU busy = the union of the profiled kernels' intervals on the device
over the profiled step's wall time (overlapping kernels counted once), so 1.0 means the GPU never waited
for the host; the profiler slows the host's side, so the same kernel time over the unprofiled median step
(`gpu_busy_frac_of_median_step`) is the closer figure for a step as it runs.

JSON lines: {"kind": "step", flavor, impl, tokens, step_s (median), step_s_min, tokens_per_s, gpu_busy_s,
gpu_busy_frac, gpu_busy_frac_of_median_step, kernels (launched in the profiled step), loss, tree}. Not a
kernel benchmark (bench/kernels.py --only step times the model's forward + backward alone).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

# bench/ itself off the path (its kernels.py would shadow the kernels package); run as a script from
# anywhere, or with PYTHONPATH=<tree> against that tree
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
if not os.environ.get("PYTHONPATH"):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import model  # noqa: E402
from model.config import default_tokenizer_fit  # noqa: E402
from rl.actors import build_model, pack_for_learner  # noqa: E402
from rl.config import ModelChoice, TrainerConfig  # noqa: E402
from rl.learner import Learner, ensure_distributed  # noqa: E402
from rl.payloads import Trajectory  # noqa: E402

TURN_TOKENS = 64


def demo_batch(n_docs: int, seq: int, vocab: int, seed: int = 0) -> list[Trajectory]:
    rng = random.Random(seed)
    starts = [seq * k // 5 for k in range(1, 5)]
    out = []
    for _ in range(n_docs):
        ids = [rng.randrange(100, vocab) for _ in range(seq)]
        mask = [False] * seq
        for s in starts:
            mask[s : s + TURN_TOKENS] = [True] * TURN_TOKENS
        out.append(Trajectory(token_ids=ids, loss_mask=mask, logprobs=[float("nan")] * seq, versions=[-1] * seq,
                              turn_starts=starts, demo=True))  # fmt: skip
    return out


def busy_seconds(prof) -> tuple[float, int]:
    """(seconds covered by at least one device kernel, kernels) of a profile."""
    spans = sorted(
        (e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start
    )
    total, cur_s, cur_e = 0, None, None
    for s, e in spans:
        if cur_e is None or s > cur_e:
            total += 0 if cur_e is None else cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    total += 0 if cur_e is None else cur_e - cur_s
    return total / 1e6, len(spans)  # profiler times are microseconds


def run(a) -> dict:
    torch.manual_seed(0)
    # the jobs' default tokenizer (conf/model/small.yaml does the same)
    overrides = {"impl": a.impl, **(default_tokenizer_fit() if a.flavor != "tiny" else {})}
    policy, _ = build_model(ModelChoice(flavor=a.flavor, overrides=overrides))
    policy = policy.cuda()
    cfg = TrainerConfig(kind="sft", micro_batch_tokens=a.seq, global_batch_tokens=a.seq * a.docs)
    learner = Learner(policy, cfg)
    batches = pack_for_learner(demo_batch(a.docs, a.seq, policy.args.vocab_size), cfg)
    n_tok = sum(int((b.doc_ids >= 0).sum()) for b in batches)
    for _ in range(a.warmup):
        learner.train_step(batches, "sft")
    torch.cuda.synchronize()
    times, loss = [], None
    for i in range(a.steps):
        last = i == a.steps - 1
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                  torch.profiler.ProfilerActivity.CUDA]) if last else None  # fmt: skip
        if prof is not None:
            prof.__enter__()
        t = time.perf_counter()
        metrics = learner.train_step(batches, "sft")
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        if prof is not None:
            prof.__exit__(None, None, None)
            busy, kernels = busy_seconds(prof)
        loss = metrics["loss"] if loss is None else loss
    med = statistics.median(times[:-1] or times)  # the profiled step runs slower: not in the median
    return {
        "kind": "step", "flavor": a.flavor, "impl": a.impl, "docs": a.docs, "seq": a.seq, "tokens": n_tok,
        "step_s": round(med, 4), "step_s_min": round(min(times), 4), "tokens_per_s": round(n_tok / med, 1),
        "profiled_step_s": round(times[-1], 4), "gpu_busy_s": round(busy, 4),
        "gpu_busy_frac": round(busy / times[-1], 3), "gpu_busy_frac_of_median_step": round(busy / med, 3),
        "kernels": kernels, "loss": loss,
        "tree": str(Path(model.__file__).resolve().parents[1]), "torch": torch.__version__,
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--flavor", default="small")
    p.add_argument("--impl", default="triton", choices=["torch", "triton"])
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--docs", type=int, default=1)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/learner_gpu.py needs a CUDA GPU (bench/learner_cpu.py is the CPU one)")
    ensure_distributed()
    print(json.dumps(run(a)), flush=True)


if __name__ == "__main__":
    main()
