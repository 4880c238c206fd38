"""Stages run once per run folder; a rerun resumes after finished ones."""

from __future__ import annotations

import json

import pytest

from rl.stages import run_stage, write_json_atomic


def test_stage_runs_once_and_resumes(tmp_path):
    calls = []

    def stage(stage_dir):
        calls.append(stage_dir)
        (stage_dir / "artifact.txt").write_text("x")
        return {"value": 3}

    first = run_stage(tmp_path, "a", stage)
    second = run_stage(tmp_path, "a", stage)
    assert len(calls) == 1
    assert not first.resumed and second.resumed
    assert second.summary == {"value": 3}


def test_failed_stage_is_not_marked_done(tmp_path):
    def broken(stage_dir):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        run_stage(tmp_path, "b", broken)
    assert not (tmp_path / "b" / "done.json").exists()
    assert run_stage(tmp_path, "b", lambda d: {"ok": True}).summary == {"ok": True}


def test_atomic_write_leaves_no_temp_files(tmp_path):
    write_json_atomic(tmp_path / "x.json", {"a": 1})
    assert json.loads((tmp_path / "x.json").read_text()) == {"a": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["x.json"]
