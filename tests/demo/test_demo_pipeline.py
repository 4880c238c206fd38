"""The demo's learning stages end to end at toy budgets with real grader containers: every stage
writes its summary, checkpoints load into the next stage, the report has its plots, and a second
run resumes from done.json instead of re-running anything."""

from __future__ import annotations

import json
from functools import partial

import pytest

from rl.demo_learning import RLConfig, SFTConfig
from rl.demo_report import make_report
from rl.demo_stages import DemoConfig, eval_stage, families_stage, rl_stage, sft_stage
from rl.stages import run_stage


def _stages(demo: DemoConfig, run_dir):
    return [
        ("families", partial(families_stage, demo)),
        ("sft", partial(sft_stage, demo, run_dir)),
        ("eval_sft", partial(eval_stage, demo, run_dir, "sft/policy.safetensors")),
        ("rl", partial(rl_stage, demo, run_dir)),
    ]


@pytest.mark.slow
def test_stages_report_and_resume(engine_ready, tmp_path):
    demo = DemoConfig(n_train_a=60, n_train_b=8, n_heldout=3, sft=SFTConfig(seconds=4.0, rows=2),
                      rl=RLConfig(seconds=4.0, tasks_per_step=2, samples=2))
    outcomes = [run_stage(tmp_path, name, fn) for name, fn in _stages(demo, tmp_path)]
    assert not any(o.resumed for o in outcomes)
    fam, sft, ev, rl = (o.summary for o in outcomes)
    assert fam["B_train"] == 8 and fam["A_heldout"] == 3
    assert sft["steps"] >= 1 and sft["tokens"] > 0 and (tmp_path / "sft" / "policy.safetensors").exists()
    assert 0.0 <= ev["A"] <= 1.0 and ev["A_detail"]["n"] == 3
    assert rl["steps"] >= 1 and rl["samples"] == rl["steps"] * 4 and (tmp_path / "rl" / "policy.safetensors").exists()
    report = make_report(tmp_path, tmp_path / "report")
    assert set(report["plots"]) == {"rl_reward.png", "pass_at_1.png", "stage_times.png"}
    assert "Held-out pass@1" in (tmp_path / "report" / "report.md").read_text()
    # a rerun resumes: nothing runs again
    again = [run_stage(tmp_path, name, fn) for name, fn in _stages(demo, tmp_path)]
    assert all(o.resumed for o in again)
    assert json.loads((tmp_path / "rl" / "done.json").read_text())["summary"]["steps"] == rl["steps"]
