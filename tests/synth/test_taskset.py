"""The task-set format without containers: write -> load gives identical records, splits follow groups,
merge and filter (library and `flashpost-factory tasks`), the shipped-name resolver, the readers of
trainer=rl / trainer=sft on the toy set, and every bad input named with its fix."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest

from synth import taskset
from synth.cli import main
from synth.taskset import Demo, TaskFilter, TaskRow, TaskSet, TaskSetError


def _row(i: int, **kw) -> TaskRow:
    base = dict(
        id=f"t{i}", env="sandbox", source={"repo": "https://example.org/r.git", "revision": "ab" * 20},
        family="r", group=f"g{i // 2}", split="train", image=f"flashpost/synth-task:t{i}",
        image_digest="sha256:" + "0" * 64, image_recipe={"kind": "tree", "image": f"flashpost/synth-task:t{i}",
                                                         "repo_path": "/nowhere", "mutation": {}, "overrides": {},
                                                         "command": "flashpost-factory build --repo r"},
        problem_statement=f"fix {i}: ünïcode and\nnewlines", f2p=[f"tests/test_a.py::test_{i}"],
        p2p=["tests/test_a.py::test_ok[1-2]"], gold_patch=f"--- a/a.py\n+++ b/a.py\n@@ -1 +1 @@\n-x\n+y{i}\n",
        test_files=["tests/test_a.py"], test_command="python3 -m pytest -q", repo="r", base_revision="cd" * 20,
        verification={"gates": {"gold_gate": True}, "flake_rates": {"tests/test_a.py::test_ok[1-2]": 0.0},
                      "solver_pass_matrix": {"search": [1.0, 0.0]}, "nested": [{"a": None}]},
        difficulty=0.5,
    )  # fmt: skip
    return TaskRow(**(base | kw))


def _set(n: int = 6) -> TaskSet:
    rows = taskset.assign_splits([_row(i, tools=["edit", "submit"] if i % 3 == 0 else []) for i in range(n)], 0.34)
    demos = [Demo(id=f"t{i}/search", task_id=f"t{i}", solver="search", reward=1.0,
                  messages=[{"role": "user", "content": "u"},
                            {"role": "assistant", "content": "", "tool_calls": [{"name": "bash",
                                                                                  "arguments": {"command": "ls"}}]},
                            {"role": "tool", "content": "a.py", "name": "bash"}])
             for i in range(0, n, 2)]  # fmt: skip
    return TaskSet(rows, demos, {"sources": [{"repo": "r"}], "funnel": {"ingest": {"in": 1, "out": 1, "drops": {}}}})


def test_write_then_load_gives_identical_records(tmp_path):
    ts = _set()
    taskset.save(ts, tmp_path / "s")
    back = taskset.load(tmp_path / "s")
    assert back.tasks == ts.tasks and back.demos == ts.demos and back.meta == ts.meta
    assert back.tasks[0].tools == ["edit", "submit"] and back.tasks[0].agent_task().tools == ["edit", "submit"]
    card = (tmp_path / "s" / "README.md").read_text()
    assert "| r |" in card and "Factory funnel" in card and "Schema version 1" in card


def test_tool_call_arguments_keep_their_order_through_save_and_load(tmp_path):
    # the demonstration is what the policy is taught to write: edit's old_str before its new_str
    call = {"name": "edit", "arguments": {"line": 3, "old_str": "<", "new_str": ">="}}
    demo = Demo(id="t0/search", task_id="t0", solver="search",
                messages=[{"role": "user", "content": "u"}, {"role": "assistant", "content": "", "tool_calls": [call]}])
    ts = _set()
    taskset.save(TaskSet(ts.tasks, [demo], ts.meta), tmp_path / "s")
    back = taskset.load(tmp_path / "s").demos[0].messages[1]["tool_calls"][0]["arguments"]
    assert list(back) == ["line", "old_str", "new_str"]


def test_split_follows_the_group_so_near_duplicates_never_straddle():
    rows = taskset.assign_splits([_row(i) for i in range(20)], 0.25)
    by_group: dict[str, set[str]] = {}
    for r in rows:
        by_group.setdefault(r.group, set()).add(r.split)
    assert all(len(s) == 1 for s in by_group.values())
    assert sum(s == {"heldout"} for s in by_group.values()) == round(0.25 * 10)
    again = taskset.assign_splits(list(reversed([_row(i) for i in range(20)])), 0.25)
    assert {r.id: r.split for r in again} == {r.id: r.split for r in rows}


def test_merge_and_filter_through_the_cli(tmp_path, capsys):
    a, b = _set(4), _set(4)
    b = TaskSet([dataclasses.replace(r, id=f"b{r.id}", family="other", difficulty=0.9) for r in b.tasks],
                [dataclasses.replace(d, id=f"b{d.id}", task_id=f"b{d.task_id}") for d in b.demos], {})
    taskset.save(a, tmp_path / "a")
    taskset.save(b, tmp_path / "b")
    assert main(["tasks", "merge", str(tmp_path / "m"), str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    assert len(taskset.load(tmp_path / "m").tasks) == 8
    assert main(["tasks", "filter", str(tmp_path / "m"), str(tmp_path / "f"), "--family", "other",
                 "--min-difficulty", "0.8", "--split", "train"]) == 0  # fmt: skip
    f = taskset.load(tmp_path / "f")
    assert f.tasks and {(r.family, r.split) for r in f.tasks} == {("other", "train")}
    assert {d.task_id for d in f.demos} <= {r.id for r in f.tasks}
    assert main(["tasks", "merge", str(tmp_path / "d"), str(tmp_path / "a"), str(tmp_path / "a")]) == 2
    assert "appears twice" in capsys.readouterr().err


def test_bad_input_names_the_problem_and_the_fix(tmp_path):
    with pytest.raises(TaskSetError, match="no task set at .*flashpost-factory build"):
        taskset.load(tmp_path / "missing")
    taskset.save(_set(), tmp_path / "s")
    meta = json.loads((tmp_path / "s" / taskset.META_FILE).read_text())
    (tmp_path / "s" / taskset.META_FILE).write_text(json.dumps(meta | {"schema_version": 0}))
    with pytest.raises(TaskSetError, match="schema version 0.*rebuild it"):
        taskset.load(tmp_path / "s")
    (tmp_path / "s" / taskset.META_FILE).write_text("{not json")
    with pytest.raises(TaskSetError, match="corrupt.*rebuild"):
        taskset.load(tmp_path / "s")
    taskset.save(_set(), tmp_path / "c")
    for p in (tmp_path / "c" / "tasks").glob("*.arrow"):
        p.write_bytes(b"garbage")
    with pytest.raises(TaskSetError, match="corrupt.*rebuild"):
        taskset.load(tmp_path / "c")
    bad = _set()
    bad.tasks[0] = dataclasses.replace(bad.tasks[0], f2p=[])
    with pytest.raises(TaskSetError, match="no F2P tests.*filter it out"):
        taskset.save(bad, tmp_path / "nof2p")
    only_train = TaskSet([dataclasses.replace(r, split="train") for r in _set().tasks])
    with pytest.raises(TaskSetError, match="selects none.*widen the filter"):
        taskset.select(only_train, TaskFilter(split="heldout"))
    with pytest.raises(TaskSetError, match="selects none"):
        taskset.select(_set(), TaskFilter(families=["nope"]))
    with pytest.raises(TaskSetError, match="not one of"):
        TaskFilter(split="test")


def test_shipped_names_resolve_and_unknown_names_list_them(tmp_path, monkeypatch):
    from synth.taskset_sources import resolve

    monkeypatch.setenv("FLASHPOST_CACHE", str(tmp_path))
    path = resolve("toy", progress=False)
    assert taskset.load(path).tasks[0].env == "toy" and resolve("toy") == path
    with pytest.raises(TaskSetError, match="shipped: .*'families'.*'toy'"):
        resolve("no-such-set")


def test_the_trainers_readers_take_the_train_split_of_the_toy_set(tmp_path, monkeypatch):
    from rl.config import JobConfig, ModelChoice
    from rl.rl_loop import load_tasks
    from rl.sft_loop import load_demonstrations

    monkeypatch.setenv("FLASHPOST_CACHE", str(tmp_path / "cache"))
    assert main(["build", "--source", "toy", "--budget", "8", "--out", str(tmp_path / "f")]) == 0
    path = tmp_path / "f" / "taskset"
    ts = taskset.load(path)
    job = JobConfig(model=ModelChoice(flavor="debug", overrides={"vocab_size": 4096, "engram_compressed_vocab_size":
                                                                 2742}), tasks=str(path))  # fmt: skip
    tasks = load_tasks(job, progress=False)
    train = {r.id for r in ts.tasks if r.split == "train"}
    assert {t["task_id"] for t in tasks} == train and 0 < len(train) < 8
    assert all(t["env"] == "toy" and t["task"]["target"] for t in tasks)
    from rl.actors import build_model

    _, template = build_model(job.model)
    demos = load_demonstrations(job, template, progress=False)
    assert {d.task_id for d in demos} == train
    assert all(any(d.loss_mask) and not all(d.loss_mask) for d in demos)
    held = dataclasses.replace(job, task_filter=TaskFilter(split="heldout"))
    assert {t["task_id"] for t in load_tasks(held, progress=False)} == {r.id for r in ts.tasks} - train
    shutil.rmtree(path / "demonstrations")
    with pytest.raises(TaskSetError, match="corrupt"):
        load_tasks(job, progress=False)


def test_stats_and_show_read_the_task_set(tmp_path, capsys):
    out = tmp_path / "toy"
    assert main(["build", "--source", "toy", "--budget", "4", "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["stats", str(out)]) == 0
    assert "4 task(s), 4 demonstration(s); toy/heldout 1, toy/train 3" in capsys.readouterr().out
    assert main(["show", str(out), "toy-1"]) == 0
    shown = capsys.readouterr().out
    assert "== task set:" in shown and "== demonstration toy-1/gold" in shown
    assert sorted(p.name for p in out.iterdir()) == ["taskset"], "reading made no factory folders"
