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


def test_solver_flags_and_options_roundtrip(tmp_path):
    from synth.config import FactoryOptions

    args = parser().parse_args(["build", "--policy-checkpoint", "ck.safetensors", "--policy-max-turns", "3",
                                "--history-commits", "7"])
    assert (args.policy_checkpoint, args.policy_max_turns, args.history_commits) == ("ck.safetensors", 3, 7)
    opts = FactoryOptions(repo="r", history_commits=7)
    opts.solvers.policy.checkpoint = "ck.safetensors"
    opts.solvers.llm.api_key = "sk-secret"
    doc = json.loads(json.dumps(opts.to_dict()))
    assert "api_key" not in doc["solvers"]["llm"]  # options.json never holds the key
    back = FactoryOptions.from_dict(doc)
    assert back.solvers.policy.checkpoint == "ck.safetensors" and back.history_commits == 7
    assert back.to_dict() == doc
