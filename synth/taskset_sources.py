"""The sources that write task sets (synth/taskset.py), the demonstrations they record, the image
recipes that rebuild a missing task image, and the named sets shipped in conf/tasksets/.

Sources (SOURCES, the `--source` of `flashpost-factory build`):
  repo      a factory run folder (synth/runner.py): the inspector's accepted tasks, one demonstration
            per solver whose patch passed;
  families  the demo's synthetic one-function families (synth/families.py) as repository tasks in one
            image; family A carries multi-turn demonstrations (tests, view, short edit, tests, submit; a share
            with a failed first edit and its recovery), family B is tests only;
  fixtures  the hand-made fixture tasks (envs/fixtures), the gold patch as the demonstration;
  toy       the in-process toy family (rl/rollout.py) of CPU runs and tests; no container.
A demonstration of a sandbox task is a real episode (envs/episode.py) in the task's image: the solver's
patch is replayed as tool calls (run the tests, apply the patch, run them again, submit) and kept only
when the pristine grader gives it reward 1, so its observations are what the agent would see (family
scripts run in warm sandboxes and are graded in one batch: `replay_family_demos`). A family task's
grading budget is measured by grading a gold patch of its template (`family_grading_budgets`); the
factory's tasks carry the inspector's (synth/stages/inspect.py); fixture and toy tasks record none.
Not here: the on-disk format (synth/taskset.py) or the factory stages (synth/stages/).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tqdm import tqdm

from synth.taskset import Demo, TaskRow, TaskSet, TaskSetError, assign_splits

log = logging.getLogger(__name__)
CONF_TASKS = Path(__file__).resolve().parent.parent / "conf" / "tasksets"
HELDOUT_SHARE = 0.25


# ---------------------------------------------------------------------- demonstrations
def _call(name: str, arguments: dict[str, Any] | None = None, content: str = "") -> dict[str, Any]:
    return {"role": "assistant", "content": content, "tool_calls": [{"name": name, "arguments": arguments or {}}]}


def _script(task, patch: str) -> list[dict[str, Any]]:
    body = patch if patch.endswith("\n") else patch + "\n"
    apply = f"cd /workspace && git apply <<'FLASHPOST_PATCH'\n{body}FLASHPOST_PATCH"
    return [_call("run_tests", content="I will run the tests to see what fails."),
            _call("bash", {"command": apply}, "I will apply the fix."),
            _call("run_tests", content="I will check that the tests pass now."), _call("submit")]  # fmt: skip


def family_script(inst, wrong: tuple[str, str] | None = None) -> list[dict[str, Any]]:
    """A family episode as terse tool calls (no prose: every assistant token is decode and loss): view the
    line the statement names, edit it, run the tests, submit; with `wrong` (synth.families.wrong_edits), a
    failed first edit, its test result and the correcting edit before the final check."""
    from synth.families import apply_action, split_action

    def edit(source: str, action: str) -> dict[str, Any]:
        line, old, new = split_action(source, action)
        return _call("edit", {"line": inst.offset + line, "old_str": old, "new_str": new})

    calls = [_call("view", {"view_range": [inst.line, inst.line]})]
    if wrong is None:
        calls.append(edit(inst.buggy, inst.action))
    else:
        calls += [edit(inst.buggy, wrong[0]), _call("run_tests"), edit(apply_action(inst.buggy, wrong[0]), wrong[1])]
    return calls + [_call("run_tests"), _call("submit")]


async def _replay(task, script: list[dict[str, Any]], **episode_kw):
    """Run `script` as the policy of a real episode of `task` (the agent's view: no gold patch)."""
    from envs.episode import EpisodeConfig, run_episode
    from model.chat_template import assistant_text

    turns = iter(script)

    def policy(messages) -> str:
        return assistant_text(next(turns))

    agent_view = dataclasses.replace(task, gold_patch="")
    config = EpisodeConfig(max_turns=len(script), wall_time_s=600.0)
    return await run_episode(agent_view, policy, config=config, **episode_kw)


def _demo(task, script: list[dict[str, Any]], solver: str, transcript) -> Demo:
    """The transcript with the script's own assistant messages (structured tool calls) in place."""
    assistant = iter(script)
    messages = []
    for m in transcript.messages:
        if m.role == "assistant":
            messages.append(next(assistant))
        else:
            messages.append({"role": m.role, "content": m.content, **({"name": m.name} if m.name else {})})
    return Demo(id=f"{task.task_id}/{solver}", task_id=task.task_id, solver=solver, messages=messages)


def replay_demo(task, patch: str, solver: str) -> Demo | None:
    """The transcript of an episode that applies `patch` through tool calls, graded by the pristine
    grader; None when the replay does not earn reward 1 (the run is not a verified solve)."""
    import asyncio

    from envs.grading import grade_patch

    script = _script(task, patch)
    res = asyncio.run(_replay(task, script, grade=lambda _t, diff: grade_patch(task, diff)))
    if res.reward != 1.0:
        log.info("demonstration of %s by %s not kept: %s %s", task.task_id, solver, res.transcript.termination,
                 res.grade.reason if res.grade else res.transcript.error)
        return None
    return _demo(task, script, solver, res.transcript)


class WarmSandboxes:
    """`k` agent sandboxes of one image reused across replays of OUR scripts (never a policy's: RL and
    evaluation episodes get a fresh container each, envs/pool.py), each reset to the image's commit after
    an episode. `lend(task)` records the task's file (verification["file"]) as the episode left it, for
    the batch grader."""

    def __init__(self, image: str, k: int):
        from envs.sandbox import Sandbox

        self.free = [Sandbox(image, labels={"flashpost.role": "demo-replay"}).start() for _ in range(k)]
        self.files: dict[str, str] = {}

    @contextlib.contextmanager
    def lend(self, task):
        sb = self.free.pop()  # callers hold a semaphore of k: never empty here
        try:
            yield sb
            path = task.verification["file"]
            self.files[task.task_id] = sb.read_file(f"/workspace/{path}").decode()
        finally:
            r = sb.exec("git checkout -q -- . && git clean -fdq", timeout=60, workdir="/workspace")
            if r.exit_code != 0:
                raise RuntimeError(f"could not reset a demo sandbox: {r.output[-500:]}")
            self.free.append(sb)

    def close(self) -> None:
        for sb in self.free:
            sb.close()


def replay_family_demos(jobs: list[tuple[Any, list[dict[str, Any]], str]], *, sandboxes: int = 2,
                        progress: bool = True) -> list[Demo]:  # fmt: skip
    """Demonstrations of (task, script, solver) jobs of one image: each script replayed as a real episode
    in a warm sandbox, every final file graded by the batch grader in a pristine grader container
    (envs/batch_grading.py, one exec for many); only reward-1 replays are kept."""
    import asyncio

    from envs.batch_grading import grade_batch
    from envs.pool import GraderPool

    if not jobs:
        return []
    (image,) = {t.image for t, _, _ in jobs}
    warm = WarmSandboxes(image, sandboxes)
    bar = tqdm(total=len(jobs), desc="demonstrations", unit="run", disable=not progress)

    async def one(sem, task, script):
        async with sem:
            res = await _replay(task, script, sandbox_factory=warm.lend)
        bar.update()
        return res

    async def all_jobs():
        sem = asyncio.Semaphore(sandboxes)
        return await asyncio.gather(*(one(sem, t, s) for t, s, _ in jobs))

    try:
        results = asyncio.run(all_jobs())
    finally:
        bar.close()
        warm.close()
    done = [(j, r) for j, r in zip(jobs, results, strict=True)
            if r.transcript.termination == "submit" and j[0].task_id in warm.files]  # fmt: skip
    with GraderPool(max_graders=1) as pool:
        grades = grade_batch([(t, {t.verification["file"]: warm.files[t.task_id]}) for (t, _, _), _ in done],
                             pool=pool)  # fmt: skip
    out = []
    for ((task, script, solver), res), g in zip(done, grades, strict=True):
        if g.reward == 1.0:
            out.append(_demo(task, script, solver, res.transcript))
        else:
            log.info("demonstration of %s by %s not kept: %s", task.task_id, solver, g.reason)
    return out


def family_grading_budgets(tasks: list, progress: bool = True) -> None:
    """Set each family task's verification["gold_grading_s"] and ["grading_budget_s"] (envs/grading.py
    `grading_budget`) from one grading of the gold patch of the first task of its template, in a pristine
    grader through pytest, as episodes are graded (the demonstrations' batch grader runs the tests without
    pytest, far faster than an episode's grading). One per template: every instance of a template runs
    the template's correct code, renamed, on the same calls and asserts, so they share its time. A gold
    patch that does not score 1 stops the build."""
    from envs.grading import budget_fields
    from envs.pool import GraderPool
    from synth.testrun import run_suite

    first: dict[int, Any] = {}
    for t in tasks:
        first.setdefault(t.verification["template"], t)
    seconds = {}
    with GraderPool(max_graders=1) as pool:
        for template, task in tqdm(sorted(first.items()), desc="gold gradings", unit="template", disable=not progress):
            run = run_suite(task, task.gold_patch, pool=pool)
            if run.reward != 1.0:
                raise TaskSetError(f"the gold patch of family task {task.task_id} (template {template}) scored 0 "
                                   f"in the grader: {run.why_not_run()}")  # fmt: skip
            seconds[template] = round(run.grading_s, 3)
    for t in tasks:
        t.verification |= budget_fields([seconds[t.verification["template"]]])


def _demos(rows: list[TaskRow], patches: dict[str, dict[str, str]], progress: bool) -> list[Demo]:
    """Replayed demonstrations for {task id: {solver: patch}}."""
    by_id = {r.id: r for r in rows}
    jobs = [(tid, s, p) for tid, sp in patches.items() for s, p in sp.items() if p]
    out = []
    for tid, solver, patch in tqdm(jobs, desc="demonstrations", unit="run", disable=not progress):
        demo = replay_demo(by_id[tid].task(), patch, solver)
        if demo is not None:
            out.append(demo)
    return out


# ---------------------------------------------------------------------- image recipes
def _rebuild_fixture(recipe: dict) -> str:
    from envs.fixtures.build import build_task_image, fixture_tasks

    (task,) = [t for t in fixture_tasks(build=False) if t.task_id == recipe["task_id"]]
    return build_task_image(task).image_digest


def _rebuild_families(recipe: dict) -> str:
    from synth.families import family_tasks

    instances = _family_instances(recipe["n_a"], recipe["n_b"], recipe["n_heldout"], recipe["seed"])
    return family_tasks(instances)[0].image_digest


def _rebuild_tree(recipe: dict) -> str:
    from synth.records import TaskRecord
    from synth.stages.build import build_tree_image, task_files

    if not Path(recipe["repo_path"]).is_dir():
        raise TaskSetError(f"image {recipe['image']} is missing and its tree {recipe['repo_path']} is gone: rebuild "
                           f"it with `{recipe['command']}`")  # fmt: skip
    rec = TaskRecord(key="", repo_path=recipe["repo_path"], mutation=recipe["mutation"], overrides=recipe["overrides"])
    return build_tree_image(task_files(rec), recipe["image"])


RECIPES: dict[str, Callable[[dict], str]] = {"fixture": _rebuild_fixture, "families": _rebuild_families,
                                             "tree": _rebuild_tree}  # fmt: skip


def ensure_images(rows: list[TaskRow]) -> None:
    """Rebuild every missing image of sandbox rows from its recorded recipe (one log line each); a row
    whose recipe cannot run stops here with the command that rebuilds its set."""
    from envs import engine

    done: set[str] = set()
    for r in rows:
        if r.env != "sandbox" or r.image in done:
            continue
        done.add(r.image)
        if engine.image_exists(r.image):
            continue
        kind = r.image_recipe.get("kind")
        if kind not in RECIPES:
            raise TaskSetError(f"image {r.image} of task {r.id!r} is missing and the set records no recipe for it; "
                               f"rebuild the set with `{r.image_recipe.get('command', 'flashpost-factory build')}`")
        print(f"[flashpost] image {r.image} of task {r.id} is missing: rebuilding it from its recipe ({kind})")
        RECIPES[kind](r.image_recipe)


# ---------------------------------------------------------------------- sources
def toy_messages(task: dict[str, Any]) -> list[dict[str, Any]]:
    """A solving conversation of a toy task (ToyTask fields): every reply holds the target."""
    t = task["target"]
    msgs = [{"role": "user", "content": task["prompt"]}]
    for turn in range(task["n_turns"]):
        msgs.append({"role": "assistant", "content": f"Here: {t}{t} {t}."})
        if turn + 1 < task["n_turns"]:
            msgs.append({"role": "tool", "content": f"observation {turn}: keep going"})
    return msgs


def toy_source(n: int = 8, n_turns: int = 2, seed: int = 0, heldout_share: float = HELDOUT_SHARE,
               progress: bool = True) -> TaskSet:  # fmt: skip
    from rl.rollout import toy_tasks

    rows, demos = [], []
    for t in toy_tasks(n, n_turns=n_turns):
        rows.append(TaskRow(id=t.task_id, env="toy", source={"generator": "toy", "seed": seed}, family="toy",
                            group=t.task_id, problem_statement=t.prompt, payload=vars(t)))  # fmt: skip
        demos.append(Demo(id=f"{t.task_id}/gold", task_id=t.task_id, solver="gold", messages=toy_messages(vars(t))))
    meta = {"sources": [{"generator": "toy", "n": n, "n_turns": n_turns}]}
    return TaskSet(assign_splits(rows, heldout_share), demos, meta)


def toy_set(n: int, n_turns: int, heldout_share: float = HELDOUT_SHARE) -> Path:
    """A cached toy task set of n tasks (benches and tests that size their toy family; heldout_share 0:
    every task trains)."""
    from synth import taskset

    out = cache_root() / f"toy-n{n}-t{n_turns}-h{heldout_share}-v{taskset.SCHEMA_VERSION}"
    if not (out / taskset.META_FILE).exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        taskset.save(toy_source(n=n, n_turns=n_turns, heldout_share=heldout_share), out)
    return out


def _sandbox_row(task, **kw) -> TaskRow:
    return TaskRow(id=task.task_id, repo=task.repo, base_revision=task.base_revision, image=task.image,
                   image_digest=task.image_digest, problem_statement=task.problem_statement,
                   test_command=task.test_command, test_parser=task.test_parser, f2p=task.f2p, p2p=task.p2p,
                   gold_patch=task.gold_patch, test_files=task.test_files, test_patch=task.test_patch,
                   verification=task.verification, tools=task.tools, **kw)  # fmt: skip


def fixture_source(progress: bool = True) -> TaskSet:
    from envs.fixtures.build import fixture_tasks

    tasks = fixture_tasks(build=True)
    rows = [_sandbox_row(t, env="sandbox", source={"generator": "fixtures", "seed": 0}, family="fixtures",
                         group=t.task_id, image_recipe={"kind": "fixture", "task_id": t.task_id})
            for t in tasks]  # fmt: skip
    rows = assign_splits(rows, HELDOUT_SHARE)
    demos = _demos(rows, {t.task_id: {"gold": t.gold_patch} for t in tasks}, progress)
    return TaskSet(rows, demos, {"sources": [{"generator": "fixtures"}]})


def _family_instances(n_a: int, n_b: int, n_heldout: int, seed: int):
    from synth.families import demo_splits

    sets = demo_splits(n_a, n_b, n_heldout, seed)
    return [inst for key in ("A_train", "B_train", "A_heldout", "B_heldout") for inst in sets[key]]


def families_source(n_a: int = 8, n_b: int = 4, n_heldout: int = 4, seed: int = 0, recovery_share: float = 0.25,
                    sandboxes: int = 2, progress: bool = True) -> TaskSet:  # fmt: skip
    """Family A and B instances as tasks in one image: n_a / n_b train instances and n_heldout held-out
    instances of each family (fresh draws of the same templates, never equal to a train instance:
    DEMO_NOTES' held-out measure; family B's templates are never demonstrated). Every family-A train task
    gets a replayed demonstration (synth.families via `family_script`), `recovery_share` of them with a
    failed first edit and its recovery where the instance has a plausible wrong edit. Every task gets a
    measured grading budget (`family_grading_budgets`)."""
    import random

    from synth.families import family_tasks, wrong_edits

    instances = _family_instances(n_a, n_b, n_heldout, seed)
    print(f"[flashpost] families: {len(instances)} instances; building their image")
    tasks = family_tasks(instances)
    family_grading_budgets(tasks, progress)
    recipe = {"kind": "families", "n_a": n_a, "n_b": n_b, "n_heldout": n_heldout, "seed": seed}
    rows = [_sandbox_row(t, env="sandbox", source={"generator": "families", "seed": seed}, family=inst.family,
                         group=inst.iid, split=inst.split, image_recipe=recipe)
            for t, inst in zip(tasks, instances, strict=True)]  # fmt: skip
    train_a = [(t, inst) for t, inst in zip(tasks, instances) if inst.family == "A" and inst.split == "train"]
    rng = random.Random(f"recovery/{seed}")
    wrong = {t.task_id: w for t, inst in train_a if (w := wrong_edits(inst))}
    recover = set(rng.sample(sorted(wrong), min(len(wrong), round(recovery_share * len(train_a)))))
    jobs = [(t, family_script(inst, rng.choice(wrong[t.task_id])), "recovery") if t.task_id in recover
            else (t, family_script(inst), "gold") for t, inst in train_a]  # fmt: skip
    demos = replay_family_demos(jobs, sandboxes=sandboxes, progress=progress)
    meta = {"sources": [recipe | {"generator": "families", "recovery_share": recovery_share}]}
    return TaskSet(rows, demos, meta)


def repo_source(out_dir: str | Path, progress: bool = True) -> TaskSet:
    """The accepted tasks of factory run folder `out_dir`, with its funnel."""
    from envs.task import Task
    from synth.config import FactoryOptions
    from synth.records import FeasibleRepo, RepoRecord, StageStore, TaskRecord
    from synth.runner import stats

    out = Path(out_dir).resolve()
    opts = FactoryOptions.from_dict(json.loads((out / "options.json").read_text()))
    command = f"flashpost-factory build --repo {opts.repo} --out {out} --budget {opts.task_budget} --seed {opts.seed}"
    repos = StageStore(out, "ingest", RepoRecord).load()
    feasible = StageStore(out, "feasibility", FeasibleRepo).load()
    rows, patches = [], {}
    for rec in sorted((r for r in StageStore(out, "inspect", TaskRecord).load().values() if r.ok), key=lambda r: r.key):
        task = Task.from_dict(rec.task)
        repo = repos.get(task.repo)
        m = rec.mutation
        group = f"{task.repo}:{m['path']}::{m.get('function') or m.get('lineno')}" if m else \
            f"{task.repo}@{rec.origin.get('commit', task.task_id)}"  # fmt: skip
        matrix = [x for row in rec.pass_matrix.values() for x in row]
        recipe = {"kind": "tree", "image": task.image, "repo_path": rec.repo_path, "mutation": rec.mutation,
                  "overrides": rec.overrides, "command": command}  # fmt: skip
        fr = feasible.get(task.repo)
        # a git source's commit; else the content hash of the tree (the pristine image's tag)
        revision = (repo.head if repo else "") or (f"tree:{fr.image.rsplit('-', 1)[-1]}" if fr else "")
        source = {"repo": fr.source if fr else task.repo, "revision": revision}
        rows.append(_sandbox_row(task, env="sandbox", source=source, family=Path(source["repo"]).name or task.repo,
                                 group=group, image_recipe=recipe,
                                 difficulty=round(1.0 - sum(matrix) / len(matrix), 4) if matrix else 1.0))
        patches[task.task_id] = dict(rec.solutions)
    if not rows:
        raise TaskSetError(f"factory run {out} accepted no task, so there is no task set to write; see "
                           f"`flashpost-factory stats {out}` for the drop reasons and build with a larger --budget")
    rows = assign_splits(rows, HELDOUT_SHARE)
    meta = {"sources": [{"repo": opts.repo, "out_dir": str(out)}], "funnel": stats(out)["funnel"]}
    return TaskSet(rows, _demos(rows, patches, progress), meta)


SOURCES: dict[str, Callable[..., TaskSet]] = {"repo": repo_source, "families": families_source,
                                              "fixtures": fixture_source, "toy": toy_source}  # fmt: skip


# ---------------------------------------------------------------------- named sets
def named_sets() -> list[str]:
    return sorted(p.stem for p in CONF_TASKS.glob("*.yaml"))


def cache_root() -> Path:
    import os

    return Path(os.environ.get("FLASHPOST_CACHE", Path.home() / ".cache" / "flashpost")) / "tasksets"


def resolve(spec: str, progress: bool = True) -> Path:
    """A task-set folder for `spec`: a path to one, or the name of a shipped set (conf/tasksets/NAME.yaml:
    `source` and its arguments), written to the cache on first use (keyed by the entry's content)."""
    import yaml

    from synth import taskset

    path = Path(spec)
    if (path / taskset.META_FILE).exists() or "/" in spec or path.exists():
        return path
    entry = CONF_TASKS / f"{spec}.yaml"
    if not entry.exists():
        raise TaskSetError(f"tasks={spec!r} is neither a task-set folder nor a shipped set; shipped: {named_sets()} "
                           "(conf/tasksets/), or write one with `flashpost-factory build --out DIR` and pass "
                           "tasks=DIR/taskset")
    doc = yaml.safe_load(entry.read_text())
    key = hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:12]
    out = cache_root() / f"{spec}-{key}"
    if not (out / taskset.META_FILE).exists():
        args = {k: v for k, v in doc.items() if k != "source"}
        print(f"[flashpost] writing shipped task set {spec!r} (source {doc['source']}) to {out}")
        out.parent.mkdir(parents=True, exist_ok=True)
        taskset.save(SOURCES[doc["source"]](progress=progress, **args), out)
    return out
