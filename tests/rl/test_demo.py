"""`make demo` is the product's jobs in a row: at toy sizes, the chain's first jobs write their own run
folders, a demo killed (SIGKILL) midway resumes after its last finished stage when started again, and
the report is built from the jobs' outputs. The full chain's learning is measured by `make demo` itself
(docs/demo_measurements.md), not here."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rl.demo import Demo
from rl.demo_config import DemoConfig

REPO = Path(__file__).resolve().parents[2]
# families only (no sample repository), one step per job, up to SFT
ARGS = ["experiment=demo", "demo.factory_budget=0", "demo.families_budget=2", "demo.families_heldout=1",
        "demo.sft_steps=1", "demo.rl_steps=1",
        "demo.student_sft_steps=1", "demo.opd_steps=1", "demo.eval_samples=1", "demo.until=sft",
        "cluster.include_dashboard=false"]  # fmt: skip


def test_stages_are_the_product_jobs_in_order():
    names = [n for n, _ in Demo(DemoConfig(), Path("runs/x")).stages()]
    assert names == ["factory_sample", "factory_families", "tasks", "eval_base", "sft", "eval_sft", "rl", "eval_rl",
                     "student_sft", "opd", "eval_opd", "eval_student_sft"]  # fmt: skip
    assert "factory_sample" not in [n for n, _ in Demo(DemoConfig(factory_budget=0), Path("x")).stages()]
    with pytest.raises(ValueError, match="demo.families_budget"):
        DemoConfig(families_budget=1)


def _start(run_dir: Path, log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "rl.train", *ARGS, f"run_dir={run_dir}"], cwd=REPO, env=env,
                            stdout=log.open("w"), stderr=subprocess.STDOUT)  # fmt: skip


@pytest.mark.slow
@pytest.mark.docker
@pytest.mark.ray
def test_demo_killed_midway_resumes(engine_ready, tmp_path):
    run_dir = tmp_path / "run"
    first = _start(run_dir, tmp_path / "first.log")
    deadline = time.monotonic() + 600
    while not (run_dir / "tasks" / "done.json").exists():  # kill it once the task set is merged
        assert first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "the toy demo did not merge its task set in 10 minutes"
        time.sleep(0.2)
    first.send_signal(signal.SIGKILL)
    first.wait()
    done_before = {p.parent.name for p in run_dir.glob("*/done.json")}
    assert {"factory_families", "tasks"} <= done_before and "sft" not in done_before
    second = _start(run_dir, tmp_path / "second.log")
    assert second.wait(timeout=600) == 0, (tmp_path / "second.log").read_text()[-3000:]
    log = (tmp_path / "second.log").read_text()
    for s in ("factory_families", "tasks", "eval_base", "sft"):
        assert (f"[stage] {s}: already done in a previous run" in log) == (s in done_before), (s, log[-3000:])
    assert "[demo] stopping after sft" in log and not (run_dir / "eval_sft").exists()
    # each stage is the real job's output: the eval's report, the trainer's checkpoint and metrics
    ev = json.loads((run_dir / "eval_base" / "eval.json").read_text())
    assert ev["samples"] == 1 and ev["per_task"] and "episodes" in ev["per_task"][0]
    assert (run_dir / "sft" / "checkpoints" / "latest").exists() and (run_dir / "sft" / "metrics.jsonl").exists()
    assert (run_dir / "sft" / "config.resolved.yaml").exists()
    commands = (run_dir / "commands.md").read_text()
    assert commands.count("`sft`") == 1 and "flashpost-train" in commands and "flashpost-eval" in commands
    report = (run_dir / "report" / "report.md").read_text()
    assert "Held-out pass@1" in report and "| base |" in report and "| sft |" in report


def test_opd_teacher_has_its_own_architecture():
    # the demo distils the RL'd policy into a half-width student: trainer.teacher_model builds the teacher
    from rl.actors import TeacherActor
    from rl.config import ModelChoice, TrainerConfig

    wide = ModelChoice(flavor="tiny", overrides={"n_layers": 4})
    student = ModelChoice(flavor="tiny", overrides={"n_layers": 4, "dim": 64, "moe_inter_dim": 64})
    assert TeacherActor(student, TrainerConfig(kind="opd", teacher_model=wide)).model.args.dim == wide.build_args().dim
    assert TeacherActor(student, TrainerConfig(kind="opd")).model.args.dim == student.build_args().dim
