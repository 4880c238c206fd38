"""The demo's learning stages on synth/families tasks, each `fn(stage_dir) -> summary` for rl/stages.py:

  families   A/B train and held-out instances (instances.json) and the family image with one envs
             Task per gradable instance (tasks.json);
  eval_base  greedy held-out pass@1 of the untrained policy (seeded init = SFT's starting point);
  sft        SFT on family-A demonstrations for a wall-clock budget -> sft/policy.safetensors;
  eval_sft   held-out pass@1 after SFT;
  rl         GRPO on family B with real grading (warm grader containers) -> rl/policy.safetensors;
  eval_rl    held-out pass@1 after RL.
A stage reads what earlier stages wrote in the run folder, so a killed demo resumes after the last
finished stage. Not here: the loops themselves (rl/demo_learning.py), the report (rl/demo_report.py).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from rl.demo_learning import RLConfig, SFTConfig


@dataclass(kw_only=True)
class DemoConfig:
    """Demo sizes and budgets (defaults: bench/demo_learning.py's measured recipe)."""

    seed: int = 0
    threads: int = 2
    overrides: dict | None = None  # get_flavor("tiny", **overrides); None = rl.demo_learning.DEMO_OVERRIDES
    n_train_a: int = 5000
    n_train_b: int = 300
    n_heldout: int = 100
    sft: SFTConfig = field(default_factory=lambda: SFTConfig(seconds=240.0))
    rl: RLConfig = field(default_factory=lambda: RLConfig(seconds=240.0))


def _instances(run_dir: Path) -> dict:
    from synth.families import Instance

    doc = json.loads((run_dir / "families" / "instances.json").read_text())
    return {k: [Instance.from_dict(d) for d in v] for k, v in doc.items()}


def _tasks(run_dir: Path) -> dict:
    from envs.task import load_tasks

    return {t.task_id.removeprefix("demo-"): t for t in load_tasks(run_dir / "families" / "tasks.json")}


def families_stage(cfg: DemoConfig, stage_dir: Path) -> dict:
    from envs.task import save_tasks
    from synth.families import demo_splits, family_tasks

    sets = demo_splits(cfg.n_train_a, cfg.n_train_b, cfg.n_heldout, seed=cfg.seed)
    gradable = sets["B_train"] + sets["A_heldout"] + sets["B_heldout"]
    tasks = family_tasks(gradable)
    (stage_dir / "instances.json").write_text(json.dumps({k: [i.to_dict() for i in v] for k, v in sets.items()}))
    save_tasks(tasks, stage_dir / "tasks.json")
    summary = {k: len(v) for k, v in sets.items()}
    print(f"  instances: {summary}; {len(tasks)} gradable tasks in image {tasks[0].image}")
    return {**summary, "image": tasks[0].image}


def _policy(cfg: DemoConfig, checkpoint: Path | None):
    import torch

    from model.checkpoint import load_checkpoint
    from rl.demo_learning import build_policy

    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    model, template, args = build_policy(cfg.overrides, seed=cfg.seed)
    if checkpoint is not None:
        load_checkpoint(model, checkpoint)
    return model, template


def _pool():
    from envs.pool import GraderPool

    return GraderPool(max_graders=2, graders_per_image=2)


def eval_stage(cfg: DemoConfig, run_dir: Path, checkpoint: str | None, stage_dir: Path) -> dict:
    from rl.demo_learning import evaluate

    sets, tasks = _instances(run_dir), _tasks(run_dir)
    model, template = _policy(cfg, run_dir / checkpoint if checkpoint else None)
    out = {}
    with _pool() as pool:
        for fam in ("A", "B"):
            r = evaluate(model, template, sets[f"{fam}_heldout"], tasks, pool)
            out[fam] = r["pass@1"]
            out[f"{fam}_detail"] = r
            print(f"  family {fam}: held-out pass@1 {r['pass@1']:.3f} (n={r['n']}, generation {r['gen_s']} s)")
    out["load"] = os.getloadavg()[0]
    return out


def sft_stage(cfg: DemoConfig, run_dir: Path, stage_dir: Path) -> dict:
    import random

    from model.checkpoint import save_checkpoint
    from rl.demo_learning import run_sft

    a_train = _instances(run_dir)["A_train"]
    model, template = _policy(cfg, None)
    rng = random.Random(cfg.seed)
    log = []

    def show(d: dict) -> None:
        log.append(d)
        if d["step"] % 50 == 0:
            print(f"  sft step {d['step']}: loss {d['loss']:.3f}, {d['tok_s']} tokens/s, {d['s']:.0f}/"
                  f"{cfg.sft.seconds:.0f} s", flush=True)

    s = run_sft(model, template, lambda step: rng.sample(a_train, 24), cfg.sft, log=show)
    save_checkpoint(model, str(stage_dir / "policy.safetensors"))
    return {**s, "log": log, "load": os.getloadavg()[0]}


def rl_stage(cfg: DemoConfig, run_dir: Path, stage_dir: Path) -> dict:
    from model.checkpoint import save_checkpoint
    from rl.demo_learning import run_rl

    sets, tasks = _instances(run_dir), _tasks(run_dir)
    model, template = _policy(cfg, run_dir / "sft" / "policy.safetensors")

    def show(d: dict) -> None:
        if d["step"] % 20 == 0:
            print(f"  rl step {d['step']}: recent reward {d['reward_recent']:.2f}, {d['updates']} updates, "
                  f"{d['samples_s']} samples/s, {d['s']:.0f}/{cfg.rl.seconds:.0f} s", flush=True)

    with _pool() as pool:
        r = run_rl(model, template, sets["B_train"], tasks, pool, cfg.rl, seed=cfg.seed, log=show)
    save_checkpoint(model, str(stage_dir / "policy.safetensors"))
    return {**r, "load": os.getloadavg()[0]}
