"""The learner's training step on CPU: tokens/s of `trainer=sft` steps of the demo's policy (`tiny_demo`).

    OMP_NUM_THREADS=1 python -m bench.learner_cpu                        # the full grid (minutes)
    OMP_NUM_THREADS=1 python -m bench.learner_cpu --threads 1 --micro-batch-tokens 1024 --replay on

Each configuration builds the policy (model.overrides of conf/model/tiny_demo.yaml, seeded weights) and a
`rl.learner.Learner` (DeepSpeed engine, ZeRO 0, Muon without torch.compile), packs the same synthetic SFT
batch (4 demonstrations of 970 tokens, 4 generation turns of 22 tokens each, as the demo's agent
transcripts: long prompts, few trained tokens) with `rl.actors.pack_for_learner`, runs one warm-up step and
then --steps timed `Learner.train_step` calls. The run's baseline is the base commit's tree: the same
command with PYTHONPATH at that checkout (docs/learner_throughput.md), since every replaced path is deleted.

JSON lines, one per configuration (threads x micro_batch_tokens x simulate_replay):
  {"kind": "step", ...}  tokens/s (real tokens of the batch / median step seconds), tokens per CPU second
      (process CPU time / threads: steadier than wall time on a shared machine), step seconds (median,
      min), the forward / DSpark term / backward wall seconds of the first micro-batch (median, after
      the timed steps, no optimiser step), and the loss of the first timed step (the second update
      from the same seeded weights and batch: equal losses across trees say the semantics held).
      Then the step's phases, each a median over --steps further updates, wall and CPU seconds (CPU /
      threads): `grads` (Learner.accumulate_grads: every micro-batch's forward and backward, metrics),
      `clip` (per-family gradient clipping), `optimizer` (the DeepSpeed engine's step: FamilyOptimizer
      and the engine's bookkeeping); the fixed, per-update cost is clip + optimizer.
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

if not os.environ.get("PYTHONPATH"):  # run as a script from anywhere; PYTHONPATH=<tree> benches that tree
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import model  # noqa: E402
from rl.actors import build_model, pack_for_learner  # noqa: E402
from rl.config import ModelChoice, TrainerConfig  # noqa: E402
from rl.learner import Learner, dspark_term, ensure_distributed  # noqa: E402
from rl.losses import sft_loss  # noqa: E402
from rl.payloads import Trajectory  # noqa: E402

DEMO_MODEL = {"n_layers": 4, "hc_mult": 2, "index_source_layers": [1, 2, 3]}  # conf/model/tiny_demo.yaml
DOC_TOKENS, TURN_STARTS, TURN_TOKENS, N_DOCS = 970, (700, 800, 880, 940), 22, 4


def demo_batch(seed: int = 0) -> list[Trajectory]:
    rng = random.Random(seed)
    out = []
    for _ in range(N_DOCS):
        ids = [rng.randrange(100, 4000) for _ in range(DOC_TOKENS)]
        mask = [False] * DOC_TOKENS
        for s in TURN_STARTS:
            mask[s : s + TURN_TOKENS] = [True] * TURN_TOKENS
        out.append(Trajectory(token_ids=ids, loss_mask=mask, logprobs=[float("nan")] * DOC_TOKENS,
                              versions=[-1] * DOC_TOKENS, turn_starts=list(TURN_STARTS), demo=True))  # fmt: skip
    return out


def _split(learner: Learner, mb) -> tuple[float, float, float]:
    """(forward, DSpark term, backward) seconds of one micro-batch's SFT loss; gradients are dropped."""
    t0 = time.perf_counter()
    out = learner.forward(mb)
    t1 = time.perf_counter()
    ds = dspark_term(learner.model, out, mb)
    t2 = time.perf_counter()
    loss = sft_loss(out.logits, mb.input_ids, mb.loss_mask, mb.loss_mask.sum()) + out.indexer_loss
    (loss if ds is None else loss + ds.loss).backward()
    t3 = time.perf_counter()
    learner.model.zero_grad(set_to_none=True)
    return t1 - t0, t2 - t1, t3 - t2


def _phases(learner: Learner, batches, threads: int) -> dict[str, tuple[float, float]]:
    """{phase: (wall s, CPU s / threads)} of one update, phase by phase as Learner.train_step runs them."""
    out = {}

    def timed(name, fn, *args):
        t, c = time.perf_counter(), time.process_time()
        result = fn(*args)
        out[name] = (time.perf_counter() - t, (time.process_time() - c) / threads)
        return result

    _, counts = timed("grads", learner.accumulate_grads, batches, "sft")
    timed("clip", learner._clip_by_family)
    timed("optimizer", learner.engine.step)
    learner._update_expert_biases(counts)
    learner.step += 1
    return out


def run(threads: int, micro_batch_tokens: int, replay: bool, steps: int) -> dict:
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    policy, _ = build_model(ModelChoice(flavor="tiny", overrides=dict(DEMO_MODEL)))
    cfg = TrainerConfig(kind="sft", simulate_replay=replay, micro_batch_tokens=micro_batch_tokens,
                        global_batch_tokens=micro_batch_tokens * N_DOCS)  # fmt: skip
    cfg.optim.compile_muon = False
    learner = Learner(policy, cfg)
    batches = pack_for_learner(demo_batch(), cfg)
    n_tok = sum(int((b.doc_ids >= 0).sum()) for b in batches)
    learner.train_step(batches, "sft")  # warm-up (allocator, optimiser state)
    times, cpu, loss = [], [], None
    for _ in range(steps):
        t, c = time.perf_counter(), time.process_time()
        metrics = learner.train_step(batches, "sft")
        times.append(time.perf_counter() - t)
        cpu.append((time.process_time() - c) / threads)
        loss = metrics["loss"] if loss is None else loss
    med, med_cpu = statistics.median(times), statistics.median(cpu)
    splits = [_split(learner, batches[0]) for _ in range(steps)]
    fwd, ds, bwd = (statistics.median(s[i] for s in splits) for i in range(3))
    phases = [_phases(learner, batches, threads) for _ in range(steps)]
    phase_s = {
        f"{name}_{kind}": round(statistics.median(p[name][i] for p in phases), 3)
        for name in phases[0]
        for i, kind in enumerate(("s", "cpu_s"))
    }
    return {
        "kind": "step", "threads": threads, "micro_batch_tokens": micro_batch_tokens, "simulate_replay": replay,
        "micro_batches": len(batches), "tokens": n_tok, "tokens_per_s": round(n_tok / med, 1),
        "tokens_per_cpu_s": round(n_tok / med_cpu, 1), "step_s": round(med, 3), "step_s_min": round(min(times), 3),
        "step_cpu_s": round(med_cpu, 3), "forward_s": round(fwd, 3),
        "dspark_s": round(ds, 3), "backward_s": round(bwd, 3), **phase_s, "loss": loss,
        "tree": str(Path(model.__file__).resolve().parents[1]), "torch": torch.__version__,
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--micro-batch-tokens", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--replay", choices=["on", "off"], nargs="+", default=["on", "off"])
    p.add_argument("--steps", type=int, default=3)
    a = p.parse_args()
    ensure_distributed()
    for threads in a.threads:
        for mbt in a.micro_batch_tokens:
            for replay in a.replay:
                print(json.dumps(run(threads, mbt, replay == "on", a.steps)), flush=True)


if __name__ == "__main__":
    main()
