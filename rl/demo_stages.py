"""The demo's learning stages on synth/families tasks, each `fn(stage_dir) -> summary` for rl/stages.py:

  families   A/B train and held-out instances (instances.json) and the family image with one envs
             Task per gradable instance (tasks.json);
  factory    family F: the factory's tasks from the sample repository in the same two files
             (synth/factory_family.py); its train demonstrations join SFT, its held-out tasks every eval;
  eval_base  greedy held-out pass@1 of the untrained policy (seeded init = SFT's starting point);
  sft        SFT on family-A demonstrations for a wall-clock budget -> sft/policy.safetensors;
  eval_sft   held-out pass@1 after SFT;
  rl         asynchronous GRPO on family B with real grading (warm grader containers) and a family-A
             SFT term -> rl/policy.safetensors;
  eval_rl    held-out pass@1 after RL (each eval of the policy also measures DSpark acceptance);
  student_sft  a smaller student trained by SFT alone (its SFT loss has flattened by the end);
  opd        that student distilled further from the RL'd policy -> opd/policy.safetensors;
  eval_opd, eval_student_sft  held-out pass@1 of both students.
A stage reads what earlier stages wrote in the run folder, so a killed demo resumes after the last
finished stage. Not here: the loops themselves (rl/demo_learning.py), the report (rl/demo_report.py).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from contextlib import contextmanager
from functools import cache
from pathlib import Path

from rl.demo_config import TASK_FAMILIES, DemoConfig

SETS = ("families", "factory")  # stages whose instances.json and tasks.json the learning stages read


def _instances(run_dir: Path) -> dict:
    """{"A_train": [...], ..., "F_heldout": [...]}: the families' and (when it ran) the factory's splits."""
    from synth.families import Instance

    out = {}
    for stage in SETS:
        if (run_dir / stage / "instances.json").exists():
            doc = json.loads((run_dir / stage / "instances.json").read_text())
            out.update({k: [Instance.from_dict(d) for d in v] for k, v in doc.items()})
    return out


def _tasks(run_dir: Path) -> dict:
    """Grading Tasks by instance id."""
    from envs.task import load_tasks

    return {t.task_id.removeprefix("demo-"): t for stage in SETS if (run_dir / stage / "tasks.json").exists()
            for t in load_tasks(run_dir / stage / "tasks.json")}  # fmt: skip


def _families(sets: dict) -> tuple[str, ...]:
    """The families with held-out instances: A, B and, when the factory gave any, F."""
    return tuple(f for f in TASK_FAMILIES if sets.get(f"{f}_heldout"))


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


def factory_stage(cfg: DemoConfig, stage_dir: Path) -> dict:
    """Family F: the environment factory's stages on the bundled sample repository (its own resumable
    folder, stage_dir/factory), then the accepted tasks in the demo's format (synth/factory_family.py)."""
    import dataclasses

    from envs.task import save_tasks
    from synth.factory_family import build_sample_tasks, factory_instances

    if cfg.factory_budget <= 0:
        print("  factory: off (demo.factory_budget=0); no family F")
        return {"F_train": 0, "F_heldout": 0, "factory_tasks": 0, "off": True}
    stats = build_sample_tasks(stage_dir / "factory", cfg.factory_budget, cfg.seed)
    insts, tasks, left_out = factory_instances(stage_dir / "factory", cfg.factory_heldout_share)
    sets = {f"F_{split}": [i for i in insts if i.split == split] for split in ("train", "heldout")}
    (stage_dir / "instances.json").write_text(json.dumps({k: [i.to_dict() for i in v] for k, v in sets.items()}))
    named = [dataclasses.replace(t, task_id=f"demo-{iid}",
                                 verification={**t.verification, "factory_task_id": t.task_id})
             for iid, t in tasks.items()]  # fmt: skip
    save_tasks(named, stage_dir / "tasks.json")
    summary = {k: len(v) for k, v in sets.items()}
    print(f"  factory: {stats['tasks']} verified tasks in {stats['seconds']} s; {summary} in the demo's format"
          + (f"; left out {len(left_out)}: {sorted(set(left_out.values()))}" if left_out else ""))
    return {**summary, "factory_tasks": stats["tasks"], "factory_seconds": stats["seconds"],
            "funnel": stats["funnel"], "search_solver_pass_rate": stats.get("search_solver_pass_rate"),
            "left_out": left_out}  # fmt: skip


@cache
def _gauges():
    """The demo's Ray dashboard gauges (rl.metrics.DemoGauges), one set per process."""
    from rl.metrics import DemoGauges

    return DemoGauges()


@contextmanager
def _progress(log: list[dict], every: int, line: Callable[[dict], str], desc: str, steps: int, cap_s: float):
    """A learning stage's progress: on a terminal, a bar over the step budget (count, rate, ETA by
    steps; the postfix shows the wall-clock cap, which binds first on 2 cores); everywhere, `line(record)`
    every `every` steps (logs keep those); in the Ray dashboard, the records' numbers as gauges tagged
    with the stage. Yields the loop's `log` callback, which also keeps every record in `log`."""
    from tqdm import tqdm

    bar = tqdm(total=steps or None, desc=f"  {desc}", unit="step", disable=None, leave=False, dynamic_ncols=True)
    gauges, tag = _gauges(), desc.replace(" ", "_")  # the stage's name, as the evaluations tag it

    def show(d: dict) -> None:
        log.append(d)
        gauges.record(tag, d)
        bar.update(d["step"] - bar.n)
        bar.set_postfix_str(f"{d['s']:.0f} of {cap_s:.0f} s cap")
        if d["step"] % every == 0:
            tqdm.write(line(d))

    try:
        yield show
    finally:
        bar.close()


def device(cfg: DemoConfig):
    """The torch device of cfg.device ("auto": cuda when torch sees a GPU)."""
    import torch

    name = cfg.device
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise RuntimeError(f"demo.device={cfg.device} but torch sees no GPU here; use demo.device=cpu (or auto)")
        # fp32 parameters (the optimiser's small steps survive), matmuls on TF32 tensor cores
        torch.backends.cuda.matmul.allow_tf32 = True
    return torch.device(name)


def _policy(cfg: DemoConfig, checkpoint: Path | None, student: bool = False):
    """The demo policy (or, with `student`, the OPD student at 1/cfg.student_shrink of its width) on
    device(cfg), seeded, with `checkpoint`'s weights when given. Built and loaded on the CPU, then moved:
    the model's fp32 parameters train the same way on either device."""
    import torch

    from model.checkpoint import load_checkpoint
    from rl.demo_learning import build_policy

    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    shrink = cfg.student_shrink if student else 1
    model, template, _ = build_policy(cfg.overrides, seed=cfg.seed, flavor=cfg.flavor, shrink=shrink)
    if checkpoint is not None:
        load_checkpoint(model, checkpoint)
    return model.to(device(cfg)), template


def _pool():
    from envs.pool import GraderPool

    return GraderPool(max_graders=2, graders_per_image=2)


def eval_stage(
    cfg: DemoConfig,
    run_dir: Path,
    checkpoint: str | None,
    stage_dir: Path,
    student: bool = False,
    acceptance: bool = True,
) -> dict:
    """Greedy held-out pass@1 on every family (A, B and F when the factory ran; the answers come from two
    processes, rl.demo_learning.greedy_families); with `acceptance`, also the DSpark drafter's
    acceptance in real speculative decoding of cfg.n_acceptance held-out prompts."""
    from rl.demo_dspark import speculative_acceptance
    from rl.demo_learning import device_of, evaluate_families

    sets, tasks = _instances(run_dir), _tasks(run_dir)
    model, template = _policy(cfg, run_dir / checkpoint if checkpoint else None, student=student)
    stage = Path(checkpoint).parent.name if checkpoint else "base"  # the dashboard's tag: sft, rl, opd, ...
    dev = device_of(model)
    out = {
        "params": sum(p.numel() for n, p in model.named_parameters() if not n.startswith("mtp.")),
        "device": str(dev) if dev.type == "cuda" else f"cpu, {cfg.threads} threads",
    }
    with _pool() as pool:
        held_out = {fam: sets[f"{fam}_heldout"] for fam in _families(sets)}
        for fam, r in evaluate_families(model, template, held_out, tasks, pool).items():
            _gauges().held_out(stage, fam, r["pass@1"])
            out[fam] = r["pass@1"]
            out[f"{fam}_detail"] = r
            print(
                f"  family {fam}: held-out pass@1 {r['pass@1']:.3f} (n={r['n']}, generation {r['gen_s']} s, "
                f"{r['gen_tok_s']} tokens/s, {r['ruled_out']} answers stopped once they could not be actions)"
            )
    if acceptance:
        held = sets["A_heldout"][: cfg.n_acceptance // 2] + sets["B_heldout"][: cfg.n_acceptance // 2]
        out["speculative"] = speculative_acceptance(model, template, held)
        _gauges().record(stage, {"dspark_acceptance": out["speculative"]["acceptance"]})
        print(f"  DSpark: acceptance {out['speculative']['acceptance']} of drafted tokens in speculative decoding")
    out["load"] = os.getloadavg()[0]
    return out


def sft_stage(cfg: DemoConfig, run_dir: Path, stage_dir: Path, student: bool = False) -> dict:
    """SFT on family-A demonstrations of the policy (cfg.sft) or, with `student`, of the half-width
    student trained by SFT alone (cfg.student_sft) -> policy.safetensors."""
    import random

    from model.checkpoint import save_checkpoint
    from rl.demo_learning import run_sft

    sets = _instances(run_dir)
    a_train, f_train = sets["A_train"], sets.get("F_train", [])
    n_f = min(cfg.factory_demos_per_batch, len(f_train))
    model, template = _policy(cfg, None, student=student)
    rng = random.Random(cfg.seed + student)  # the student draws its own batch order
    sft = cfg.student_sft if student else cfg.sft
    log: list[dict] = []

    name = "student sft" if student else "sft"
    line = lambda d: (f"  {name} step {d['step']}: loss {d['loss']:.3f}, {d['tok_s']} tokens/s, {d['s']:.0f} s "
                      f"({sft.steps} steps, {sft.seconds:.0f} s cap)")  # fmt: skip
    with _progress(log, 20, line, name, sft.steps, sft.seconds) as show:
        # 24 demonstrations a batch: family A's, and n_f of the factory's train tasks (the solver's fixes)
        s = run_sft(model, template, lambda step: rng.sample(a_train, 24 - n_f) + rng.sample(f_train, n_f), sft,
                    log=show)  # fmt: skip
    save_checkpoint(model, str(stage_dir / "policy.safetensors"))
    return {**s, "log": log, "load": os.getloadavg()[0]}


def opd_stage(cfg: DemoConfig, run_dir: Path, stage_dir: Path) -> dict:
    """OPD of the RL'd policy into the SFT-only student (continuing from it) -> opd/policy.safetensors."""
    from model.checkpoint import save_checkpoint
    from rl.demo_opd import run_opd

    sets = _instances(run_dir)
    teacher, template = _policy(cfg, run_dir / "rl" / "policy.safetensors")
    student, _ = _policy(cfg, run_dir / "student_sft" / "policy.safetensors", student=True)
    log: list[dict] = []

    line = lambda d: (f"  opd step {d['step']}: reverse KL {d['reverse_kl']:.4f}, {d['sampled_tok_s']} sampled "
                      f"tokens/s, {d['s']:.0f} s")  # fmt: skip
    with _progress(log, 20, line, "opd", cfg.opd.steps, cfg.opd.seconds) as show:
        r = run_opd(student, teacher, template, sets["A_train"], sets["B_train"], cfg.opd, seed=cfg.seed, log=show)
    save_checkpoint(student, str(stage_dir / "policy.safetensors"))
    sft_steps = json.loads((run_dir / "student_sft" / "done.json").read_text())["summary"]["steps"]
    return {**r, "sft_steps": sft_steps, "log": log, "load": os.getloadavg()[0]}


def rl_stage(cfg: DemoConfig, run_dir: Path, stage_dir: Path) -> dict:
    from model.checkpoint import save_checkpoint
    from rl.demo_learning import run_rl

    sets, tasks = _instances(run_dir), _tasks(run_dir)
    model, template = _policy(cfg, run_dir / "sft" / "policy.safetensors")

    line = lambda d: (f"  rl step {d['step']}: recent reward {d['reward_recent']:.2f}, {d['updates']} updates, "
                      f"{d['samples_s']} samples/s, {d['s']:.0f} s "
                      f"({cfg.rl.steps} steps, {cfg.rl.seconds:.0f} s cap)")  # fmt: skip
    with _pool() as pool, _progress([], 20, line, "rl", cfg.rl.steps, cfg.rl.seconds) as show:
        r = run_rl(
            model, template, sets["B_train"], tasks, pool, cfg.rl, seed=cfg.seed, log=show, demos=sets["A_train"]
        )  # fmt: skip
    save_checkpoint(model, str(stage_dir / "policy.safetensors"))
    return {**r, "load": os.getloadavg()[0]}
