"""The demo's learning stages end to end at toy budgets with real grader containers: every stage
writes its summary, checkpoints load into the next stage, the report has its plots, and a demo
killed (SIGKILL) in the middle resumes after its last finished stage when started again."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rl.demo import demo_stages

REPO = Path(__file__).resolve().parents[2]
# The demo at toy budgets (no sandbox_check: tests/envs covers it), as `make demo` runs it.
DRIVER = """
import sys
from pathlib import Path
from rl.demo import run_demo
from rl.demo_learning import RLConfig, SFTConfig
from rl.demo_opd import OPDConfig
from rl.demo_stages import DemoConfig
demo = DemoConfig(n_train_a=60, n_train_b=8, n_heldout=3, n_acceptance=2, factory_budget=2, factory_heldout_share=0.5,
                  sft=SFTConfig(seconds=4.0, rows=2),
                  rl=RLConfig(seconds=4.0, tasks_per_step=2, samples=2),
                  student_sft=SFTConfig(seconds=4.0, rows=2),
                  opd=OPDConfig(seconds=3.0, prompts_per_step=2, samples=2))
run_demo(None, Path(sys.argv[1]), demo, skip=("sandbox_check",))
"""
STAGES = [name for name, _ in demo_stages(None, Path("."))][1:]


def _start(run_dir: Path, log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [sys.executable, "-c", DRIVER, str(run_dir)], cwd=REPO, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT
    )


@pytest.mark.slow
def test_demo_killed_midway_resumes(engine_ready, tmp_path):
    run_dir = tmp_path / "run"
    first = _start(run_dir, tmp_path / "first.log")
    deadline = time.monotonic() + 900
    while not (run_dir / "rl" / "done.json").exists():  # kill it once RL has finished
        assert first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "the toy demo did not reach RL in 15 minutes"
        time.sleep(0.2)
    first.send_signal(signal.SIGKILL)
    first.wait()
    done_before = {s for s in STAGES if (run_dir / s / "done.json").exists()}
    assert {"families", "sft", "rl"} <= done_before and "eval_student_sft" not in done_before
    second = _start(run_dir, tmp_path / "second.log")
    assert second.wait(timeout=900) == 0, (tmp_path / "second.log").read_text()[-3000:]
    log = (tmp_path / "second.log").read_text()
    for s in STAGES:
        resumed = f"[stage] {s}: already done in a previous run" in log
        assert resumed == (s in done_before), (s, log[-3000:])
    summaries = {s: json.loads((run_dir / s / "done.json").read_text())["summary"] for s in STAGES}
    assert summaries["families"]["B_train"] == 8 and summaries["eval_sft"]["A_detail"]["n"] == 3
    f = summaries["factory"]
    assert f["factory_tasks"] >= 2 and f["F_train"] + f["F_heldout"] + len(f["left_out"]) == f["factory_tasks"]
    if f["F_heldout"]:  # family F is scored with A and B
        assert summaries["eval_sft"]["F_detail"]["n"] == f["F_heldout"]
    assert summaries["rl"]["steps"] >= 1 and summaries["rl"]["samples"] == summaries["rl"]["steps"] * 4
    assert summaries["opd"]["steps"] >= 1 and summaries["student_sft"]["steps"] >= 1
    assert summaries["eval_sft"]["speculative"]["drafted"] > 0  # speculative decoding really drafted
    for s in ("sft", "rl", "opd", "student_sft"):
        assert (run_dir / s / "policy.safetensors").exists()
    report = (run_dir / "report" / "report.md").read_text()
    assert "Held-out pass@1" in report and "OPD student" in report and "DSpark" in report
    assert {"pass_at_1.png", "rl_reward.png", "dspark_acceptance.png", "tokens_per_s.png", "stage_times.png"} <= {
        p.name for p in (run_dir / "report").glob("*.png")
    }  # mismatch.png too once an update ran
