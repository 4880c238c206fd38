"""Real-commit inversion end to end: a git repository made here (a bug, the commit that fixes it with a
regression test, a docs-only commit, a behaviour-preserving refactor) goes through every stage; the fix
commit becomes a task whose F2P is the regression test, the refactor is dropped for having no failing
test, and the task image holds one fresh commit and nothing of the original history or of the fix.
"""

from __future__ import annotations

import os
import subprocess

import pytest

from envs import engine
from envs.sandbox import Sandbox
from envs.task import load_tasks
from synth import history, invert
from synth.config import FactoryOptions
from synth.records import SpecRecord, StageStore, TaskRecord
from synth.runner import run_factory
from synth.stages.build import GIT_ENV
from synth.statement import statement_leaks

pytestmark = pytest.mark.docker

CORE_BUGGY = '''\
def mean(xs):
    return sum(xs) / len(xs)


def clamp(x, lo, hi):
    """x limited to the interval [lo, hi]."""
    if x < lo:
        return lo
    if x > hi:
        return lo
    return x
'''
TESTS_V1 = '''\
from calc.core import clamp, mean


def test_mean():
    assert mean([1, 2, 3]) == 2


def test_clamp_low():
    assert clamp(-5, 0, 10) == 0
'''
REGRESSION = '''

def test_clamp_above_interval():
    assert clamp(42, 0, 10) == 10
'''
FIX_SUBJECT = "Fix clamp returning the lower bound for values above the interval"


def _commit(repo, message: str, files: dict[str, str]) -> str:
    for rel, text in files.items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(text)
    env = os.environ | GIT_ENV
    subprocess.run(["git", "add", "-A"], cwd=repo, check=True, env=env)
    subprocess.run(["git", "commit", "-q", "-m", message], cwd=repo, check=True, env=env)
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, check=True, capture_output=True,
                          text=True).stdout.strip()


@pytest.fixture(scope="module")
def git_repo(tmp_path_factory):
    repo = tmp_path_factory.mktemp("calcrepo")
    subprocess.run(["git", "init", "-q", "-b", "main", str(repo)], check=True)
    shas = {"base": _commit(repo, "Add calc", {"calc/__init__.py": "", "calc/core.py": CORE_BUGGY,
                                               "tests/test_core.py": TESTS_V1})}
    shas["fix"] = _commit(repo, FIX_SUBJECT, {"calc/core.py": CORE_BUGGY.replace("        return lo\n    return x",
                                                                                 "        return hi\n    return x"),
                                              "tests/test_core.py": TESTS_V1 + REGRESSION})
    shas["docs"] = _commit(repo, "Describe the package", {"README.md": "calc: small numeric helpers\n"})
    fixed = (repo / "calc/core.py").read_text()
    shas["refactor"] = _commit(repo, "Name the total in mean", {"calc/core.py": fixed.replace(
        "    return sum(xs) / len(xs)", "    total = sum(xs)\n    return total / len(xs)")})
    return repo, shas


def test_candidate_commits_are_source_changes_with_a_parent(git_repo, tmp_path):
    repo, shas = git_repo
    bare = tmp_path / "h.git"
    assert history.clone_bare(str(repo), bare, depth=10) == shas["refactor"]
    found = invert.candidates(str(bare), 10)
    # newest first; the docs commit changes no source and the root commit has no parent
    assert [c.sha for c in found] == [shas["refactor"], shas["fix"]]
    fix = found[1]
    assert fix.parent == shas["base"] and fix.subject == FIX_SUBJECT
    assert fix.changed == ("calc/core.py", "tests/test_core.py")
    inv = invert.invert(str(bare), fix, tmp_path / "tree")
    assert set(inv.overrides) == {"calc/core.py"}  # the commit's test file stays as the commit has it
    assert "return hi" in inv.fixed["calc/core.py"].decode() and "return hi" not in inv.broken["calc/core.py"].decode()
    assert b"test_clamp_above_interval" in inv.broken["tests/test_core.py"]
    assert "+        return hi" in inv.gold_patch and "-        return hi" in inv.bug_patch
    needles = invert.needles(inv, fix)
    assert needles[:2] == [fix.sha, fix.parent] and any("return hi" in n for n in needles[2:])


def test_statement_naming_the_commit_subject_is_a_leak():
    spec = SpecRecord(key="k", task_id="k", repo_key="r", origin={"kind": "commit", "subject": FIX_SUBJECT})
    assert "commit subject" in statement_leaks(f"Maybe related: {FIX_SUBJECT.lower()}.", spec, [])
    assert statement_leaks("clamp(42, 0, 10) gives 0", spec, []) == []


def test_fix_commit_becomes_a_verified_task_without_history(git_repo, tmp_path):
    if not engine.engine_available():
        pytest.skip("no Docker engine answers: run `bash infra/docker/ensure_engine.sh` (or `make test`)")
    engine.ensure_base_image(build=True)
    repo, shas = git_repo
    opts = FactoryOptions(repo=str(repo), out_dir=str(tmp_path / "out"), task_budget=1, spec_margin=1.0,
                          concurrency=1, gold_runs=1, flaky_reruns=1)
    result = run_factory(opts, progress=False)
    out = tmp_path / "out"
    specs = list(StageStore(out, "specify", SpecRecord).load().values())
    by_commit = {s.origin.get("commit"): s for s in specs if s.origin.get("kind") == "commit"}
    assert set(by_commit) == {shas["refactor"], shas["fix"]}, "commits are tried before mutations"
    refactor, fix = by_commit[shas["refactor"]], by_commit[shas["fix"]]
    assert not refactor.ok and refactor.drop_reason.startswith("no failing test"), refactor.drop_reason
    assert fix.ok, fix.drop_reason
    assert fix.f2p == ["tests/test_core.py::test_clamp_above_interval"]
    assert fix.p2p == ["tests/test_core.py::test_clamp_low", "tests/test_core.py::test_mean"]
    assert "clamp(42, 0, 10)" in fix.problem_statement  # observed behaviour
    for secret in ("return hi", FIX_SUBJECT, shas["fix"][:7], "test_clamp_above_interval"):
        assert secret not in fix.problem_statement

    built = StageStore(out, "build", TaskRecord).load()[fix.key]
    assert built.ok, built.drop_reason
    assert built.audit["commits"] == "1" and built.audit["hits"] == []
    assert shas["fix"] in built.needles and shas["base"] in built.needles

    tasks = load_tasks(out / "tasks.json")
    assert [t.task_id for t in tasks] == [fix.key] and result["tasks"] == 1
    task = tasks[0]
    assert all(task.verification["gates"].values()), task.verification["gates"]
    assert task.verification["origin"]["commit"] == shas["fix"]
    with Sandbox(task.image) as sb:  # what an agent would find: the bug, the regression test, one commit
        assert "return hi" not in sb.read_file("calc/core.py").decode()
        assert b"test_clamp_above_interval" in sb.read_file("tests/test_core.py")
        log = sb.exec("git log --all --format='%H %s'; git reflog | wc -l", timeout=30).output
        assert log.splitlines()[0].endswith("Initial commit") and len(log.splitlines()) == 2, log
        for sha in shas.values():
            assert sha not in log
        objects = sb.exec("git cat-file --batch-all-objects --batch", timeout=30).output
        assert FIX_SUBJECT not in objects and "return hi" not in objects
