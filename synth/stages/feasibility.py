"""Stage 2, feasibility: an ingested tree -> a pristine repository image (its declared test
dependencies installed: synth/testenv.py) whose test suite runs in a grader sandbox under the
repository's own pytest configuration, with the test command, the parser, and pass/fail per test id
(two baseline runs: a test must pass on both to count as passing, so baseline-flaky tests never
become F2P/P2P).

Not here: mutating anything (specify).
"""

from __future__ import annotations

import hashlib
import time
from pathlib import PurePosixPath

from envs.grading import is_protected
from synth import testenv
from synth.config import Context
from synth.records import FeasibleRepo, RepoRecord
from synth.stages.build import build_tree_image, repo_files
from synth.testrun import TEST_COMMAND, probe_task, run_suite

NAME = "feasibility"
BUDGET_S = 1800.0  # seconds per unit (FactoryOptions.unit_budget_s overrides)
OUTPUT = FeasibleRepo
BASELINE_RUNS = 2
_NOT_LIBRARY = {"docs", "doc", "documentation", "examples", "example", "benchmarks", "scripts", "tools"}


def units(repos: list[RepoRecord], ctx: Context) -> list[RepoRecord]:
    return [r for r in repos if r.ok]


def unit_key(repo: RepoRecord) -> str:
    return repo.key


def is_test_file(path: str) -> bool:
    p = PurePosixPath(path)
    return p.suffix == ".py" and (p.name.startswith("test_") or p.name.endswith("_test.py") or
                                  p.name == "conftest.py" or any(d in ("tests", "test", "testing")
                                                                 for d in p.parts[:-1]))


def process(repo: RepoRecord, ctx: Context) -> FeasibleRepo:
    t0 = time.monotonic()
    files = repo_files(repo.path)
    rec = FeasibleRepo(key=repo.key, source=repo.source, path=repo.path, history=repo.history,
                       test_command=TEST_COMMAND)
    rec.test_files = sorted(p for p in files if is_test_file(p))
    rec.source_files = sorted(p for p in files if p.endswith(".py") and not is_protected(p, rec.test_files)
                              and p not in ("setup.py", "noxfile.py") and not _NOT_LIBRARY & set(p.split("/")[:-1]))
    if not rec.test_files:
        return rec.drop("no tests: no test files found")
    if not rec.source_files:
        return rec.drop("no source: every .py file is a test or protected")
    digest = hashlib.sha256(b"".join(k.encode() + v for k, v in sorted(files.items()))).hexdigest()[:16]
    rec.image = f"flashpost/synth-repo:{repo.key}-{digest}"
    ctx.note("installing the declared test dependencies")
    try:
        rec.test_env = testenv.resolve(files).to_dict()
        ctx.note("building the repository image")
        build_tree_image(files, rec.image)
    except RuntimeError as e:
        return rec.drop(f"build failed: {e}"[:1500])
    probe = probe_task(rec.image, rec.test_files)
    runs = []
    for i in range(BASELINE_RUNS):
        ctx.note(f"baseline run {i + 1}/{BASELINE_RUNS}")
        runs.append(run_suite(probe, "", timeout_s=300))
    rec.results = runs[0].statuses
    rec.passing = sorted(set.intersection(*(r.passed() for r in runs)))
    rec.seconds = time.monotonic() - t0
    if not runs[0].statuses:
        return rec.drop(f"tests do not run: {runs[0].why_not_run()}"[:1500])
    if not rec.passing:
        return rec.drop(f"no passing tests: {runs[0].reason}"[:1500])
    return rec
