"""The main job behind `make demo`, as far as the pipeline exists today.

Stages run in order and resume from their outputs (`rl/stages.py`):
  sandbox_check  fixture task images are built, each task's gold patch is graded in a fresh
                 hardened grader container (reward 1) and so is an empty patch (reward 0);
  families       the demo task families (synth/families.py): family A with demonstrations, family B
                 with tests only, train and held-out instances, one image of real envs Tasks;
  factory        family F: the environment factory's six stages on the bundled sample repository,
                 its verified tasks in the demo's format, train (the solver's fixes join SFT) and
                 held-out (scored with A and B) (synth/factory_family.py);
  eval_base, sft, eval_sft, rl, eval_rl
                 the demo policy (`tiny` with rl.demo_learning.DEMO_OVERRIDES; V4.1 mHC, MoE,
                 compressor/indexer, QAT and the DSpark drafter on) is SFT'd on family A, then GRPO'd
                 asynchronously on family B (a rollout worker process samples the next batch while
                 the learner grades in warm grader containers and trains; policy lag 1 with truncated
                 importance weights; a family-A SFT term keeps family A); the drafter learns the
                 policy in both; greedy held-out pass@1 on every family and DSpark acceptance in real
                 speculative decoding after each (rl/demo_stages.py);
  student_sft, opd, eval_opd, eval_student_sft
                 a half-width student: SFT alone on family A for the whole student budget, and from
                 from its final weights OPD (reverse KL to the RL'd policy, rl/demo_opd.py);
  report         report.md + PNG plots in run_dir/report (rl/demo_report.py).
Not here: the learning loops (rl/demo_learning.py, rl/demo_opd.py).
"""

from __future__ import annotations

import os

# libgomp's default busy-waiting barriers make 2 torch threads 10-50x slower when the 2 cores are
# shared (grader containers, other jobs); passive waiting costs nothing on an idle machine. This must
# be set before torch is first imported (rl/train.py imports this module before anything loads torch).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from functools import partial
from pathlib import Path

from rl.config import JobConfig
from rl.demo_stages import (
    DemoConfig,
    eval_stage,
    factory_stage,
    families_stage,
    opd_stage,
    rl_stage,
    sft_stage,
)
from rl.stages import StageFn, run_stage

NOT_BUILT_YET = (
    ("agent", "multi-turn agent episodes inside sandboxes (the demo's policy answers in one turn; its answers "
              "are graded in containers)"),
)


def sandbox_check(stage_dir: Path) -> dict:
    from envs.fixtures.build import fixture_tasks
    from envs.grading import grade_patch

    results = {}
    for task in fixture_tasks(build=True):
        gold = grade_patch(task, task.gold_patch)
        empty = grade_patch(task, "")
        results[task.task_id] = {"gold": gold.reward, "empty": empty.reward, "grade_s": round(gold.duration_s, 2)}
        print(
            f"  {task.task_id}: gold patch → {gold.reward:.0f}, empty patch → {empty.reward:.0f} "
            f"({gold.duration_s:.1f} s per grading)"
        )
        if gold.reward != 1.0 or empty.reward != 0.0:
            raise RuntimeError(f"grading is broken on {task.task_id}: gold {gold.reason!r}, empty {empty.reason!r}")
    return results


def demo_stages(demo: DemoConfig, run_dir: Path) -> list[tuple[str, StageFn]]:
    """The demo's stages in order, each `fn(stage_dir) -> summary` for rl.stages.run_stage."""
    student_eval = partial(eval_stage, student=True, acceptance=False)
    return [
        ("sandbox_check", sandbox_check),
        ("families", partial(families_stage, demo)),
        ("factory", partial(factory_stage, demo)),
        ("eval_base", partial(eval_stage, demo, run_dir, None)),
        ("sft", partial(sft_stage, demo, run_dir)),
        ("eval_sft", partial(eval_stage, demo, run_dir, "sft/policy.safetensors")),
        ("rl", partial(rl_stage, demo, run_dir)),
        ("eval_rl", partial(eval_stage, demo, run_dir, "rl/policy.safetensors")),
        ("student_sft", partial(sft_stage, demo, run_dir, student=True)),
        ("opd", partial(opd_stage, demo, run_dir)),
        ("eval_opd", partial(student_eval, demo, run_dir, "opd/policy.safetensors")),
        ("eval_student_sft", partial(student_eval, demo, run_dir, "student_sft/policy.safetensors")),
    ]


def run_demo(job: JobConfig, run_dir: Path, demo: DemoConfig | None = None, skip: tuple[str, ...] = ()) -> dict:
    """Run (or resume) every stage not in `skip`, then write the report; returns make_report's dict."""
    from rl.demo_report import make_report
    from rl.demo_stages import device

    demo = demo or job.demo  # experiment=demo fills demo.seed/flavor/overrides from trainer.seed and model
    print(f"[demo] run folder: {run_dir.resolve()}")
    print(f"[demo] policy: {demo.flavor} {demo.overrides or ''} on {device(demo)}, seed {demo.seed}")
    for name, fn in demo_stages(demo, run_dir):
        if name not in skip:
            run_stage(run_dir, name, fn)
    report = make_report(run_dir, run_dir / "report")
    print(f"[demo] held-out pass@1: {report['pass_at_1']}")
    print(f"[demo] report: {report['report']}")
    print("[demo] stages of the full pipeline not built yet:")
    for name, what in NOT_BUILT_YET:
        print(f"  - {name}: {what}")
    return report
