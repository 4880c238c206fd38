"""The demo families as multi-turn episodes: the task statement, the agent's quick test runner
(envs/check_runner.py), wrong first edits and their corrections, and (against real containers) the
replayed demonstrations: look -> edit -> tests pass -> submit, some with a failed edit and a recovery,
each kept only when the pristine batch grader gives it reward 1, and every task's measured grading budget."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from synth.families import (
    BUG_WORDS,
    CHECK_PATH,
    apply_action,
    demo_splits,
    render_tests,
    repo_files,
    split_action,
    wrong_edits,
)

RUNNER = Path(__file__).resolve().parents[2] / "envs" / "check_runner.py"


@pytest.fixture(scope="module")
def train_a():
    return demo_splits(120, 0, 0, seed=4)["A_train"]


def _check(tmp_path: Path, inst, source: str) -> subprocess.CompletedProcess:
    for rel, body in repo_files([inst]).items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(body)
    (tmp_path / "fam" / f"{inst.iid}.py").write_text(source)
    return subprocess.run([sys.executable, CHECK_PATH, f"tests/test_{inst.iid}.py"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)  # fmt: skip


def test_the_statement_names_the_line_and_says_what_is_wrong_in_words_not_the_source_nor_the_failing_assert(
    train_a,
):
    for inst in train_a:
        line, old, _ = split_action(inst.buggy, inst.action)
        assert inst.line == line and old in inst.buggy.splitlines()[line - 1]
        assert inst.statement == f"Fix `{inst.func}` (fam/{inst.iid}.py): on line {line}, {BUG_WORDS[inst.kind]}."


def test_the_quick_runner_reports_the_first_failure_with_its_value(tmp_path, train_a):
    inst = train_a[0]
    bad = _check(tmp_path, inst, inst.buggy)
    first, summary = bad.stdout.splitlines()
    assert bad.returncode == 1 and first.startswith("FAILED test_") and "(got " in first
    n_failed = int(summary.split(" failed")[0])
    assert summary == f"{n_failed} failed, {len(inst.tests) - n_failed} passed" and n_failed >= 1
    k = int(first.split(":")[0].removeprefix("FAILED test_"))
    assert first.split(": ", 1)[1].startswith(inst.tests[k] + " (got ")
    good = _check(tmp_path, inst, inst.correct)
    assert good.returncode == 0 and good.stdout == f"{len(inst.tests)} passed\n"
    broken = _check(tmp_path, inst, inst.buggy.replace("def ", "def (", 1))
    assert broken.returncode == 2 and broken.stdout.startswith("ERROR importing") and "SyntaxError" in broken.stdout
    endless = _check(tmp_path, inst, f"def {inst.func}(*a):\n    while True:\n        pass\n")
    assert endless.returncode == 1 and "(timed out)" in endless.stdout
    assert endless.stdout.splitlines()[1] == f"1 failed, 0 passed, {len(inst.tests) - 1} not run"
    assert len(bad.stdout) < 400 and render_tests(inst).count("def test_") == len(inst.tests)


def test_wrong_edits_still_fail_and_their_corrections_give_the_correct_source(train_a):
    with_wrong = [(inst, wrong_edits(inst)) for inst in train_a]
    assert sum(bool(w) for _, w in with_wrong) >= len(train_a) // 5  # enough for a recovery share of 20%
    for inst, pairs in with_wrong:
        for wrong, fix in pairs:
            bad = apply_action(inst.buggy, wrong)
            assert bad not in (None, inst.buggy, inst.correct)
            assert apply_action(bad, fix) == inst.correct
            assert split_action(inst.buggy, wrong)[0] == split_action(inst.buggy, inst.action)[0]


def test_family_scripts_are_terse_tool_calls(train_a):
    from synth.taskset_sources import family_script

    inst = next(i for i in train_a if wrong_edits(i))
    gold = family_script(inst)
    assert [m["tool_calls"][0]["name"] for m in gold] == ["view", "edit", "run_tests", "submit"]
    assert all(m["content"] == "" for m in gold)
    line, old, new = split_action(inst.buggy, inst.action)
    assert gold[0]["tool_calls"][0]["arguments"] == {"view_range": [line, line]}  # the line the statement names
    # in this order: the line, the text copied from it, its replacement
    assert list(gold[1]["tool_calls"][0]["arguments"].items()) == [("line", line), ("old_str", old), ("new_str", new)]
    rec = family_script(inst, wrong_edits(inst)[0])
    assert [m["tool_calls"][0]["name"] for m in rec] == ["view", "edit", "run_tests", "edit", "run_tests", "submit"]


@pytest.mark.docker
def test_replayed_demonstrations_look_edit_read_and_some_recover(tmp_path):
    from envs import engine
    from envs.grading import GRADING_BUDGET_FLOOR_S, grading_budget
    from synth import taskset
    from synth.taskset_sources import families_source

    if not engine.engine_available():
        pytest.skip("no Docker engine answers: run `bash infra/docker/ensure_engine.sh` (or `make test`)")
    try:
        ts = families_source(n_a=6, n_b=2, n_heldout=2, recovery_share=0.5, seed=1, progress=False)
    finally:
        engine.reap_containers({engine.LABEL_OWNER: engine.owner_id(), "flashpost.role": "demo-replay"})
    taskset.save(ts, tmp_path / "set")
    ts = taskset.load(tmp_path / "set")
    rows = {r.id: r for r in ts.tasks}
    assert sorted((r.family, r.split) for r in ts.tasks).count(("A", "heldout")) == 2
    # every task, A and B, train and held-out, carries the budget its template's gold grading measured
    assert {(r.family, r.split) for r in ts.tasks} == {("A", "train"), ("A", "heldout"), ("B", "train"),
                                                       ("B", "heldout")}  # fmt: skip
    for r in ts.tasks:
        gold_s = r.verification["gold_grading_s"]
        assert 0 < gold_s < 60 and r.verification["grading_budget_s"] == grading_budget([gold_s]), r.id
        assert r.verification["grading_budget_s"] >= GRADING_BUDGET_FLOOR_S
    by_template: dict[int, set[float]] = {}
    for r in ts.tasks:
        by_template.setdefault(r.verification["template"], set()).add(r.verification["gold_grading_s"])
    assert all(len(s) == 1 for s in by_template.values())  # one measurement per template
    assert {rows[d.task_id].family for d in ts.demos} == {"A"} and len(ts.demos) == 6
    assert {d.solver for d in ts.demos} == {"gold", "recovery"}
    for d in ts.demos:
        tools = [m for m in d.messages if m["role"] == "tool"]
        line = rows[d.task_id].problem_statement.split("on line ")[1].split(",")[0]
        # view: the one numbered line the statement names; the edit's echo of it
        assert len(tools[0]["content"].splitlines()) == 1 and tools[0]["content"].split("\t")[0].strip() == line
        assert tools[1]["content"].startswith(f"line {line}: ")
        assert tools[-2]["content"].endswith("passed\n[exit code: 0]") and "failed" not in tools[-2]["content"]
        if d.solver == "recovery":
            assert len(tools) == 6 and tools[2]["content"].startswith("FAILED test_") and "(got " in tools[2]["content"]
        else:
            assert len(tools) == 4
        assert rows[d.task_id].test_command.startswith(f"python3 {CHECK_PATH} ")


@pytest.mark.docker
def test_a_warm_replay_sandbox_is_reset_after_each_episode_and_records_the_task_s_file():
    import dataclasses

    from envs import engine
    from synth.families import family_tasks
    from synth.taskset_sources import WarmSandboxes

    if not engine.engine_available():
        pytest.skip("no Docker engine answers: run `bash infra/docker/ensure_engine.sh` (or `make test`)")
    insts = demo_splits(2, 0, 0, seed=6)["A_train"]
    tasks = family_tasks(insts)
    warm = WarmSandboxes(tasks[0].image, 1)
    try:
        for task, inst in zip(tasks, insts):
            with warm.lend(task) as sb:
                sb.write_file(task.verification["file"], inst.correct)
                sb.write_file("stray.txt", "left behind")
            assert warm.files[task.task_id] == inst.correct
            (sb,) = warm.free
            assert sb.exec("git status --porcelain", timeout=30, workdir="/workspace").output == ""
        with pytest.raises(KeyError):  # a task naming no file is a caller error, and the sandbox still resets
            with warm.lend(dataclasses.replace(tasks[0], verification={})) as sb:
                sb.write_file("stray.txt", "x")
        assert len(warm.free) == 1
        assert warm.free[0].exec("git status --porcelain", timeout=30, workdir="/workspace").output == ""
    finally:
        warm.close()
