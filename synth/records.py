"""Typed records that flow between the factory's stages, and the per-stage store that persists them.

Every stage writes one record per unit of work (a repository, a mutation candidate, a task) to
`<out>/<stage>/records.jsonl` as soon as that unit finishes, so an interrupted run resumes at the
next unfinished unit; a finished stage is also materialised with HF `datasets`
(`<out>/<stage>/dataset`, `Dataset.save_to_disk`) for downstream readers. A record whose
`status` is "dropped" carries its `drop_reason` (the funnel's vocabulary). Not here: what any
stage does (synth/stages/*.py) or the order they run in (synth/runner.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

R = TypeVar("R", bound="Record")


@dataclass(kw_only=True)
class Record:
    key: str  # unique within a stage; the unit of resumption
    status: str = "ok"  # ok | dropped
    drop_reason: str = ""  # short category first: "<category>: <detail>"
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def drop(self: R, reason: str) -> R:
        self.status, self.drop_reason = "dropped", reason
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls: type[R], doc: dict[str, Any]) -> R:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in doc.items() if k in names})


@dataclass(kw_only=True)
class RepoRecord(Record):
    """ingest: a source tree copied under the run directory."""

    source: str  # what the user asked for: a path, a git URL, or pypi:NAME==VERSION
    path: str = ""  # absolute path of the copied tree
    n_files: int = 0
    history: str = ""  # bare clone of a git source (specify inverts its commits); "" when none
    head: str = ""  # the commit the tree is from


@dataclass(kw_only=True)
class FeasibleRepo(Record):
    """feasibility: the repository builds and its suite runs in a sandbox."""

    source: str
    path: str
    history: str = ""  # RepoRecord.history
    image: str = ""  # the pristine repository image (base image + tree, one commit)
    test_command: str = "python3 -m pytest -q"
    test_parser: str = "junit"
    test_files: list[str] = field(default_factory=list)
    source_files: list[str] = field(default_factory=list)
    results: dict[str, str] = field(default_factory=dict)  # test id -> status (first run)
    passing: list[str] = field(default_factory=list)  # passed on every baseline run
    test_env: dict[str, Any] = field(default_factory=dict)  # synth.testenv.TestEnv: requirements, skipped, wheels


@dataclass(kw_only=True)
class SpecRecord(Record):
    """specify: one candidate (an AST mutation, or a real commit inverted), with F2P/P2P from real runs
    and a behaviour-only statement. The shipped (broken) tree is the tree at `repo_path` with
    `mutation` applied, then `overrides` written (synth.stages.build.task_files)."""

    task_id: str
    repo_key: str
    repo_path: str = ""  # the fixed tree: the repository, or the commit's tree for an inverted commit
    repo_image: str = ""
    test_files: list[str] = field(default_factory=list)
    origin: dict[str, Any] = field(default_factory=dict)  # {"kind": "mutation"} | {"kind": "commit", "commit": sha...}
    mutation: dict[str, Any] = field(default_factory=dict)  # synth.mutations.Mutation as a dict ({} for commits)
    overrides: dict[str, str | None] = field(default_factory=dict)  # path -> broken text (None: absent)
    bug_patch: str = ""  # fixed -> broken (never shipped)
    gold_patch: str = ""  # broken -> fixed
    f2p: list[str] = field(default_factory=list)
    p2p: list[str] = field(default_factory=list)
    failures: dict[str, str] = field(default_factory=dict)  # F2P test id -> failure text on the mutant
    problem_statement: str = ""
    quoted: list[str] = field(default_factory=list)  # failure lines the statement quotes
    needles: list[str] = field(default_factory=list)  # distinctive fix text the image must not hold


@dataclass(kw_only=True)
class TaskRecord(Record):
    """build / solve / inspect: a task (envs.task.Task as a dict) and what each stage learned."""

    task: dict[str, Any] = field(default_factory=dict)
    repo_path: str = ""
    origin: dict[str, Any] = field(default_factory=dict)
    mutation: dict[str, Any] = field(default_factory=dict)
    overrides: dict[str, str | None] = field(default_factory=dict)
    quoted: list[str] = field(default_factory=list)
    needles: list[str] = field(default_factory=list)
    audit: dict[str, Any] = field(default_factory=dict)
    pass_matrix: dict[str, list[float]] = field(default_factory=dict)  # solver -> reward per attempt
    solutions: dict[str, str] = field(default_factory=dict)  # solver -> first passing patch
    verdicts: dict[str, Any] = field(default_factory=dict)  # inspector gates


class StageStore:
    """Append-only journal of one stage's records, plus the datasets copy of a finished stage."""

    def __init__(self, out_dir: str | Path, stage: str, record_type: type[R]):
        self.dir = Path(out_dir) / stage
        self.dir.mkdir(parents=True, exist_ok=True)
        self.journal = self.dir / "records.jsonl"
        self.record_type = record_type
        self._lock = threading.Lock()

    def load(self) -> dict[str, Record]:
        """key -> record; a torn last line (the run was killed mid-write) is ignored."""
        done: dict[str, Record] = {}
        if self.journal.exists():
            for line in self.journal.read_text().splitlines():
                try:
                    doc = json.loads(line)
                except ValueError:
                    continue
                done[doc["key"]] = self.record_type.from_dict(doc)
        return done

    def append(self, record: Record) -> None:
        line = json.dumps(record.to_dict(), sort_keys=True) + "\n"
        with self._lock, open(self.journal, "a") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())

    def finalize(self, records: list[Record]) -> None:
        """Materialise the stage as a datasets folder (scalar columns + the record as JSON)."""
        from datasets import Dataset, disable_progress_bars

        disable_progress_bars()
        rows = [{"key": r.key, "status": r.status, "drop_reason": r.drop_reason,
                 "record": json.dumps(r.to_dict(), sort_keys=True)} for r in records]
        if rows:
            Dataset.from_list(rows).save_to_disk(str(self.dir / "dataset"))
        (self.dir / "DONE").write_text(f"{len(rows)}\n")

    @property
    def finished(self) -> bool:
        return (self.dir / "DONE").exists()


def load_stage_dataset(out_dir: str | Path, stage: str, record_type: type[R]) -> list[R]:
    """Read a finished stage back through datasets (`load_from_disk`)."""
    from datasets import load_from_disk

    ds = load_from_disk(str(Path(out_dir) / stage / "dataset"))
    return [record_type.from_dict(json.loads(row["record"])) for row in ds]


def funnel(records: list[Record]) -> dict[str, Any]:
    """{"in": n, "out": n_ok, "drops": {category: n}, "examples": {category: "<key>: <first line of the
    reason>"}} for one stage's records (the example names a unit `flashpost-factory show` takes)."""
    dropped = [r for r in records if not r.ok]
    drops = Counter(r.drop_reason.split(":", 1)[0] for r in dropped)
    examples: dict[str, str] = {}
    for r in dropped:
        category, _, detail = r.drop_reason.partition(":")
        line = next((ln.strip() for ln in detail.splitlines() if ln.strip()), "")
        examples.setdefault(category, f"{r.key}: {line[:300]}" if line else r.key)
    return {"in": len(records), "out": sum(r.ok for r in records), "drops": dict(drops.most_common()),
            "examples": examples}
