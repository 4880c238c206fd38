"""Does RL through rl/rl_loop.py raise the reward? Before/after pass rate on held-out tasks, per seed
(real Ray local instance on 127.0.0.1, DeepSpeed learner, InferenceEngine rollout workers; CPU).

    python -m bench.rl_learning                          # seeds 0 1 2: 20 SFT + 30 RL steps each, `tiny`
    python -m bench.rl_learning --seeds 0 --steps 10     # a quick look

Task family: the toy family of rl/rollout.py (`rollout.env=toy`, one turn): the reply earns reward 1
when it contains the substring the prompt names ('x', 'ing', '(' or 'q'). The starting policy is a
short SFT (rl/sft_loop.py, trainer=sft) of the seeded `tiny` initialisation on demonstrations whose
target is drawn at random, independent of the prompt: it learns the answer format ("Here: xx x.")
but not which target to name, so it solves about a quarter of the tasks, and RL has to learn to read
the prompt. (A fresh initialisation also solves ~25%, by near-uniform tokens, but 8-10 RL steps at
three learning rates did not move it: one relevant token among 16 random ones is little credit.) RL trains on tasks
0..n_tasks-1 from the SFT weights; evaluation uses tasks n_tasks..n_tasks+eval_tasks-1 (same four
targets, prompts never trained on), `eval_samples` episodes per task at the rollout temperature with
fixed seeds (the same draws before and after), through the same episode code
(rl.rollout.run_toy_episode) in this process. Standard error: task-clustered (std of per-task pass
rates / sqrt(tasks)).

Settings (the `add_rl_args` defaults): 32 training tasks, 30 RL steps of 8 groups x 8 at lr 3e-4 /
muon-lr 3e-3, temperature 1.0, max_policy_lag 1. The earlier 8 tasks, 20 steps at lr 1e-3 / muon-lr
1e-2 raised seeds 0 and 1 (0.27 -> 0.76, 0.31 -> 0.68) but not seed 2 (0.34 -> 0.29): its training
reward rose while the policy learned to name one target whatever the prompt (that target's held-out
tasks pass 1.0, the other three 0.03-0.08). Such a policy is stuck under GRPO: nearly every group is
then all-pass or all-fail, has no reward spread and is dropped. (Target balance was not the cause:
group g trains task g mod n_tasks and task i names target i mod 4, so every step sees each target
twice.) The lower rates move the policy slowly enough that groups of every target keep their spread,
and 32 tasks give RL more prompts to generalise from. With them (shared 2-core machine, load 4-8,
31 min for the three seeds): before -> after 0.29 -> 0.49, 0.32 -> 0.75, 0.28 -> 0.64 (se 0.02-0.05
each), every seed up by 3.5-9 combined standard errors. Seed 0 still leans to one target ('q' 0.92, 'x' and
'ing' ~0.27, at their start level), so the rise is not yet uniform across targets. Runs are not
bit-reproducible (asynchronous rollouts with lag 1): seed 2 gave 0.70 in another run of these settings.

One JSON line per seed ({seed, before, after, delta, run_s, ...}), then a summary line (mean before,
mean after, per-seed deltas, their spread) with the load average, since the machine may be shared.
Not here: the RL machinery itself (rl/), the demo (`make demo`, rl/demo.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

import torch  # noqa: E402

from rl.cluster import ClusterConfig, shutdown, start_or_join  # noqa: E402
from rl.config import JobConfig, ModelChoice, OptimConfig, RolloutConfig, TrainerConfig  # noqa: E402
from rl.rl_loop import run_async  # noqa: E402
from rl.rollout import (  # noqa: E402
    TOY_TARGETS,
    RolloutRequest,
    SamplingParams,
    SessionBatcher,
    run_toy_episode,
    toy_tasks,
)

MODEL = ModelChoice(flavor="tiny", overrides={"max_seq_len": 256})


def add_rl_args(p: argparse.ArgumentParser) -> None:
    """The RL settings both RL benches share (defaults: what raised the reward here)."""
    p.add_argument("--sft-steps", type=int, default=20, help="SFT steps of the starting policy")
    p.add_argument("--sft-lr", type=float, default=3e-3)
    p.add_argument("--steps", type=int, default=30, help="learner updates per RL run")
    p.add_argument("--lr", type=float, default=3e-4, help="AdamW and Sinkhorn families (embedding, head, norms)")
    p.add_argument("--muon-lr", type=float, default=3e-3)
    p.add_argument("--temperature", type=float, default=1.0, help="rollout (and evaluation) temperature")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--groups", type=int, default=8, help="GRPO groups per update")
    p.add_argument("--lag", type=int, default=1, help="rollout.max_policy_lag")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--n-tasks", type=int, default=32, help="training tasks of the toy family")
    p.add_argument("--turns", type=int, default=1, help="assistant turns per toy episode (the last one is scored)")


def sft_start(ns: argparse.Namespace, seed: int, run_dir: Path, model: ModelChoice = MODEL) -> Path:
    """The starting policy: `sft_steps` of trainer=sft on format demonstrations with random targets
    (16 per training task). -> its model.safetensors."""
    from rl.actors import build_model
    from rl.sft_loop import demonstrations, run_supervised
    from synth.taskset_sources import toy_messages

    rng = random.Random(seed)
    tasks = [vars(t) for t in toy_tasks(ns.n_tasks, n_turns=ns.turns)]
    _, template = build_model(model)
    shuffled = [{**t, "target": rng.choice(TOY_TARGETS)} for t in tasks for _ in range(16)]
    demos = demonstrations([toy_messages(t) for t in shuffled], [t["task_id"] for t in shuffled], "toy", template)
    optim = OptimConfig(lr=ns.sft_lr, sinkhorn_lr=ns.sft_lr, muon_lr=10 * ns.sft_lr)
    job = JobConfig(model=model, trainer=TrainerConfig(kind="sft", max_steps=ns.sft_steps, batch_size=16, seed=seed,
                                                       micro_batch_tokens=2048, global_batch_tokens=2048,
                                                       checkpoint_every=ns.sft_steps, optim=optim))  # fmt: skip
    run_supervised(job, run_dir, progress=False, ray_metrics=False, demos=demos)
    return final_weights(run_dir)


def rl_job(ns: argparse.Namespace, seed: int, *, dspark_weight: float = 1.0, checkpoint_every: int | None = None,
           grad_clip: float = 1.0, model: ModelChoice = MODEL) -> JobConfig:  # fmt: skip
    """trainer=rl on the toy family, every setting explicit (the bench's conf/trainer/rl.yaml)."""
    from synth.taskset_sources import toy_set

    optim = OptimConfig(lr=ns.lr, sinkhorn_lr=ns.lr, muon_lr=ns.muon_lr)
    return JobConfig(
        model=model, tasks=str(toy_set(ns.n_tasks, ns.turns, heldout_share=0.0)),
        trainer=TrainerConfig(kind="rl", max_steps=ns.steps, micro_batch_tokens=2048, global_batch_tokens=2048,
                              checkpoint_every=checkpoint_every or ns.steps, seed=seed, optim=optim,
                              dspark_weight=dspark_weight, grad_clip=grad_clip),
        rollout=RolloutConfig(n_workers=1, group_size=ns.group_size, groups_per_step=ns.groups, max_policy_lag=ns.lag,
                              max_new_tokens=ns.max_new_tokens, max_turns=ns.turns, temperature=ns.temperature,
                              seed=seed),
    )  # fmt: skip


def load_policy(model: ModelChoice, seed: int, weights: Path | None):
    """(Transformer, ChatTemplate): the seeded initialisation, or a checkpoint's model.safetensors."""
    from model.checkpoint import load_checkpoint
    from rl.actors import build_model

    policy, template = build_model(model, seed=seed)
    if weights is not None:
        load_checkpoint(policy, weights)
    return policy.eval(), template


def evaluate(policy, template, rollout: RolloutConfig, first_task: int, n_tasks: int, samples: int) -> dict:
    """Pass rate of `samples` toy episodes on each of tasks first_task..first_task+n_tasks-1, at the
    rollout temperature with fixed per-episode seeds; task-clustered standard error."""
    from model.engine import InferenceEngine

    engine = InferenceEngine(policy, template, max_sessions=4096)
    tasks = toy_tasks(first_task + n_tasks, n_turns=rollout.max_turns)[first_task:]
    sampling = SamplingParams(temperature=rollout.temperature, top_p=rollout.top_p,
                              max_new_tokens=rollout.max_new_tokens)  # fmt: skip

    async def episodes():
        batcher = SessionBatcher(engine, sampling)
        reqs = [RolloutRequest(key=f"{t.task_id}/{m}", group_id=t.task_id, task_id=t.task_id, env="toy",
                               seed=777_001 + i * 97 + m, task=vars(t))
                for i, t in enumerate(tasks) for m in range(samples)]  # fmt: skip
        return await asyncio.gather(*(run_toy_episode(r, batcher, template) for r in reqs))

    trajs = asyncio.run(episodes())
    per_task = [sum(t.reward for t in trajs if t.task_id == task.task_id) / samples for task in tasks]
    by_target: dict[str, list[float]] = {}
    for task, rate in zip(tasks, per_task):
        by_target.setdefault(task.target, []).append(rate)
    mean = sum(per_task) / len(per_task)
    return {
        "pass_rate": round(mean, 4), "se": round(statistics.stdev(per_task) / math.sqrt(len(per_task)), 4),
        "episodes": len(trajs), "by_target": {k: round(sum(v) / len(v), 3) for k, v in by_target.items()},
    }  # fmt: skip


def final_weights(run_dir: Path) -> Path:
    root = run_dir / "checkpoints"
    return root / (root / "latest").read_text().strip() / "model.safetensors"


def run_seed(ns: argparse.Namespace, seed: int) -> dict:
    job = rl_job(ns, seed)
    eval_args = (job.rollout, ns.n_tasks, ns.eval_tasks, ns.eval_samples)
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        start = sft_start(ns, seed, Path(d) / "sft")
        t_sft = time.perf_counter() - t0
        t0 = time.perf_counter()
        before = evaluate(*load_policy(job.model, seed, start), *eval_args)
        t_eval = time.perf_counter() - t0
        t0 = time.perf_counter()
        hist = run_async(job, Path(d) / "rl", progress=False, ray_metrics=False, init_checkpoint=str(start))
        t_rl = time.perf_counter() - t0
        after = evaluate(*load_policy(job.model, seed, final_weights(Path(d) / "rl")), *eval_args)
    k = max(1, len(hist) // 4)
    return {
        "bench": "rl_learning", "seed": seed, "before": before, "after": after,
        "delta": round(after["pass_rate"] - before["pass_rate"], 4),
        "train_reward_first_quarter": round(sum(r["reward_mean"] for r in hist[:k]) / k, 4),
        "train_reward_last_quarter": round(sum(r["reward_mean"] for r in hist[-k:]) / k, 4),
        "steps": len(hist), "skipped_steps": int(sum(r.get("skipped", 0.0) for r in hist)),
        "sft_s": round(t_sft, 1), "rl_s": round(t_rl, 1), "eval_s": round(t_eval, 1),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
    }  # fmt: skip


def summary(rows: list[dict]) -> dict:
    deltas = [r["delta"] for r in rows]
    return {
        "bench": "rl_learning", "summary": True, "seeds": [r["seed"] for r in rows],
        "mean_before": round(statistics.mean(r["before"]["pass_rate"] for r in rows), 4),
        "mean_after": round(statistics.mean(r["after"]["pass_rate"] for r in rows), 4),
        "deltas": deltas, "mean_delta": round(statistics.mean(deltas), 4),
        "delta_sd": round(statistics.stdev(deltas), 4) if len(deltas) > 1 else None,
        "delta_min": min(deltas), "all_rose": all(d > 0 for d in deltas),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--eval-tasks", type=int, default=32, help="held-out toy tasks")
    p.add_argument("--eval-samples", type=int, default=8, help="episodes per held-out task")
    add_rl_args(p)
    ns = p.parse_args()
    torch.set_num_threads(1)
    handle = start_or_join(ClusterConfig(num_cpus=4, include_dashboard=False), quiet=True)
    try:
        rows = []
        for seed in ns.seeds:
            rows.append(run_seed(ns, seed))
            print(json.dumps(rows[-1]), flush=True)
        print(json.dumps(summary(rows)), flush=True)
    finally:
        shutdown(handle)


if __name__ == "__main__":
    main()
