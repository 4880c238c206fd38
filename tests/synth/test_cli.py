"""flashpost-factory's read-only commands over a run directory's journals (no containers)."""

from __future__ import annotations

import json

import pytest

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
    assert doc["funnel"]["specify"] == {"in": 2, "out": 1, "drops": {"equivalent mutant": 1},
                                        "examples": {"equivalent mutant": "t2: no passing test fails"}}
    assert doc["tasks"] == 1 and doc["search_solver_pass_rate"] == 0.5
    main(["stats", str(tmp_path)])
    out = capsys.readouterr().out
    assert "equivalent mutant x1" in out and "equivalent mutant, e.g. t2: no passing test fails" in out


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


# Bad input fails before any stage runs: exit 2 and a message naming the fix.


def build(tmp_path, *extra):
    return main(["build", "--out", str(tmp_path / "out"), "--budget", "2", *extra])


def test_build_refuses_a_missing_folder(tmp_path, capsys):
    assert build(tmp_path, "--repo", "/nonexistent") == 2
    err = capsys.readouterr().err
    assert "--repo /nonexistent: no such folder" in err and "pypi:NAME==VERSION" in err
    assert not (tmp_path / "out").exists()  # no stage ran


def test_build_refuses_an_unfetchable_pypi_source(tmp_path, capsys):
    # offline this fails too (pip cannot reach the index); either way before any stage runs
    assert build(tmp_path, "--repo", "pypi:doesnotexist-zzz==1.0") == 2
    err = capsys.readouterr().err
    assert "cannot fetch --repo pypi:doesnotexist-zzz==1.0" in err and "PyPI" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flag", [["--budget", "-1"], ["--budget", "0"], ["--concurrency", "0"]])
def test_build_refuses_a_non_positive_budget_or_concurrency(tmp_path, capsys, flag):
    with pytest.raises(SystemExit) as e:
        main(["build", "--repo", "sample", "--out", str(tmp_path / "out"), *flag])
    assert e.value.code == 2
    assert f"argument {flag[0]}: must be 1 or more" in capsys.readouterr().err


def test_run_factory_refuses_bad_options(tmp_path):
    from synth.config import FactoryOptions
    from synth.runner import run_factory
    from synth.validate import FactoryInputError

    with pytest.raises(FactoryInputError, match="task_budget must be a positive integer"):
        run_factory(FactoryOptions(out_dir=str(tmp_path / "o"), task_budget=-1))
    with pytest.raises(FactoryInputError, match="unit_budget_s names no stage 'solver'"):
        run_factory(FactoryOptions(out_dir=str(tmp_path / "o"), unit_budget_s={"solver": 10}))
    assert not (tmp_path / "o").exists()


def test_build_refuses_an_output_folder_of_another_repository(tmp_path, capsys):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "options.json").write_text(json.dumps({"repo": "pypi:other==1.0"}))
    assert build(tmp_path, "--repo", "sample") == 2
    assert "holds a run of 'pypi:other==1.0', not 'sample'; pick another --out" in capsys.readouterr().err
    (tmp_path / "out" / "options.json").unlink()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    assert build(tmp_path, "--repo", "sample") == 2
    assert "is not empty and holds no factory run" in capsys.readouterr().err


def test_build_refuses_a_malformed_unit_budget(tmp_path, capsys):
    assert build(tmp_path, "--repo", "sample", "--unit-budget", "solve") == 2
    assert "give STAGE=SECONDS" in capsys.readouterr().err


@pytest.mark.parametrize("cmd", [["stats"], ["inspect"], ["show", "--", "t1"]])
def test_read_commands_refuse_a_folder_that_is_no_run(tmp_path, capsys, cmd):
    name, *rest = cmd
    missing = tmp_path / "nope"
    assert main([name, str(missing), *[r for r in rest if r != "--"]]) == 2
    assert "no such folder; give the --out folder of a `flashpost-factory build`" in capsys.readouterr().err
    assert not missing.exists()  # looking did not create it
    (tmp_path / "other").mkdir()
    assert main([name, str(tmp_path / "other"), *[r for r in rest if r != "--"]]) == 2
    assert "is not a factory run" in capsys.readouterr().err
    assert list((tmp_path / "other").iterdir()) == []
