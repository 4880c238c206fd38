"""The main job behind `make demo`, as far as the pipeline exists today.

Stages run in order and resume from their outputs (`rl/stages.py`):
  sandbox_check  fixture task images are built, each task's gold patch is graded in a fresh
                 hardened grader container (reward 1) and so is an empty patch (reward 0);
  families       the demo task families (synth/families.py): family A with demonstrations, family B
                 with tests only, train and held-out instances, one image of real envs Tasks;
  eval_base, sft, eval_sft, rl, eval_rl
                 the demo policy (`tiny` with rl.demo_learning.DEMO_OVERRIDES; V4.1 mHC, MoE,
                 compressor/indexer and QAT on) is SFT'd on family A, then GRPO'd on family B with
                 rewards from warm grader containers; greedy held-out pass@1 on both families after
                 each (rl/demo_stages.py);
  report         report.md + PNG plots in run_dir/report (rl/demo_report.py).
OPD and DSpark are later stages; the demo prints that they are not built yet
rather than pretending. Not here: the learning loops (rl/demo_learning.py).
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

from rl.config import JobConfig
from rl.demo_stages import DemoConfig, eval_stage, families_stage, rl_stage, sft_stage
from rl.stages import run_stage

NOT_BUILT_YET = (
    ("factory", "tasks built by the factory stages (synth/) instead of synth/families.py's generator"),
    ("dspark", "DSpark drafter trained alongside SFT, acceptance over training"),
    ("async", "asynchronous RL with rollouts in agent sandboxes (the demo's GRPO is synchronous)"),
    ("opd", "on-policy distillation of a smaller student"),
)


def sandbox_check(stage_dir: Path) -> dict:
    from envs.fixtures.build import fixture_tasks
    from envs.grading import grade_patch

    results = {}
    for task in fixture_tasks(build=True):
        gold = grade_patch(task, task.gold_patch)
        empty = grade_patch(task, "")
        results[task.task_id] = {"gold": gold.reward, "empty": empty.reward, "grade_s": round(gold.duration_s, 2)}
        print(f"  {task.task_id}: gold patch → {gold.reward:.0f}, empty patch → {empty.reward:.0f} "
              f"({gold.duration_s:.1f} s per grading)")
        if gold.reward != 1.0 or empty.reward != 0.0:
            raise RuntimeError(f"grading is broken on {task.task_id}: gold {gold.reason!r}, empty {empty.reason!r}")
    return results


def run_demo(job: JobConfig, run_dir: Path, demo: DemoConfig | None = None) -> None:
    from rl.demo_report import make_report

    demo = demo or DemoConfig()
    print(f"[demo] run folder: {run_dir.resolve()}")
    run_stage(run_dir, "sandbox_check", sandbox_check)
    run_stage(run_dir, "families", partial(families_stage, demo))
    run_stage(run_dir, "eval_base", partial(eval_stage, demo, run_dir, None))
    run_stage(run_dir, "sft", partial(sft_stage, demo, run_dir))
    run_stage(run_dir, "eval_sft", partial(eval_stage, demo, run_dir, "sft/policy.safetensors"))
    run_stage(run_dir, "rl", partial(rl_stage, demo, run_dir))
    run_stage(run_dir, "eval_rl", partial(eval_stage, demo, run_dir, "rl/policy.safetensors"))
    report = make_report(run_dir, run_dir / "report")
    print(f"[demo] held-out pass@1: {report['pass_at_1']}")
    print(f"[demo] report: {report['report']}")
    print("[demo] stages of the full pipeline not built yet:")
    for name, what in NOT_BUILT_YET:
        print(f"  - {name}: {what}")
