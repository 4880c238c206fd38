"""Throughput of the RL loop, synchronous vs asynchronous, in one run (real Ray actors, DeepSpeed learner,
InferenceEngine rollout workers, the toy task family; CPU by default).

    python -m bench.rl_throughput                        # lags 0, 1, 2 on `debug` (vocab of the default tokenizer)
    python -m bench.rl_throughput --flavor tiny --steps 6 --lags 0 1 2 --workers 2
    python -m bench.rl_throughput --flavor tiny --gpus 1      # one GPU shared: learner 1/2, workers the rest

One JSON line per max_policy_lag: learner tokens/s (non-pad tokens per second of learner compute),
rollout tokens/s (generated tokens per second of wall time), end-to-end samples/s (trained trajectories
per second of wall time, measured from the first update to the last so actor start-up is excluded),
the largest trained-token lag, and the speed-up of samples/s over lag 0. Plus the load average,
because the machine may be shared.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from rl.cluster import ClusterConfig, shutdown, start_or_join  # noqa: E402
from rl.config import JobConfig, ModelChoice, OptimConfig, RolloutConfig, TrainerConfig  # noqa: E402
from rl.rl_loop import run_async  # noqa: E402

TOKENIZER_FIT = {"vocab_size": 4096, "engram_compressed_vocab_size": 2742}


def cluster_for(args: argparse.Namespace) -> ClusterConfig:
    """CPU actors, or with --gpus the learner on half a GPU and the rollout workers sharing the rest."""
    if not args.gpus:
        return ClusterConfig(num_cpus=8, include_dashboard=False)
    return ClusterConfig(num_cpus=8, num_gpus=args.gpus, include_dashboard=False, learner_gpus=args.gpus / 2,
                         rollout_gpus=args.gpus / 2 / args.workers)  # fmt: skip


def job_for(args: argparse.Namespace, lag: int) -> JobConfig:
    overrides = {**(TOKENIZER_FIT if args.flavor == "debug" else {}), "max_seq_len": 512}
    return JobConfig(
        cluster=cluster_for(args),
        model=ModelChoice(flavor=args.flavor, overrides=overrides),
        trainer=TrainerConfig(kind="rl", max_steps=args.steps, micro_batch_tokens=512, global_batch_tokens=512,
                              checkpoint_every=10**6, optim=OptimConfig(lr=1e-4, sinkhorn_lr=1e-4, muon_lr=1e-3)),
        rollout=RolloutConfig(n_workers=args.workers, group_size=args.group_size, groups_per_step=args.groups,
                              max_policy_lag=lag, max_new_tokens=args.max_new_tokens, max_turns=2, temperature=1.0),
    )  # fmt: skip


def measure(args: argparse.Namespace, lag: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        hist = run_async(job_for(args, lag), Path(d), progress=False, ray_metrics=False)
    first, rest = hist[0], hist[1:]
    wall = rest[-1]["wall_s"] - first["wall_s"]
    learner_s = sum(r["learner_s"] for r in rest)
    return {
        "bench": "rl_throughput", "flavor": args.flavor, "max_policy_lag": lag, "steps_timed": len(rest),
        "workers": args.workers, "group_size": args.group_size, "groups_per_step": args.groups,
        "learner_tokens_per_s": sum(r["learner_tokens_per_s"] * r["learner_s"] for r in rest) / learner_s,
        "rollout_tokens_per_s": sum(r["rollout_tokens"] for r in rest) / wall,
        "samples_per_s": sum(r["trajectories"] for r in rest) / wall,
        "step_s": wall / len(rest), "learner_busy_frac": learner_s / wall,
        "policy_lag_max": max(r["policy_lag_max"] for r in hist), "gpus": args.gpus,
        "loadavg_1m": os.getloadavg()[0],
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavor", default="debug", choices=["debug", "tiny"])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--lags", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--gpus", type=int, default=0, help="GPUs for the actors (0: all on cpu)")
    args = p.parse_args()
    handle = start_or_join(cluster_for(args), quiet=True)
    try:
        rows = []
        for lag in args.lags:
            t0 = time.perf_counter()
            rows.append(measure(args, lag))
            rows[-1]["run_s"] = time.perf_counter() - t0
        base = next((r["samples_per_s"] for r in rows if r["max_policy_lag"] == 0), None)
        for r in rows:
            r["speedup_vs_sync"] = r["samples_per_s"] / base if base else None
            print(json.dumps(r), flush=True)
    finally:
        shutdown(handle)


if __name__ == "__main__":
    main()
