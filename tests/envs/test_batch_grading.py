"""envs/batch_grading against a real warm grader container: gold edits score 1, unchanged or broken
code 0, a hanging candidate times out without holding up the rest, protected paths are dropped,
what one candidate leaves behind cannot touch the next, and it agrees with grade_patch."""

from __future__ import annotations

import pytest

from envs.batch_grading import grade_batch, screen_edit
from envs.grading import grade_patch
from envs.pool import GraderPool
from synth.families import apply_action, demo_splits, family_tasks, module_path, module_tests_path


@pytest.fixture(scope="module")
def family(engine_ready):
    insts = demo_splits(0, 6, 0, seed=5)["B_train"]
    tasks = family_tasks(insts)
    with GraderPool(max_graders=1, graders_per_image=1) as pool:
        yield insts, tasks, pool


def test_screen_edit():
    assert screen_edit("return a + b", "return a - b") is None
    assert "'__'" in screen_edit("return a", "return __import__('os')._exit(0)")
    assert "'exec'" in screen_edit("return a", "return exec('1')")


def test_batch_rewards(family):
    insts, tasks, pool = family
    gold = [(t, {module_path(i): apply_action(i.buggy, i.action)}) for t, i in zip(tasks, insts)]
    unchanged = [(t, {}) for t in tasks]
    i0, t0 = insts[0], tasks[0]
    hang = (t0, {module_path(i0): i0.correct + "\nwhile True:\n    pass\n"})
    syntax = (t0, {module_path(i0): "def (:\n"})
    cheat = (t0, {module_tests_path(i0): "def test_0():\n    pass\n", module_path(i0): i0.buggy})
    # a candidate that would leave a process behind: the static screen refuses it
    sneaky = (t0, {module_path(i0): i0.correct + "\nimport os, time\nif os.fork() == 0:\n    time.sleep(3)\n"})
    out = grade_batch(gold + unchanged + [hang, syntax, cheat, sneaky] + gold[:1], pool=pool, timeout_s=1.0)
    n = len(insts)
    assert [g.reward for g in out[:n]] == [1.0] * n
    assert [g.reward for g in out[n:2 * n]] == [0.0] * n
    hang_g, syntax_g, cheat_g, sneaky_g, again = out[2 * n:]
    assert hang_g.reward == 0.0 and "timed out" in hang_g.reason
    assert syntax_g.reward == 0.0 and set(syntax_g.tests.values()) == {"error"}
    assert cheat_g.reward == 0.0 and cheat_g.dropped_paths == [module_tests_path(i0)]
    assert sneaky_g.reward == 0.0 and "process control (os.fork)" in sneaky_g.reason
    assert again.reward == 1.0
    assert all(set(g.tests) == set(t.test_ids) for g, (t, _) in zip(out[:n], gold))


def test_agrees_with_grade_patch(family):
    insts, tasks, pool = family
    for task in tasks[:2]:
        assert grade_patch(task, task.gold_patch, pool=pool, timeout_s=60).reward == 1.0
        assert grade_patch(task, "", pool=pool, timeout_s=60).reward == 0.0
    got = grade_batch([(t, {}) for t in tasks[:2]], pool=pool)
    for g, task in zip(got, tasks[:2]):
        failing = {tid for tid, s in g.tests.items() if s != "passed"}
        assert failing == set(task.f2p)  # the batch runner sees the same failing tests as the factory
