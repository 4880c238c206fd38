"""Does OUR V4.1 `tiny` policy learn the demo's task families on 2 CPU threads in minutes?

Prints JSON lines: the policy's size and training tokens/s, grading speed (one exec per batch vs one
exec per candidate, real warm grader containers), then base -> SFT (family A demonstrations) ->
RL (GRPO on family B, real grading) greedy held-out pass@1 on families A and B, with times,
samples/s and the load average (the machine may be shared: timings are then pessimistic).

  python -m bench.demo_learning                       # make demo's budgets and sizes, base -> SFT -> RL
  python -m bench.demo_learning --seed 1 --skip-base --skip-grading  # another seed (the spread in README)
  python -m bench.demo_learning --only grading        # grading speed only
  python -m bench.demo_learning --sft-s 60 --rl-s 60  # shorter
Not here: the stage wiring of `make demo` (rl/demo.py).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see rl/demo.py: before torch is imported
import torch  # noqa: E402


class LocalHarness:
    """Bench-only stand-in for GraderPool on a machine with no Docker engine (the lent GPU box): the
    same envs.batch_grading runner, run as a local root subprocess over a local copy of the family
    repo. Same harness and timeouts, NO container isolation; every line it grades says so."""

    def __init__(self, files: dict[str, bytes]):
        import tempfile
        from pathlib import Path

        self.workspace = tempfile.mkdtemp(prefix="demo-family-")
        for rel, body in files.items():
            (Path(self.workspace) / rel).parent.mkdir(parents=True, exist_ok=True)
            (Path(self.workspace) / rel).write_bytes(body)

    def grader(self, image: str):
        import contextlib

        return contextlib.nullcontext(self)

    def exec(self, argv, *, timeout, user, workdir, max_output_bytes):
        import subprocess
        from types import SimpleNamespace

        r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=workdir)
        return SimpleNamespace(output=r.stdout + r.stderr, exit_code=r.returncode)

    def warm(self, image: str, n: int) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        import shutil

        shutil.rmtree(self.workspace, ignore_errors=True)


def emit(d: dict) -> None:
    print(json.dumps(d), flush=True)


def grading_bench(tasks: dict, insts: list, pool, n: int) -> None:
    from envs.batch_grading import grade_batch, grade_one_per_exec
    from rl.demo_learning import reward_files

    items = [(tasks[i.iid], reward_files(i, i.action)[0]) for i in insts[:n]]
    empty = [(tasks[i.iid], {}) for i in insts[:n]]
    local = getattr(pool, "workspace", None)
    kw = {"workspace": local, "sweep": False} if local else {}
    grade_batch(items[:2], pool=pool, **kw)  # warm
    for label, batch in (("gold", items), ("unchanged", empty)):
        t0 = time.perf_counter()
        out = grade_batch(batch, pool=pool, **kw)
        dt = time.perf_counter() - t0
        emit(
            {
                "bench": "grading",
                "mode": "one_exec_per_batch",
                "candidates": label,
                "n": len(batch),
                "gradings_s": round(len(batch) / dt, 1),
                "reward_mean": sum(g.reward for g in out) / len(out),
                "load": round(os.getloadavg()[0], 2),
            }
        )
    k = min(16, n)
    t0 = time.perf_counter()
    out = [grade_one_per_exec(t, f, pool=pool, **kw) for t, f in items[:k]]
    dt = time.perf_counter() - t0
    emit(
        {
            "bench": "grading",
            "mode": "one_exec_per_candidate",
            "candidates": "gold",
            "n": k,
            "gradings_s": round(k / dt, 2),
            "reward_mean": sum(g.reward for g in out) / k,
            "load": round(os.getloadavg()[0], 2),
        }
    )


def main(argv: list[str] | None = None) -> None:
    from rl.demo_stages import DemoConfig

    demo = DemoConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--overrides", default=None, help="JSON overrides of get_flavor('tiny'); default DEMO_OVERRIDES")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sft-s", type=float, default=demo.sft.seconds)
    p.add_argument("--rl-s", type=float, default=demo.rl.seconds)
    p.add_argument("--sft-lr", type=float, default=demo.sft.lr)
    p.add_argument("--rl", default=None, help="JSON overrides of rl.demo_learning.RLConfig")
    p.add_argument("--n-heldout", type=int, default=demo.n_heldout)
    p.add_argument("--n-train-a", type=int, default=demo.n_train_a)
    p.add_argument("--n-train-b", type=int, default=demo.n_train_b)
    p.add_argument("--only", choices=["all", "grading", "throughput"], default="all")
    p.add_argument("--skip-base", action="store_true", help="skip the untrained policy's evaluation")
    p.add_argument("--skip-grading", action="store_true", help="skip the grading-speed measurement")
    p.add_argument(
        "--grader",
        choices=["docker", "local"],
        default="docker",
        help="local: LocalHarness (no Docker engine; no container isolation)",
    )
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    from envs.pool import GraderPool
    from rl.demo_learning import RLConfig, SFTConfig, build_policy, evaluate, run_rl, run_sft
    from synth.families import demo_splits, family_tasks, repo_files

    overrides = json.loads(args.overrides) if args.overrides else None
    model, template, margs = build_policy(overrides, seed=args.seed)
    emit(
        {
            "bench": "policy",
            "overrides": overrides,
            "params": sum(p.numel() for p in model.parameters()),
            "n_layers": margs.n_layers,
            "dim": margs.dim,
            "hc_mult": margs.hc_mult,
            "experts": margs.n_routed_experts,
            "qat": margs.qat,
            "threads": args.threads,
        }
    )
    t0 = time.perf_counter()
    sets = demo_splits(args.n_train_a, args.n_train_b, args.n_heldout, seed=args.seed)
    gradable = sets["B_train"] + sets["A_heldout"] + sets["B_heldout"]
    tasks = {i.iid: t for i, t in zip(gradable, family_tasks(gradable, build=args.grader == "docker"))}
    emit(
        {
            "bench": "families",
            **{k: len(v) for k, v in sets.items()},
            "build_s": round(time.perf_counter() - t0, 1),
            "grader": args.grader,
        }
    )
    pool_cm = (
        GraderPool(max_graders=2, graders_per_image=2)
        if args.grader == "docker"
        else LocalHarness(repo_files(gradable))
    )
    with pool_cm as pool:
        pool.warm(next(iter(tasks.values())).image, 2)
        if args.only == "grading" or (args.only == "all" and not args.skip_grading):
            grading_bench(tasks, sets["B_train"], pool, n=min(256, len(sets["B_train"])))
        if args.only == "grading":
            return
        a_train = sets["A_train"]
        rng = random.Random(args.seed)

        def batch(step: int) -> list:
            return rng.sample(a_train, 24)

        if args.only == "throughput":
            run_sft(model, template, batch, SFTConfig(seconds=args.sft_s, lr=args.sft_lr), log=emit)
            return
        results = {}

        def ev(stage: str) -> None:
            for fam in ("A", "B"):
                r = evaluate(model, template, sets[f"{fam}_heldout"], tasks, pool)
                results[(stage, fam)] = r["pass@1"]
                emit({"bench": "eval", "stage": stage, "family": fam, **r, "load": round(os.getloadavg()[0], 2)})

        if not args.skip_base:
            ev("base")
        s = run_sft(model, template, batch, SFTConfig(seconds=args.sft_s, lr=args.sft_lr), log=emit)
        emit({"bench": "sft", **s, "load": round(os.getloadavg()[0], 2)})
        ev("sft")
        rl_cfg = RLConfig(**{**json.loads(args.rl or "{}"), "seconds": args.rl_s})
        r = run_rl(model, template, sets["B_train"], tasks, pool, rl_cfg, seed=args.seed, log=emit, demos=a_train)
        emit({"bench": "rl", **{k: v for k, v in r.items() if k != "history"}, "load": round(os.getloadavg()[0], 2)})
        ev("rl")
        emit(
            {
                "bench": "summary",
                **{f"{st}_{fam}": v for (st, fam), v in results.items()},
                "load": round(os.getloadavg()[0], 2),
            }
        )


if __name__ == "__main__":
    sys.exit(main())
