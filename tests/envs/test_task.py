"""Task schema: the fixture tasks load, and malformed documents fail naming the field."""

from __future__ import annotations

import copy
import json

import pytest

from envs.fixtures.build import TASKS_PATH
from envs.task import TaskSchemaError, load_tasks, save_tasks


def _doc() -> dict:
    return json.loads(TASKS_PATH.read_text())[0]


def test_fixture_tasks_load():
    tasks = load_tasks(TASKS_PATH)
    assert len(tasks) == 3 and len({t.task_id for t in tasks}) == 3
    for t in tasks:
        assert t.f2p and not set(t.f2p) & set(t.p2p)
        assert t.gold_patch.startswith("diff --git ") and len(t.base_revision) == 40


@pytest.mark.parametrize("mutate, field", [
    (lambda d: d.pop("f2p"), "f2p: required field missing"),
    (lambda d: d.update(f2p=[]), "f2p: needs at least 1"),
    (lambda d: d.update(f2p=[3]), "f2p[0]: expected string"),
    (lambda d: d.update(image_digest="sha256:xyz"), "image_digest:"),
    (lambda d: d.update(base_revision="HEAD"), "base_revision:"),
    (lambda d: d.update(test_parser="tap"), "test_parser:"),
    (lambda d: d.update(surprise=1), "surprise: unknown field"),
    (lambda d: d.update(verification=[]), "verification: expected object"),
    (lambda d: d.update(p2p=d["p2p"] + d["f2p"]), "p2p: also listed in f2p"),
])
def test_schema_errors_name_the_field(tmp_path, mutate, field):
    doc = _doc()
    mutate(doc)
    path = tmp_path / "tasks.json"
    path.write_text(json.dumps([doc]))
    with pytest.raises(TaskSchemaError, match=field.replace("[", r"\[").replace("]", r"\]")):
        load_tasks(path)


def test_duplicate_ids_rejected(tmp_path):
    path = tmp_path / "tasks.json"
    path.write_text(json.dumps([_doc(), _doc()]))
    with pytest.raises(TaskSchemaError, match=r"\[1\]\.task_id: duplicate"):
        load_tasks(path)


def test_save_load_roundtrip(tmp_path):
    tasks = load_tasks(TASKS_PATH)
    tasks[0].verification["flake_rates"] = {"tests/test_x.py::test_y": 0.0}
    save_tasks(tasks, tmp_path / "out.json")
    again = load_tasks(tmp_path / "out.json")
    assert [t.to_dict() for t in again] == [t.to_dict() for t in tasks]
    bad = copy.deepcopy(tasks[0])
    bad.f2p = []
    with pytest.raises(TaskSchemaError, match="f2p"):
        save_tasks([bad], tmp_path / "bad.json")
