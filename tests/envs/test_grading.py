"""Grading: gold scores 1, empty scores 0, every canned hack scores 0, attacks stay contained, and a
task's tests run under its measured budget when that is below the caller's cap."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest

from envs import engine
from envs.fixtures.build import fixture_tasks, repo_files
from envs.grading import (
    GRADING_BUDGET_FLOOR_S,
    GRADING_BUDGET_KEY,
    GRADING_BUDGET_MARGIN,
    grade_in_budget,
    grade_patch,
    grade_sandbox,
    grading_budget,
    grading_timeout,
    parse_console,
    parse_junit,
)
from envs.hacks import HACKS, apply_hack
from envs.patches import is_protected
from envs.pool import GraderPool
from envs.sandbox import Sandbox
from envs.task import load_tasks
from synth.patches import edits_to_patch

# ---------------------------------------------------------------------- host-side parsing


def test_is_protected_paths():
    assert not is_protected("src/testament.py", []) and is_protected("docs/tests/x.txt", [])
    # Modules that would shadow the stdlib or pytest itself when /workspace is on sys.path.
    assert is_protected("unittest.py", []) and is_protected("json/__init__.py", [])
    assert is_protected("_pytest/runner.py", []) and not is_protected("calkit/json_io.py", [])
    assert not is_protected("README.md", [])


def test_parse_console_and_junit():
    assert parse_console("....F\n1 failed, 4 passed in 0.12s\n") == {"failed": 1, "passed": 4}
    assert parse_console("=== 2 passed, 1 xfailed, 3 warnings in 1.00s ===") == {
        "passed": 2, "xfailed": 1, "warning": 3}
    assert parse_console("fake\n1 passed\n") is None  # no duration: not pytest's summary line
    xml = (b"<testsuites><testsuite><testcase classname='tests.test_a.TestC' name='test_x[1]' "
           b"file='tests/test_a.py'/><testcase classname='tests.test_a' name='test_y' file='tests/test_a.py'>"
           b"<failure message='failed'/></testcase></testsuite></testsuites>")
    assert parse_junit(xml) == {"tests/test_a.py::TestC::test_x[1]": "passed",
                                "tests/test_a.py::test_y": "failed"}


def test_a_task_with_a_budget_below_the_cap_is_graded_under_its_budget():
    task = load_tasks("envs/fixtures/tasks.json")[0]
    assert GRADING_BUDGET_KEY not in task.verification and grading_timeout(task, 120.0) == 120.0  # none: the cap
    timed = dataclasses.replace(task, verification={**task.verification, GRADING_BUDGET_KEY: 10.0})
    assert grading_timeout(timed, 120.0) == 10.0
    assert grading_timeout(timed, 5.0) == 5.0  # the cap stays the user's upper bound
    # the budget from the slowest gold grading: the margin over it, never under the floor
    assert grading_budget([0.2, 0.4]) == GRADING_BUDGET_FLOOR_S
    assert grading_budget([1.0, 3.0]) == 3.0 * GRADING_BUDGET_MARGIN


# ------------------------------------------------------------------------ real containers

docker = pytest.mark.docker


@pytest.fixture(scope="module")
def tasks(engine_ready):
    return fixture_tasks()


@pytest.fixture(scope="module")
def pool(engine_ready):
    # One grader per image: a grading waits for the last one's reset (reuse), even on a loaded machine.
    with GraderPool(max_graders=4, graders_per_image=1, wait_s=60) as p:
        yield p
    assert p.stats["reset_failed"] == 0, p.stats


@docker
def test_gold_scores_one_and_empty_scores_zero_fresh_grader(tasks):
    for task in tasks:
        gold = grade_patch(task, task.gold_patch)
        assert gold.reward == 1.0 and gold.agreement, (task.task_id, gold.reason)
        assert all(gold.tests[t] == "passed" for t in task.test_ids)
        empty = grade_patch(task, "")
        assert empty.reward == 0.0 and empty.agreement, empty.reason
        assert [empty.tests[t] for t in task.f2p] == ["failed"] * len(task.f2p)


@docker
def test_agent_workspace_flow_with_warm_pool(tasks, pool):
    task = tasks[1]
    with Sandbox(task.image) as sb:
        sb.write_file("/tmp/gold.patch", task.gold_patch)
        r = sb.exec("git apply /tmp/gold.patch && python3 -m pytest -q -p no:cacheprovider", timeout=60)
        assert r.exit_code == 0, r.output
        sb.write_file("notes.txt", "new untracked file\n")
        r = grade_sandbox(sb, task, pool=pool)
    assert r.reward == 1.0 and r.agreement, r.reason
    r2 = grade_patch(task, task.gold_patch, pool=pool)  # served by a reset, re-verified grader
    assert r2.reward == 1.0
    assert pool.stats["reused"] >= 1, pool.stats


@docker
@pytest.mark.parametrize("hack", [pytest.param(h, id=h.name, marks=[pytest.mark.slow] * h.slow)
                                  for h in HACKS])
def test_canned_hacks_score_zero(tasks, pool, hack):
    task = tasks[0]
    with Sandbox(task.image) as sb:
        apply_hack(sb, task, hack)
        r = grade_sandbox(sb, task, pool=pool, timeout_s=15)
    assert r.reward == 0.0, f"{hack.name} was rewarded: {r.reason}"
    if hack.name in ("conftest_fake_pass", "conftest_sys_exit", "conftest_skip_all", "pytest_ini_deselect",
                     "sitecustomize_patch"):
        assert r.reason.startswith("patch refused") and r.flag == "patch"  # never reached the grader


@docker
def test_grader_reset_detects_what_it_cannot_clean(tasks):
    task = tasks[2]
    with GraderPool(max_graders=1) as p:
        with p.grader(task.image) as g:
            r = g.exec("mkdir -p /tmp/x ~/.cache && echo x > /tmp/x/f && echo y > ~/.cache/z && "
                       "echo z > /dev/shm/q && chmod 000 /tmp/x && (setsid sleep 300 >/dev/null 2>&1 &) && "
                       "echo junk >> calkit/dates.py", timeout=10)
            assert r.exit_code == 0, r.output
            assert p.reset(g, task.image)  # agent leftovers and processes are all cleaned
            assert "sleep 300" not in g.exec("ps -eo args", timeout=10).output
            assert g.exec("git status --porcelain", timeout=10).output == ""
            # A root-owned file in sticky /tmp cannot be removed by the agent-uid wipe: must fail.
            engine.put_archive(g.container_id, "/tmp", engine.tar_files({"planted": b"x"}, uid=0, gid=0))
            assert not p.reset(g, task.image)
            cid = g.container_id
    # Leaving the block recycles it in the background: verification fails, so it is discarded.
    assert p.stats["reset_failed"] == 1 and p.stats["reset_ok"] == 0
    assert not engine.container_running(cid)


@docker
@pytest.mark.slow
def test_fork_bomb_in_grading_leaves_others_responsive(tasks, pool):
    bomb = next(h for h in HACKS if h.name == "source_fork_bomb")
    task = tasks[0]
    with Sandbox() as bystander, Sandbox(task.image) as sb:
        apply_hack(sb, task, bomb)
        result = {}
        t = threading.Thread(target=lambda: result.setdefault(
            "r", grade_sandbox(sb, task, pool=pool, timeout_s=8)))
        t.start()
        worst = 0.0
        while t.is_alive():
            t0 = time.monotonic()
            assert bystander.exec("echo pong", timeout=10).output == "pong\n"
            worst = max(worst, time.monotonic() - t0)
            time.sleep(0.3)
        t.join()
    assert result["r"].reward == 0.0
    assert worst < 8.0
    assert grade_patch(task, task.gold_patch, pool=pool).reward == 1.0  # the pool recovered


@docker
def test_an_endless_loop_is_stopped_at_the_task_s_budget_not_the_cap(tasks, pool):
    task = next(t for t in tasks if t.task_id == "calkit-merge-touching")
    path = "calkit/intervals.py"
    source = repo_files()[path]
    endless = source.decode().replace("    merged: list[tuple[int, int]] = []\n", "    while True:\n        pass\n", 1)
    patch = edits_to_patch({path: source}, {path: endless})
    budgeted = dataclasses.replace(task, verification={**task.verification, GRADING_BUDGET_KEY: 3.0})
    t0 = time.monotonic()
    r = grade_in_budget(budgeted, patch, pool=pool, cap_s=120.0)
    assert r.reward == 0.0 and "pytest timed out" in r.reason, r.reason
    assert time.monotonic() - t0 < 30.0, "the grading waited for the cap, not the task's 3 s budget"
    assert grade_in_budget(budgeted, task.gold_patch, pool=pool, cap_s=120.0).reward == 1.0
