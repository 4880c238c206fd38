"""Task: one repair problem in a pinned image, with the tests that decide it; JSON I/O + schema.

`TASK_SCHEMA` is a JSON Schema (the subset: type, pattern, items, minItems, enum, required,
additionalProperties) and `validate_task` interprets exactly that subset, so the file format has
one definition and every error names the offending field. Not here: building images (see
envs/fixtures/build.py) or grading (envs/grading.py).
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_HEX40_OR_EMPTY = r"^([0-9a-f]{40})?$"
_STR_LIST = {"type": "array", "items": {"type": "string", "minLength": 1}}

TASK_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "flashpost task",
    "type": "object",
    "additionalProperties": False,
    "required": ["task_id", "repo", "base_revision", "image", "image_digest", "problem_statement",
                 "test_command", "test_parser", "f2p", "p2p", "gold_patch", "test_files"],
    "properties": {
        "task_id": {"type": "string", "pattern": r"^[A-Za-z0-9][A-Za-z0-9._-]*$"},
        "repo": {"type": "string", "minLength": 1},
        # The commit of /workspace in the image that the agent starts from.
        "base_revision": {"type": "string", "pattern": _HEX40_OR_EMPTY},
        "image": {"type": "string", "minLength": 1},
        # The engine's content id of `image` ("" until the image is built).
        "image_digest": {"type": "string", "pattern": r"^(sha256:[0-9a-f]{64})?$"},
        "problem_statement": {"type": "string", "minLength": 1},
        "test_command": {"type": "string", "minLength": 1},
        "test_parser": {"type": "string", "enum": ["junit"]},
        # pytest node ids ("tests/test_x.py::TestC::test_y[p]").
        "f2p": {**_STR_LIST, "minItems": 1},
        "p2p": _STR_LIST,
        # Kept outside the image; the reference fix as a git diff against base_revision.
        "gold_patch": {"type": "string"},
        # Hidden test changes applied at grading time after test_files are restored ("" if none).
        "test_patch": {"type": "string"},
        # Paths (relative to the workspace) restored to base_revision before grading.
        "test_files": _STR_LIST,
        # Factory metadata: gates, flake_rates, solver_pass_matrix, inspector_verdicts, audit_hash.
        "verification": {"type": "object"},
        # The tools (envs/tools.py TOOLS names) the agent is offered; absent or [] = every tool.
        "tools": _STR_LIST,
    },
}


class TaskSchemaError(ValueError):
    """A task document does not match TASK_SCHEMA; the message starts with the field path."""


@dataclass(kw_only=True)
class Task:
    task_id: str
    repo: str
    base_revision: str
    image: str
    image_digest: str
    problem_statement: str
    test_command: str
    test_parser: str
    f2p: list[str]
    p2p: list[str]
    gold_patch: str
    test_files: list[str]
    test_patch: str = ""
    verification: dict[str, Any] = field(default_factory=dict)
    tools: list[str] = field(default_factory=list)  # offered tool names; [] = all of envs/tools.py TOOLS

    @classmethod
    def from_dict(cls, doc: Any, where: str = "task") -> Task:
        validate_task(doc, where)
        return cls(**doc)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def test_ids(self) -> list[str]:
        return [*self.f2p, *self.p2p]


_TYPES = {"object": dict, "array": list, "string": str, "integer": int, "number": (int, float),
          "boolean": bool}


def _check(value: Any, schema: dict[str, Any], where: str) -> None:
    expected = schema.get("type")
    if expected and (not isinstance(value, _TYPES[expected]) or
                     (expected in ("integer", "number") and isinstance(value, bool))):
        raise TaskSchemaError(f"{where}: expected {expected}, got {type(value).__name__}")
    if "enum" in schema and value not in schema["enum"]:
        raise TaskSchemaError(f"{where}: {value!r} is not one of {schema['enum']}")
    if isinstance(value, str):
        if len(value) < schema.get("minLength", 0):
            raise TaskSchemaError(f"{where}: must not be empty")
        if "pattern" in schema and not re.search(schema["pattern"], value):
            raise TaskSchemaError(f"{where}: {value[:80]!r} does not match {schema['pattern']}")
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0):
            raise TaskSchemaError(f"{where}: needs at least {schema['minItems']} item(s)")
        for i, item in enumerate(value):
            _check(item, schema.get("items", {}), f"{where}[{i}]")
    if isinstance(value, dict) and "properties" in schema:
        for key in schema.get("required", []):
            if key not in value:
                raise TaskSchemaError(f"{where}.{key}: required field missing")
        for key, item in value.items():
            if key not in schema["properties"]:
                if schema.get("additionalProperties", True) is False:
                    raise TaskSchemaError(f"{where}.{key}: unknown field")
                continue
            _check(item, schema["properties"][key], f"{where}.{key}")


def validate_task(doc: Any, where: str = "task") -> None:
    """Raise TaskSchemaError naming the first offending field; also checks f2p/p2p disjoint."""
    _check(doc, TASK_SCHEMA, where)
    both = set(doc["f2p"]) & set(doc["p2p"])
    if both:
        raise TaskSchemaError(f"{where}.p2p: also listed in f2p: {sorted(both)}")


def load_tasks(path: str | Path) -> list[Task]:
    """Read a JSON list of tasks (or one task object); validated, task_ids unique."""
    doc = json.loads(Path(path).read_text())
    docs = doc if isinstance(doc, list) else [doc]
    tasks = [Task.from_dict(d, f"{Path(path).name}[{i}]") for i, d in enumerate(docs)]
    seen: set[str] = set()
    for i, t in enumerate(tasks):
        if t.task_id in seen:
            raise TaskSchemaError(f"{Path(path).name}[{i}].task_id: duplicate {t.task_id!r}")
        seen.add(t.task_id)
    return tasks


def save_tasks(tasks: list[Task], path: str | Path) -> None:
    docs = [t.to_dict() for t in tasks]
    for i, d in enumerate(docs):
        validate_task(d, f"task[{i}]")
    Path(path).write_text(json.dumps(docs, indent=2, sort_keys=False) + "\n")
