"""Family F: the tasks the environment factory builds from the bundled sample repository, put in the
demo's prompt and action format so the demo policy can be trained and scored on them.

`build_sample_tasks` runs every factory stage (synth/runner.py: ingest -> feasibility -> specify ->
build -> solve -> inspect) on synth/sample_repo, in a folder of its own, so it resumes like any
factory run. `factory_instances` turns each accepted task into an `Instance` of family F:
  - the function is the one the task's bug is in, taken from the broken file whole and numbered from
    1, as the families show theirs. So family F, like A and B, tells the policy which function to
    repair; the line and the edit are the policy's to find.
  - the observation is the first assert of the task's first F2P test that fails on the broken code,
    with the value it got: `assert call == want  # got value`, as the families write it. It comes
    from running that test's statements one by one in a sandbox of the task's own image; the
    factory runs repository code in sandboxes only.
  - the demonstration is the solver ensemble's patch (the inspector accepted it), as the shortest
    ` <line>|<old>=><new>` edit of the function.
Tasks whose fix is not one short edit inside one top-level function, or whose prompt is too long
for the demo's rows, are left out (`why` says which). Splits: `heldout_ids`.

F instances are graded by the real batch grader on the repository's pristine image (the fixed
state): a candidate rewrites the whole broken file with its edit, so the pristine image plus that
file is the task's broken image plus the edit, and all of a split's candidates go in one exec. The
grading Task keeps the factory task's F2P and P2P ids (every test of the repository).
Not here: the factory stages (synth/stages/) or how the demo trains (rl/demo_learning.py).
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import json
from pathlib import Path

from envs.sandbox import Sandbox
from envs.task import Task
from synth.config import FactoryOptions
from synth.families import Instance, gold_action
from synth.mutations import Mutation, apply
from synth.records import FeasibleRepo, StageStore, TaskRecord

MAX_PROMPT_CHARS = 600  # numbered function + observation; ~200 tokens, inside the demo's 256-token rows
MAX_FUNCTION_LINES = 16
GRADE_TIMEOUT_S = 10.0  # a candidate runs the repository's whole suite (pytest imported), not one function

# Runs the statements of one test function in order and reports the first that fails (stdlib only;
# argv: test file, test name). An `assert a == b` reports the value of `a`.
PROBE = r'''
import ast, json, sys
sys.dont_write_bytecode = True
sys.path.insert(0, "/workspace")
path, name = sys.argv[1], sys.argv[2]
src = open(path).read()
tree = ast.parse(src)
ns = {"__name__": "probe"}
exec(compile(tree, path, "exec"), ns)
fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
def value(node):
    return eval(compile(ast.Expression(node), path, "eval"), ns)
out = None
for stmt in fn.body:
    seg = ast.get_source_segment(src, stmt)
    t = stmt.test if isinstance(stmt, ast.Assert) else None
    try:
        if isinstance(t, ast.Compare) and len(t.ops) == 1 and isinstance(t.ops[0], ast.Eq):
            got = value(t.left)
            if got != value(t.comparators[0]):
                out = {"line": seg, "got": repr(got)}
        else:
            exec(compile(ast.Module([stmt], []), path, "exec"), ns)
    except AssertionError:
        out = {"line": seg, "got": "False"}
    except BaseException as e:
        out = {"line": seg, "got": "raises " + type(e).__name__}
    if out:
        break
print(json.dumps(out))
'''


def sample_factory_options(out_dir: Path, budget: int, seed: int) -> FactoryOptions:
    return FactoryOptions(repo="sample", out_dir=str(out_dir), task_budget=budget, seed=seed, concurrency=2)


def build_sample_tasks(out_dir: Path, budget: int, seed: int, progress: bool = True) -> dict:
    """Run (or resume) the whole factory on the sample repository; returns its stats."""
    from synth.runner import run_factory

    return run_factory(sample_factory_options(out_dir, budget, seed), progress=progress)


def heldout_ids(task_ids: list[str], heldout_share: float) -> set[str]:
    """The first round(share x n) ids in the order of their hashes: a deterministic split with the
    share kept whatever n (a coin per task left one seed with 7 train tasks and none held out)."""
    ranked = sorted(task_ids, key=lambda t: hashlib.sha256(t.encode()).hexdigest())
    return set(ranked[: round(heldout_share * len(ranked))])


def _function(source: str, name: str) -> tuple[int, int] | None:
    """(first line index, end line index) of top-level function `name` in source (0-based, end exclusive)."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            start = node.decorator_list[0].lineno if node.decorator_list else node.lineno
            return start - 1, node.end_lineno
    return None


def _lines(text: str, span: tuple[int, int]) -> str:
    return "".join(text.splitlines(keepends=True)[span[0] : span[1]])


def _apply(files: dict[str, str], patch: str) -> dict[str, str]:
    """`files` with a one-file `git diff` applied (a solver's patch; the mutation itself is applied in
    process by synth.mutations.apply)."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        for rel, body in files.items():
            (Path(d) / rel).parent.mkdir(parents=True, exist_ok=True)
            (Path(d) / rel).write_text(body)
        subprocess.run(["git", "apply", "-"], input=patch, text=True, cwd=d, check=True, capture_output=True)
        return {rel: (Path(d) / rel).read_text() for rel in files}


def observe(task: Task) -> str | None:
    """`assert call == want  # got value` for the first failing statement of the task's first F2P
    test, run in a sandbox of the task's image; None when nothing fails there."""
    from envs import engine

    if not engine.image_exists(task.image):
        raise RuntimeError(f"task image {task.image} is gone (removed since the factory built it): delete the "
                           f"factory's run folder (for the demo, run_dir/factory) and run again to rebuild it")
    path, _, name = task.f2p[0].partition("::")
    with Sandbox(task.image) as sb:
        r = sb.exec(["python3", "-I", "-c", PROBE, path, name], timeout=60, workdir="/workspace")
    lines = r.output.strip().splitlines()
    doc = json.loads(lines[-1]) if r.exit_code == 0 and lines else None
    if not doc:
        return None
    line = " ".join(part.strip() for part in doc["line"].splitlines())
    return f"{line}  # got {doc['got']}"


def factory_instances(out_dir: Path, heldout_share: float = 0.5) -> tuple[list[Instance], dict[str, Task], dict]:
    """Family F instances of the accepted tasks in factory folder `out_dir`, their grading Tasks by
    iid, and {task id: why} for the tasks left out."""
    repos = StageStore(out_dir, "feasibility", FeasibleRepo).load()
    accepted = sorted((r for r in StageStore(out_dir, "inspect", TaskRecord).load().values() if r.ok),
                      key=lambda r: r.key)  # fmt: skip
    instances, tasks, left_out = [], {}, {}
    for rec in accepted:
        task = Task.from_dict(rec.task)
        if not rec.mutation or rec.overrides:
            left_out[task.task_id] = "not an AST mutation of one file"  # inverted commits: many files
            continue
        m = Mutation(**rec.mutation)
        path, func = m.path, m.function
        fixed = (Path(rec.repo_path) / path).read_text()  # the gold patch takes the mutant back to this
        broken = apply(fixed, m)
        span = _function(broken, func) if func else None
        solution = rec.solutions.get("search") or next(iter(rec.solutions.values()), "")
        if span is None or span[1] - span[0] > MAX_FUNCTION_LINES or not solution:
            left_out[task.task_id] = "bug not in a short top-level function, or no solver solution"
            continue
        solved = _apply({path: broken}, solution)[path]
        if _function(fixed, func) != span or _function(solved, func) != span:
            left_out[task.task_id] = "the fix changes the function's length"
            continue
        buggy_fn = _lines(broken, span)
        demo = gold_action(buggy_fn, _lines(solved, span))  # the solver's fix, as a short edit
        if demo is None or gold_action(buggy_fn, _lines(fixed, span)) is None:
            left_out[task.task_id] = "the fix is not one short edit"
            continue
        first_fail = observe(task)
        iid = f"F-{task.task_id.rsplit('-', 1)[-1]}"
        inst = Instance(
            iid=iid, family="F", split="", template=-1, func=func,
            correct=_lines(solved, span), buggy=buggy_fn, tests=(), first_fail=first_fail or "",
            action=demo, kind=m.kind, path=path, offset=span[0], file=broken,
        )  # fmt: skip
        if first_fail is None or len(inst.prompt) > MAX_PROMPT_CHARS:
            left_out[task.task_id] = "no failing assert observed" if first_fail is None else "prompt too long"
            continue
        instances.append(inst)
        repo = repos[task.repo]
        tasks[iid] = dataclasses.replace(
            task, image=repo.image, image_digest="",
            verification={**task.verification, "sources": sorted(repo.source_files),
                          "grading": "batch on the pristine image", "timeout_s": GRADE_TIMEOUT_S},
        )  # fmt: skip
    held = heldout_ids([i.iid for i in instances], heldout_share)
    instances = [dataclasses.replace(i, split="heldout" if i.iid in held else "train") for i in instances]
    return instances, tasks, left_out
