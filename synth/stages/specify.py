"""Stage 3, specify: (feasible repository, candidate) -> a task specification. A candidate is a real
commit of the repository's history to invert (synth/invert.py; first, newest first, when the source
had history) or an AST mutation site. The broken state is run in a grader of the fixed state's image;
F2P = tests passing on the fixed state (twice, for commits) and failing on the broken one, P2P =
passing on both. The gold patch is broken -> fixed. The problem statement is written from observed
behaviour only (the failing tests' bodies without their names, and the assertion/exception lines),
then scanned for leaks: diff lines, the fixed code text, test function names, hashes, the commit's
subject. Any leak drops the candidate, and so does a statement that reads like an earlier task's
(synth/statement.py).

Not here: images of the broken state (build) or validating the task end to end (inspect).
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
import re
import time
from pathlib import Path

from envs.pool import GraderPool
from synth import history, invert, mutations
from synth.config import Context
from synth.records import FeasibleRepo, SpecRecord, StageStore
from synth.stages.build import build_tree_image
from synth.statement import StatementIndex, StatementWriter, statement_leaks, write_statement
from synth.testrun import SuiteRun, probe_task, run_suite

NAME = "specify"
BUDGET_S = 900.0  # seconds per unit (FactoryOptions.unit_budget_s overrides)
OUTPUT = SpecRecord
MAX_F2P = 8  # a mutant failing more tests than this is a broad breakage, not a focused bug
BASELINE_RUNS = 2  # runs of a commit's fixed state; a test must pass on each to count
Unit = tuple[FeasibleRepo, "mutations.Mutation | history.Commit"]


def units(repos: list[FeasibleRepo], ctx: Context) -> list[Unit]:
    """Per repository: its candidate commits (newest first), then every mutation site, kinds
    interleaved round-robin (seeded order)."""
    rng = random.Random(ctx.opts.seed)
    out: list[Unit] = []
    for repo in (r for r in repos if r.ok):
        out += [(repo, c) for c in invert.candidates(repo.history, ctx.opts.history_commits)]
        by_kind: dict[str, list[mutations.Mutation]] = {}
        for path in repo.source_files:
            source = (Path(repo.path) / path).read_text(errors="replace")
            try:
                found = mutations.find_mutations(path, source)
            except (SyntaxError, ValueError):
                continue
            for m in found:
                by_kind.setdefault(m.kind, []).append(m)
        queues = [rng.sample(ms, len(ms)) for _, ms in sorted(by_kind.items())]
        while any(queues):
            for q in queues:
                if q:
                    out.append((repo, q.pop()))
    return out


def unit_key(unit: Unit) -> str:
    repo, m = unit
    if isinstance(m, history.Commit):  # the hash of the hash: task ids do not carry commit ids
        return f"{repo.key}-commit-{hashlib.sha256(m.sha.encode()).hexdigest()[:10]}"
    h = hashlib.sha256(f"{m.path}:{m.lineno}:{m.col}:{m.end_col}:{m.new}".encode()).hexdigest()[:8]
    stem = re.sub(r"[^A-Za-z0-9]+", "-", Path(m.path).stem).strip("-").lower()
    return f"{repo.key}-{stem}-{m.kind.replace('_', '-')}-{m.lineno}-{h}"


def fix_needles(original: str, mutant_tree: dict[str, bytes], m: mutations.Mutation) -> list[str]:
    """Text of the fixed code that the mutant tree does not contain (the leak audit's needles)."""
    lines = original.splitlines()
    i = m.lineno - 1
    candidates = ["\n".join(lines[max(i - 1, 0):i + 2])]
    if len(lines[i].strip()) >= 24:
        candidates.append(lines[i].strip())
    blobs = list(mutant_tree.values())
    return [c for c in candidates if c.strip() and not any(c.encode() in b for b in blobs)]


def process(unit: Unit, ctx: Context) -> SpecRecord:
    if isinstance(unit[1], history.Commit):
        return process_commit(unit, ctx)
    repo, m = unit
    t0 = time.monotonic()
    rec = SpecRecord(key=unit_key(unit), task_id=unit_key(unit), repo_key=repo.key, repo_path=repo.path,
                     repo_image=repo.image, test_files=repo.test_files, origin={"kind": "mutation"},
                     mutation=m.to_dict())
    original = (Path(repo.path) / m.path).read_text()
    mutant = mutations.apply(original, m)
    rec.bug_patch = mutations.unified_diff(m.path, original, mutant)
    rec.gold_patch = mutations.unified_diff(m.path, mutant, original)
    ctx.note("running the suite on the mutant")
    run = run_suite(probe_task(repo.image, repo.test_files), rec.bug_patch, pool=ctx.shared_pool(repo.image))
    rec.seconds = time.monotonic() - t0
    if not _classify(rec, run, set(repo.passing), repo, ctx):
        return rec
    tree = {p: (Path(repo.path) / p).read_bytes() for p in repo.source_files + repo.test_files}
    tree[m.path] = mutant.encode()
    rec.needles = fix_needles(original, tree, m)
    if not rec.needles:
        return rec.drop("fix not distinctive: the fixed text exists elsewhere in the tree")
    return rec


def process_commit(unit: Unit, ctx: Context) -> SpecRecord:
    """Invert one commit: its tree is the fixed state (built as an image and run twice), the parent's
    non-test files over it the broken state (run once, as a patch, in the same grader)."""
    repo, commit = unit
    t0 = time.monotonic()
    key = unit_key(unit)
    dest = ctx.out_dir / NAME / "commits" / key
    rec = SpecRecord(key=key, task_id=key, repo_key=repo.key, repo_path=str(dest),
                     origin={"kind": "commit", "commit": commit.sha, "parent": commit.parent,
                             "subject": commit.subject})
    try:
        inv = invert.invert(repo.history, commit, dest)
    except (ValueError, RuntimeError) as e:
        return rec.drop(f"not invertible: {e}"[:500])
    rec.test_files, rec.overrides, rec.bug_patch, rec.gold_patch = (inv.test_files, inv.overrides, inv.bug_patch,
                                                                    inv.gold_patch)
    if not inv.overrides:
        return rec.drop("not invertible: no non-test file changes")
    digest = hashlib.sha256(b"".join(k.encode() + v for k, v in sorted(inv.fixed.items()))).hexdigest()[:16]
    rec.repo_image = f"flashpost/synth-repo:{repo.key}-{digest}"
    try:
        build_tree_image(inv.fixed, rec.repo_image)
    except RuntimeError as e:
        return rec.drop(f"build failed: {e}"[:1000])
    probe = probe_task(rec.repo_image, inv.test_files)
    with GraderPool(max_graders=1, graders_per_image=1) as pool:
        base = [run_suite(probe, "", pool=pool) for _ in range(BASELINE_RUNS)]
        passing = set.intersection(*(r.passed() for r in base))
        if not passing:
            rec.seconds = time.monotonic() - t0
            return rec.drop(f"fixed state fails: no test passes on the commit ({base[0].reason})"[:1000])
        run = run_suite(probe, inv.bug_patch, pool=pool)
    rec.seconds = time.monotonic() - t0
    statement_repo = dataclasses.replace(repo, path=str(dest), test_files=inv.test_files)
    if not _classify(rec, run, passing, statement_repo, ctx):
        return rec
    rec.needles = invert.needles(inv, commit)
    if len(rec.needles) <= 2:  # only the commit ids: nothing of the fix itself to search for
        return rec.drop("fix not distinctive: the fixed text exists elsewhere in the tree")
    return rec


def _classify(rec: SpecRecord, run: SuiteRun, passing: set[str], repo: FeasibleRepo, ctx: Context) -> bool:
    """F2P/P2P from the broken state's run, then the statement and its leak scan; False: dropped."""
    if not run.statuses:  # nothing reported: the suite could not even be collected
        category = "breaks collection" if run.agreement else "broken run failed"
        rec.drop(f"{category}: no test results ({run.reason})"[:1000])
        return False
    broken = sorted(t for t in passing if run.statuses.get(t, "missing") != "passed")
    if any(run.statuses.get(t, "missing") == "missing" for t in broken):
        rec.drop("breaks collection: tests vanish in the broken state")
    elif not broken:
        rec.drop("equivalent mutant: no passing test fails" if rec.mutation else
                 "no failing test: every test of the commit passes on the parent's code")
    elif len(broken) > MAX_F2P:
        rec.drop(f"too broad: {len(broken)} tests fail")
    if not rec.ok:
        return False
    rec.f2p, rec.p2p = broken, sorted(passing - set(broken))
    rec.failures = {t: run.messages.get(t, "") for t in broken}
    writer: StatementWriter = ctx.hooks.get("statement_writer", write_statement)
    rec.problem_statement, rec.quoted = writer(rec, repo)
    leaks = statement_leaks(rec.problem_statement, rec, rec.f2p + rec.p2p)
    if leaks:
        rec.drop("statement leak: " + "; ".join(leaks)[:500])
    elif not rec.quoted:
        rec.drop("no observable failure to describe")
    else:
        twin = _statements(ctx).near_duplicate(rec.key, rec.repo_key, rec.problem_statement)
        if twin:
            rec.drop(f"near-duplicate statement: reads like the statement of {twin}")
    return rec.ok


def _statements(ctx: Context) -> StatementIndex:
    """The run's statements so far (this stage's journal, then each new ok spec), shared by its threads."""
    def load() -> StatementIndex:
        done = StageStore(ctx.out_dir, NAME, OUTPUT).load().values()
        return StatementIndex({r.key: (r.repo_key, r.problem_statement) for r in done if r.ok})

    return ctx.shared("specify:statements", load)
