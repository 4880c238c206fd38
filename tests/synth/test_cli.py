"""flashpost-factory's read-only commands over a run directory's journals (no containers)."""

from __future__ import annotations

import json

from synth.cli import main, parser
from synth.records import SpecRecord, StageStore, TaskRecord


def make_run(tmp_path):
    spec = StageStore(tmp_path, "specify", SpecRecord)
    spec.append(SpecRecord(key="t1", task_id="t1", repo_key="r"))
    spec.append(SpecRecord(key="t2", task_id="t2", repo_key="r").drop("equivalent mutant: no passing test fails"))
    StageStore(tmp_path, "inspect", TaskRecord).append(TaskRecord(key="t1", verdicts={"gold_gate": True}))
    StageStore(tmp_path, "solve", TaskRecord).append(TaskRecord(key="t1", pass_matrix={"search": [1.0, 0.0]}))


def test_stats_prints_the_funnel(tmp_path, capsys):
    make_run(tmp_path)
    assert main(["stats", str(tmp_path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["funnel"]["specify"] == {"in": 2, "out": 1, "drops": {"equivalent mutant": 1}}
    assert doc["tasks"] == 1 and doc["search_solver_pass_rate"] == 0.5
    main(["stats", str(tmp_path)])
    assert "equivalent mutant x1" in capsys.readouterr().out


def test_show_and_inspect(tmp_path, capsys):
    make_run(tmp_path)
    assert main(["show", str(tmp_path), "t1"]) == 0
    out = capsys.readouterr().out
    assert "== specify: ok" in out and "== inspect: ok" in out
    assert main(["show", str(tmp_path), "nope"]) == 1
    assert main(["inspect", str(tmp_path)]) == 0
    assert "t1" in capsys.readouterr().out


def test_build_flags_follow_synth_config_names():
    args = parser().parse_args(["build", "--repo", "pypi:six==1.16.0", "--out", "o", "--budget", "5",
                                "--concurrency", "3"])
    assert (args.repo, args.out, args.budget, args.concurrency) == ("pypi:six==1.16.0", "o", 5, 3)
