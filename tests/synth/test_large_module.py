"""The search solver on a task whose module has 10,000 lines (real containers, real grading): its solve
stage finishes in minutes, because mutation finding parses and indexes the file once and visits only
the suspicious lines (it used to re-split and recompile the whole file per statement and candidate)."""

from __future__ import annotations

import time

import pytest

from bench.factory import generated_module
from envs import engine
from synth import mutations
from synth.config import Context, FactoryOptions
from synth.records import RepoRecord
from synth.stages import feasibility, solve, specify
from synth.stages.build import build_task

pytestmark = pytest.mark.docker

TEST = '''from bigmod.core import C100


def test_m3():
    assert C100().m3([5, 1, 7, 2], limit=10) == 47


def test_m4():
    assert C100().m4([5, 1, 7, 2], limit=10) == 59
'''


def test_solve_on_a_10000_line_module_takes_minutes(tmp_path):
    if not engine.engine_available():
        pytest.skip("no Docker engine answers: run `bash infra/docker/ensure_engine.sh` (or `make test`)")
    engine.ensure_base_image(build=True)
    repo_dir = tmp_path / "bigrepo"
    (repo_dir / "bigmod").mkdir(parents=True)
    (repo_dir / "tests").mkdir()
    source = generated_module(10_000)
    (repo_dir / "bigmod" / "__init__.py").write_text("")
    (repo_dir / "bigmod" / "core.py").write_text(source)
    (repo_dir / "tests" / "test_core.py").write_text(TEST)
    lines = source.splitlines()
    start = lines.index("class C100:") + 1
    m3 = start + next(i for i, ln in enumerate(lines[start - 1:]) if "def m3(" in ln)
    m = next(m for m in mutations.mutations_at("bigmod/core.py", source, set(range(m3, m3 + 6)))
             if m.kind == "arithmetic_swap" and m.new == "xs[k] / 4")
    out = tmp_path / "run"
    ctx = Context(FactoryOptions(out_dir=str(out)), out)
    try:
        repo = feasibility.process(RepoRecord(key="bigrepo", source=str(repo_dir), path=str(repo_dir)), ctx)
        assert repo.ok, repo.drop_reason
        spec = specify.process((repo, m), ctx)
        assert spec.ok and spec.f2p == ["tests/test_core.py::test_m3"], spec.drop_reason
        task = build_task(spec, ctx)
        assert task.ok, task.drop_reason
        t0 = time.monotonic()
        solved = solve.process(task, ctx)
        seconds = time.monotonic() - t0
    finally:
        ctx.close()
        engine.reap_containers({engine.LABEL_OWNER: engine.owner_id()})
    assert solved.pass_matrix["search"] == [1.0], solved.verdicts["search_trajectories"]
    # minutes, not the hours it took: a few container runs and ~20 forked pytest runs on a loaded
    # 2-core machine; the mutation work itself is well under a second (test_mutations.py)
    assert seconds < 600, seconds
