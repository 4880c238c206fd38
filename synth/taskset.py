"""The task-set format: the one on-disk form of tasks that the factory writes and every trainer and the
evaluator read.

A task set is a Hugging Face `datasets` folder (`DatasetDict.save_to_disk`) with two tables,
  tasks           one row per task (TASK_FEATURES): id, env ("sandbox": a Docker repository task;
                  "toy": the in-process family of CPU runs), source (repository + revision, or
                  generator + seed), family, group, split, the image by name and content hash plus the
                  recipe that rebuilds it, the statement, F2P / P2P ids, the gold patch, the grading
                  fields of envs.task.Task, verification metadata (gates, flake rates, solver pass
                  matrix) and a difficulty estimate in [0, 1];
  demonstrations  one row per verified solver run (DEMO_FEATURES): the multi-turn transcript as chat
                  template messages (assistant `tool_calls`, `tool` observations), linked by task_id;
plus `taskset.json` (schema version, sources, the factory funnel) and a README.md card (counts per
split and family). Nested values (source, recipe, verification, payload, messages) are JSON strings, so
the Arrow schema is fixed whatever a source records.

The split comes from the task's group (near-duplicates share one: the same function of the same file,
the same commit, the same template), never from the task alone: groups in the order of their sha256
are held out first, round(heldout_share x groups) of them, so one group never straddles splits.
The gold patch is a column of this table only: the agent's sandbox starts from the image, which the
factory audits for fix text, and readers hand episodes a Task without it (`TaskRow.agent_task`).
Not here: what a source produces (synth/taskset_sources.py) or how trainers consume rows (rl/).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1
META_FILE = "taskset.json"
ENVS = ("sandbox", "toy")
SPLITS = ("train", "heldout")
JSON_FIELDS = ("source", "image_recipe", "verification", "payload")


class TaskSetError(ValueError):
    """A task set cannot be used; the message names the problem and the fix."""


@dataclass(kw_only=True)
class TaskRow:
    id: str
    env: str = "sandbox"
    source: dict[str, Any] = field(default_factory=dict)  # {"repo", "revision"} or {"generator", "seed"}
    family: str = ""  # the source's family ("A", "fixtures", the repository name, ...)
    group: str = ""  # near-duplicate group; decides the split
    split: str = "train"
    image: str = ""
    image_digest: str = ""  # the engine's content id of `image` when the set was written
    image_recipe: dict[str, Any] = field(default_factory=dict)  # synth.taskset_sources.RECIPES entry + args
    problem_statement: str = ""
    f2p: list[str] = field(default_factory=list)
    p2p: list[str] = field(default_factory=list)
    gold_patch: str = ""
    test_patch: str = ""
    test_files: list[str] = field(default_factory=list)
    test_command: str = ""
    test_parser: str = "junit"
    repo: str = ""
    base_revision: str = ""
    verification: dict[str, Any] = field(default_factory=dict)
    difficulty: float = 0.0  # 1 - the solvers' pass rate (0: every solver attempt passed)
    payload: dict[str, Any] = field(default_factory=dict)  # env "toy": prompt, target, n_turns
    tools: list[str] = field(default_factory=list)  # the tools an agent is offered (envs.task.Task.tools)

    def to_row(self) -> dict[str, Any]:
        row = dataclasses.asdict(self)
        for k in JSON_FIELDS:
            row[k] = json.dumps(row[k], sort_keys=True)
        return row

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> TaskRow:
        doc = dict(row)
        for k in JSON_FIELDS:
            doc[k] = json.loads(doc[k])
        doc["f2p"], doc["p2p"], doc["test_files"] = list(doc["f2p"]), list(doc["p2p"]), list(doc["test_files"])
        doc["tools"] = list(doc.get("tools") or [])  # sets written before the column: every tool
        return cls(**doc)

    def task(self):
        """The envs.task.Task of a sandbox row (gold patch included: graders and writers only)."""
        from envs.task import Task

        return Task(task_id=self.id, repo=self.repo, base_revision=self.base_revision, image=self.image,
                    image_digest=self.image_digest, problem_statement=self.problem_statement,
                    test_command=self.test_command, test_parser=self.test_parser, f2p=self.f2p, p2p=self.p2p,
                    gold_patch=self.gold_patch, test_files=self.test_files, test_patch=self.test_patch,
                    verification=self.verification, tools=self.tools)  # fmt: skip

    def agent_task(self):
        """The Task an agent episode gets: no gold patch (grading needs none: it applies the agent's diff
        and test_patch to the pristine image)."""
        return dataclasses.replace(self.task(), gold_patch="")


@dataclass(kw_only=True)
class Demo:
    id: str
    task_id: str
    solver: str  # "search", "gold", "llm", ... (the run that produced the transcript)
    messages: list[dict[str, Any]] = field(default_factory=list)
    reward: float = 1.0

    def to_row(self) -> dict[str, Any]:
        # no sort_keys: a tool call's arguments keep the order the solver wrote them in (sorted, edit's
        # new_str would come before old_str, and SFT would teach the policy to write the fix first)
        return {**dataclasses.asdict(self), "messages": json.dumps(self.messages)}

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> Demo:
        return cls(**{**row, "messages": json.loads(row["messages"])})


@dataclass
class TaskSet:
    tasks: list[TaskRow]
    demos: list[Demo] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)  # sources, funnel (taskset.json without the version)


def _features():
    from datasets import Features, Sequence, Value

    s = Value("string")
    tasks = Features({f.name: s for f in dataclasses.fields(TaskRow)})
    for k in ("f2p", "p2p", "test_files", "tools"):
        tasks[k] = Sequence(s)
    tasks["difficulty"] = Value("float64")
    demos = Features({"id": s, "task_id": s, "solver": s, "messages": s, "reward": Value("float64")})
    return tasks, demos


# ---------------------------------------------------------------------- splits
def group_hash(group: str) -> str:
    return hashlib.sha256(group.encode()).hexdigest()


def assign_splits(rows: list[TaskRow], heldout_share: float) -> list[TaskRow]:
    """Rows with `split` set from their group: the first round(share x groups) groups in sha256 order
    are held out (at least one group on each side when there are two or more)."""
    groups = sorted({r.group or r.id for r in rows}, key=group_hash)
    n_held = round(heldout_share * len(groups))
    if len(groups) >= 2 and 0 < heldout_share < 1:
        n_held = min(max(n_held, 1), len(groups) - 1)
    held = set(groups[:n_held])
    return [dataclasses.replace(r, group=r.group or r.id, split="heldout" if (r.group or r.id) in held else "train")
            for r in rows]  # fmt: skip


# ---------------------------------------------------------------------- validation
def validate(ts: TaskSet, where: str) -> None:
    """Every row usable by a reader; raises TaskSetError naming the row and the fix."""
    seen: set[str] = set()
    for r in ts.tasks:
        if r.id in seen:
            raise TaskSetError(f"{where}: task id {r.id!r} appears twice (a task is in a set once); drop one "
                               "copy with `flashpost-factory tasks filter` before merging")
        seen.add(r.id)
        if r.env not in ENVS:
            raise TaskSetError(f"{where}: task {r.id!r} has env {r.env!r}, not one of {ENVS}")
        if r.split not in SPLITS:
            raise TaskSetError(f"{where}: task {r.id!r} has split {r.split!r}, not one of {SPLITS}")
        if r.env == "sandbox":
            if not r.f2p:
                raise TaskSetError(f"{where}: task {r.id!r} has no F2P tests, so no patch can be told to fix it; "
                                   "rebuild the set (the factory's specify stage drops such tasks) or filter it out")
            if not r.image:
                raise TaskSetError(f"{where}: task {r.id!r} names no image; rebuild the set with flashpost-factory")
    for d in ts.demos:
        if d.task_id not in seen:
            raise TaskSetError(f"{where}: demonstration {d.id!r} links to task {d.task_id!r}, which is not in the "
                               "set; filter demonstrations with their tasks (`flashpost-factory tasks filter`)")


# ---------------------------------------------------------------------- write / load
def save(ts: TaskSet, path: str | Path) -> Path:
    """Write `ts` as a task-set folder (replacing one there), atomically: a reader never sees half a set."""
    from datasets import Dataset, DatasetDict, disable_progress_bars

    disable_progress_bars()
    path = Path(path)
    validate(ts, str(path))
    tf, df = _features()
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    DatasetDict({
        "tasks": Dataset.from_list([r.to_row() for r in ts.tasks], features=tf),
        "demonstrations": Dataset.from_list([d.to_row() for d in ts.demos], features=df),
    }).save_to_disk(str(tmp))  # fmt: skip
    meta = {"schema_version": SCHEMA_VERSION, **ts.meta}
    (tmp / META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    (tmp / "README.md").write_text(card(ts, path.name))
    if path.exists():
        shutil.rmtree(path)
    tmp.rename(path)
    return path


def load(path: str | Path) -> TaskSet:
    """Read a task-set folder; a missing, corrupt or other-version set raises TaskSetError."""
    from datasets import load_from_disk

    path = Path(path)
    meta_file = path / META_FILE
    if not meta_file.exists():
        hint = (" (a factory run folder: its task set is the `taskset` folder inside)"
                if (path / "taskset" / META_FILE).exists() else "")  # fmt: skip
        raise TaskSetError(f"no task set at {path}{hint}: write one with `flashpost-factory build --out DIR` "
                           "(it writes DIR/taskset) or name a shipped one (conf/tasksets/*.yaml)")
    try:
        meta = json.loads(meta_file.read_text())
        version = meta.pop("schema_version")
    except (ValueError, KeyError) as e:
        raise TaskSetError(f"task set {path} is corrupt ({META_FILE}: {e}); rebuild it with flashpost-factory") from e
    if version != SCHEMA_VERSION:
        raise TaskSetError(f"task set {path} has schema version {version}, this flashpost reads version "
                           f"{SCHEMA_VERSION}; rebuild it with this flashpost's `flashpost-factory build`")
    try:
        dd = load_from_disk(str(path))
        tasks = [TaskRow.from_row(r) for r in dd["tasks"]]
        demos = [Demo.from_row(r) for r in dd["demonstrations"]]
    except Exception as e:  # noqa: BLE001 - arrow, json and key errors all mean the folder is damaged
        raise TaskSetError(f"task set {path} is corrupt ({type(e).__name__}: {e}); rebuild it with "
                           "flashpost-factory") from e
    ts = TaskSet(tasks, demos, meta)
    validate(ts, str(path))
    return ts


# ---------------------------------------------------------------------- merge / filter
def merge(sets: list[TaskSet]) -> TaskSet:
    """One set holding every task and demonstration; duplicate task ids are refused by `validate`."""
    meta = {"sources": [s for ts in sets for s in ts.meta.get("sources", [])],
            "funnels": [f for ts in sets for f in ([ts.meta["funnel"]] if "funnel" in ts.meta else [])]}
    return TaskSet([r for ts in sets for r in ts.tasks], [d for ts in sets for d in ts.demos],
                   {k: v for k, v in meta.items() if v})  # fmt: skip


@dataclass(kw_only=True)
class TaskFilter:
    """Which rows of a set to use: empty = all. `families` and `sources` match TaskRow.family and the
    source's repo or generator; difficulty is inclusive."""

    split: str = ""
    families: list[str] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)
    min_difficulty: float = 0.0
    max_difficulty: float = 1.0

    def __post_init__(self) -> None:
        if self.split and self.split not in SPLITS:
            raise TaskSetError(f"split={self.split!r} is not one of {SPLITS}")

    def keep(self, r: TaskRow) -> bool:
        src = r.source.get("repo") or r.source.get("generator", "")
        return ((not self.split or r.split == self.split) and (not self.families or r.family in self.families)
                and (not self.sources or src in self.sources)
                and self.min_difficulty <= r.difficulty <= self.max_difficulty)  # fmt: skip

    def describe(self) -> str:
        parts = [f"split={self.split}" if self.split else "", f"families={self.families}" if self.families else "",
                 f"sources={self.sources}" if self.sources else "",
                 f"difficulty in [{self.min_difficulty}, {self.max_difficulty}]"]  # fmt: skip
        return ", ".join(p for p in parts if p)


def select(ts: TaskSet, flt: TaskFilter, where: str = "task set") -> TaskSet:
    """The rows `flt` keeps, with their demonstrations; selecting nothing raises TaskSetError."""
    tasks = [r for r in ts.tasks if flt.keep(r)]
    if not tasks:
        have = Counter((r.split, r.family) for r in ts.tasks)
        raise TaskSetError(f"{where}: the filter ({flt.describe()}) selects none of its {len(ts.tasks)} task(s) "
                           f"(split, family: {dict(have)}); widen the filter or use another set")
    ids = {r.id for r in tasks}
    return TaskSet(tasks, [d for d in ts.demos if d.task_id in ids], dict(ts.meta))


# ---------------------------------------------------------------------- the card
def card(ts: TaskSet, name: str) -> str:
    splits = Counter(r.split for r in ts.tasks)
    fams = Counter((r.family, r.split) for r in ts.tasks)
    demo_tasks = Counter(next(r.family for r in ts.tasks if r.id == d.task_id) for d in ts.demos)
    sources = sorted({json.dumps(r.source, sort_keys=True) for r in ts.tasks})
    lines = [f"# Task set `{name}`", "",
             f"Schema version {SCHEMA_VERSION}. {len(ts.tasks)} task(s), {len(ts.demos)} demonstration(s). "
             "Read it with `synth.taskset.load` (or `tasks=PATH` in flashpost-train / flashpost-eval); the gold "
             "patch column is for graders only.", "", "## Sources", ""]  # fmt: skip
    lines += [f"- `{s}`" for s in sources[:20]] + ([f"- ... {len(sources) - 20} more"] if len(sources) > 20 else [])
    lines += ["", "## Counts", "", "| family | train | heldout | demonstrations |", "|---|---:|---:|---:|"]
    for fam in sorted({f for f, _ in fams}):
        lines.append(f"| {fam} | {fams[(fam, 'train')]} | {fams[(fam, 'heldout')]} | {demo_tasks[fam]} |")
    lines.append(f"| all | {splits['train']} | {splits['heldout']} | {len(ts.demos)} |")
    funnel = ts.meta.get("funnel")
    if funnel:
        lines += ["", "## Factory funnel", "", "| stage | in | out | drops |", "|---|---:|---:|---|"]
        for stage, f in funnel.items():
            drops = ", ".join(f"{k} x{n}" for k, n in f["drops"].items())
            lines.append(f"| {stage} | {f['in']} | {f['out']} | {drops} |")
    return "\n".join(lines) + "\n"
