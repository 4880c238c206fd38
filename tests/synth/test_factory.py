"""The factory against real containers: the sample repository yields tasks that pass every gate, an
interrupted stage resumes without redoing work, and each bad task built on purpose is caught by the
stage responsible for it (image leak -> build, statement leak -> specify, flaky F2P and null-solvable
-> inspect); an accepted task carries the grading budget its gold runs measured. Small budgets keep this
suite to a few minutes.
"""

from __future__ import annotations

import dataclasses
import json
import textwrap

import pytest

from envs.grading import GRADING_BUDGET_FLOOR_S, grading_budget, grading_timeout
from envs.task import load_tasks
from synth import mutations
from synth.config import Context, FactoryOptions
from synth.records import FeasibleRepo, SpecRecord, StageStore, TaskRecord
from synth.runner import run_factory, run_stage
from synth.stages import build, inspect, specify
from synth.stages.build import PURGE, build_task, repo_files
from synth.stages.specify import fix_needles
from synth.statement import write_statement

pytestmark = pytest.mark.docker


def opts_for(out, **kw) -> FactoryOptions:
    base = dict(repo="sample", out_dir=str(out), task_budget=2, spec_margin=1.0, concurrency=2, gold_runs=2,
                flaky_reruns=1)
    return FactoryOptions(**(base | kw))


@pytest.fixture(scope="module")
def run_dir(engine_ready, tmp_path_factory):
    out = tmp_path_factory.mktemp("factory")
    result = run_factory(opts_for(out), progress=False)
    return out, result


def load(out, stage, cls):
    return list(StageStore(out, stage, cls).load().values())


def test_sample_build_passes_every_gate(run_dir):
    out, result = run_dir
    tasks = load_tasks(out / "tasks.json")
    inspected = {r.task["task_id"]: r for r in load(out, "inspect", TaskRecord) if r.ok}
    assert len(tasks) == 2 == result["tasks_saved"] and result["tasks"] >= 2  # the budget, not more
    for t in tasks:
        gates = t.verification["gates"]
        assert all(gates.values()), (t.task_id, gates)
        assert t.f2p and t.gold_patch and t.image_digest.startswith("sha256:")
        assert set(t.verification["flake_rates"].values()) == {0.0}
        assert "search" in t.verification["solver_pass_matrix"]
        hacks = t.verification["inspector_verdicts"]["hack_rewards"]
        assert hacks and all(r in (0.0, "skipped (slow)") for r in hacks.values())
        assert t.gold_patch not in t.problem_statement
        # the budget of its gradings: from the slowest of its 3 gold runs in the grader, below the 120 s cap
        gold_s = inspected[t.task_id].verdicts["gold_runs_s"]
        assert len(gold_s) == 3 and min(gold_s) > 0 and t.verification["gold_grading_s"] == max(gold_s)
        assert t.verification["grading_budget_s"] == grading_budget(gold_s) >= GRADING_BUDGET_FLOOR_S
        assert grading_timeout(t, 120.0) == t.verification["grading_budget_s"] < 120.0
    f = result["funnel"]
    assert f["specify"]["out"] == f["build"]["in"] and f["inspect"]["out"] == result["tasks"]


def test_interrupted_stage_resumes_without_duplicate_work(run_dir, tmp_path):
    out, _ = run_dir
    repos = [r for r in load(out, "feasibility", FeasibleRepo) if r.ok]
    ctx = Context(opts_for(tmp_path), tmp_path)
    try:
        first = run_stage(specify, repos, ctx, limit=2, progress=False)  # "killed" after two units
        assert len(first) == 2
        second = run_stage(specify, repos, ctx, target_ok=3, progress=False)
    finally:
        ctx.close()
    lines = [json.loads(x) for x in (tmp_path / "specify" / "records.jsonl").read_text().splitlines()]
    keys = [d["key"] for d in lines]
    assert len(keys) == len(set(keys)), "a unit was processed twice"
    assert set(keys[:2]) == {r.key for r in first}  # journal order = completion order
    assert [r.to_dict() for r in second[:2]] == [r.to_dict() for r in first]
    assert sum(r.ok for r in second) >= 3


def _one_spec(out) -> SpecRecord:
    return next(s for s in load(out, "specify", SpecRecord) if s.ok)


def test_image_that_leaks_the_fix_is_caught_by_build(run_dir, tmp_path):
    out, _ = run_dir
    spec = dataclasses.replace(_one_spec(out), task_id="leaky-history", key="leaky-history")
    path = spec.mutation["path"]
    files = repo_files(spec.repo_path)  # the original tree, committed first, then mutated in place
    files[".flashpost-mutant"] = build.task_files(spec)[path]
    script = (f"{PURGE}; git init -q -b main && git add -A -- . ':!.flashpost-mutant' && git commit -q -m base && "
              f"mv .flashpost-mutant {path} && git commit -q -am 'inject bug'")
    rec = build_task(spec, Context(opts_for(tmp_path), tmp_path), files=files, script=script)
    assert not rec.ok and rec.drop_reason.startswith("image leak")
    assert "git objects" in rec.drop_reason and "2 commits" in rec.drop_reason


def test_statement_that_leaks_the_fix_is_caught_by_specify(run_dir, tmp_path):
    out, _ = run_dir
    spec = _one_spec(out)
    repo = next(r for r in load(out, "feasibility", FeasibleRepo) if r.key == spec.repo_key)

    def leaky_writer(s: SpecRecord, r: FeasibleRepo) -> tuple[str, list[str]]:
        text, quoted = write_statement(s, r)
        return text + "\n\nSuggested fix:\n" + s.gold_patch, quoted

    ctx = Context(opts_for(tmp_path), tmp_path, hooks={"statement_writer": leaky_writer})
    try:
        rec = specify.process((repo, mutations.Mutation(**spec.mutation)), ctx)
    finally:
        ctx.close()
    assert not rec.ok and rec.drop_reason.startswith("statement leak"), rec.drop_reason
    assert "diff line" in rec.drop_reason


def _hand_made_task(tmp_path, repo_dir, path: str, m: mutations.Mutation, f2p, p2p, task_id) -> TaskRecord:
    original = (repo_dir / path).read_text()
    mutant = mutations.apply(original, m)
    tree = repo_files(repo_dir)
    tree[path] = mutant.encode()
    tests = sorted(p for p in tree if p.startswith("tests/"))
    spec = SpecRecord(key=task_id, task_id=task_id, repo_key="handmade", repo_path=str(repo_dir), test_files=tests,
                      mutation=m.to_dict(), gold_patch=mutations.unified_diff(path, mutant, original), f2p=f2p,
                      p2p=p2p, problem_statement="Adding numbers gives wrong answers.", quoted=["assert"],
                      needles=fix_needles(original, tree, m))
    built = build_task(spec, Context(opts_for(tmp_path), tmp_path))
    assert built.ok, built.drop_reason
    return built


def test_null_solvable_task_is_caught_by_inspect(run_dir, tmp_path):
    out, _ = run_dir
    repo_dir = next(r for r in load(out, "feasibility", FeasibleRepo) if r.ok).path
    from pathlib import Path

    source = (Path(repo_dir) / "minikit/ranges.py").read_text()
    m = next(m for m in mutations.find_mutations("minikit/ranges.py", source)
             if m.kind == "changed_constant" and "empty interval" in m.old)  # no test reads the message
    built = _hand_made_task(tmp_path, Path(repo_dir), "minikit/ranges.py", m,
                            ["tests/test_ranges.py::test_merge_touching"], ["tests/test_ranges.py::test_chunks"],
                            "null-solvable")
    rec = inspect.process(built, Context(opts_for(tmp_path), tmp_path))
    assert not rec.ok and rec.drop_reason.startswith("null gate"), rec.drop_reason


def test_flaky_f2p_task_is_caught_by_inspect(engine_ready, tmp_path):
    repo = tmp_path / "flakyrepo"
    (repo / "flakykit").mkdir(parents=True)
    (repo / "tests").mkdir()
    (repo / "flakykit" / "__init__.py").write_text("")
    (repo / "flakykit" / "core.py").write_text(textwrap.dedent('''\
        def add(a, b):
            return a + b


        def greet():
            return "hi"
        '''))
    (repo / "tests" / "test_core.py").write_text(textwrap.dedent('''\
        import random

        from flakykit.core import add, greet


        def test_add_noisy():
            assert add(2, 2) == 4
            assert random.random() < 0.5


        def test_greet():
            assert greet() == "hi"
        '''))
    source = (repo / "flakykit" / "core.py").read_text()
    m = next(m for m in mutations.find_mutations("flakykit/core.py", source) if m.new == "a - b")
    built = _hand_made_task(tmp_path, repo, "flakykit/core.py", m, ["tests/test_core.py::test_add_noisy"],
                            ["tests/test_core.py::test_greet"], "flaky-f2p")
    rec = inspect.process(built, Context(opts_for(tmp_path, flaky_reruns=8), tmp_path))
    assert not rec.ok
    assert rec.drop_reason.startswith("flaky"), rec.drop_reason
    assert rec.verdicts["flake_rates"]["tests/test_core.py::test_add_noisy"] > 0
    assert rec.verdicts["flake_rates"]["tests/test_core.py::test_greet"] == 0


def test_task_with_several_f2p_tests_passes_every_gate(run_dir, tmp_path):
    out, _ = run_dir
    repo = next(r for r in load(out, "feasibility", FeasibleRepo) if r.ok)
    from pathlib import Path

    source = (Path(repo.path) / "minikit/text.py").read_text()
    m = next(m for m in mutations.find_mutations("minikit/text.py", source)
             if m.kind == "inverted_condition" and m.old == "not line")
    ctx = Context(opts_for(tmp_path), tmp_path)
    try:
        spec = specify.process((repo, m), ctx)
        assert spec.ok and len(spec.f2p) >= 2, (spec.drop_reason, spec.f2p)
        rec = inspect.process(build_task(spec, ctx), ctx)
    finally:
        ctx.close()
    assert rec.ok, rec.drop_reason
    assert rec.verdicts["statement_consistent"] and rec.verdicts["adversarial_gate"]
