"""rl/demo_report.py: the demo's report is assembled from the jobs' own outputs (eval.json, metrics.jsonl,
done.json) of a run folder, with every figure where the jobs put it."""

import json

from rl.demo_report import episode_stats, make_report


def _eval(pass_a: float, episodes: list[dict], speed: dict | None) -> dict:
    per_task = [{"task_id": "a0", "family": "A", "episodes": episodes}]
    report = {"overall": {"tasks": 2, "pass@1": pass_a / 2, "pass@k": pass_a / 2},
              "by_family": {"A": {"tasks": 1, "pass@1": pass_a}, "B": {"tasks": 1, "pass@1": 0.0}},
              "per_task": per_task}  # fmt: skip
    if speed is not None:
        report["throughput"] = speed
    return report


def _write(path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj))


def test_report_reads_pass_rates_episodes_throughput_and_stage_times(tmp_path):
    run = tmp_path / "run"
    looked = {"tools": ["view", "edit", "run_tests", "edit", "submit"], "turns": 5, "termination": "submit"}
    blind = {"tools": ["edit", "submit"], "turns": 2, "termination": "submit"}
    _write(run / "eval_base" / "eval.json", _eval(0.0, [], None))  # an eval.json written before throughput
    _write(run / "eval_sft" / "eval.json",
           _eval(0.5, [looked, blind], {"episodes": 2, "wall_s": 4.0, "episodes_per_s": 0.5, "tokens_per_s": 31.5}))
    (run / "rl").mkdir()
    (run / "rl" / "metrics.jsonl").write_text(
        "\n".join(json.dumps({"step": s, "reward_mean": r, "wall_s": 10.0 * s, "mismatch_k3": 2e-4,
                              "trajectories": 16, "rollout_tokens": 100, "samples_per_s": rate})
                  for s, r, rate in ((1, 0.25, 1.6), (2, 0.75, 100.0))) + "\n")  # fmt: skip
    for stage, secs in (("eval_base", 30.0), ("eval_sft", 50.0), ("rl", 200.0)):
        _write(run / stage / "done.json", {"seconds": secs, "summary": {"load": 1.5}})

    out = make_report(run, run / "report")
    text = (run / "report" / "report.md").read_text()
    assert out["pass_at_1"] == {"base": {"A": 0.0, "B": 0.0}, "SFT": {"A": 0.5, "B": 0.0}}
    assert "| SFT | 0.500 | 0.000 | 0.250 |" in text
    # one of the two episodes ran the tests before its last edit; the throughput columns come from eval.json
    assert episode_stats(_eval(0.5, [looked, blind], None))["tests_read_before_last_edit"] == 0.5
    assert "| SFT | 2 | 3.5 | 3.5 | 0.50 | 1.00 | edit 3, submit 2, view 1, run_tests 1 | 0.50 | 31.5 |" in text
    # the job's episodes and rollout tokens over its 20 s, not the mean of its steps' rates (1.6 and 100)
    assert "| rl | 2 | 20 | - | 10 | 1.60 | 0.25 → 0.75 |" in text
    assert "| rl | 200 | 1.5 |" in text
    for png in ("pass_at_1.png", "rl_reward.png", "mismatch.png", "stage_times.png"):
        assert png in out["plots"] and (run / "report" / png).stat().st_size > 0
