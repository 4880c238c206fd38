"""The demo's RL grading stays cheap: a batch (envs/batch_grading.py) leaves nothing the pool's reset
cannot wipe, so the same warm grader passes its pristine check and serves the next batch instead of a
fresh container (~1 s) being started after every batch."""

from __future__ import annotations

import pytest

from envs.batch_grading import grade_batch
from envs.pool import GraderPool
from synth.families import apply_action, demo_splits, family_tasks, module_path


@pytest.mark.docker
def test_grader_is_reused_after_a_batch(engine_ready):
    insts = demo_splits(0, 4, 0, seed=7)["B_train"]
    tasks = family_tasks(insts)
    gold = [(t, {module_path(i): apply_action(i.buggy, i.action)}) for t, i in zip(tasks, insts)]
    with GraderPool(max_graders=1, graders_per_image=1) as pool:
        for _ in range(4):
            assert [g.reward for g in grade_batch(gold, pool=pool)] == [1.0] * len(gold)
        # max_graders=1: each batch waited for the previous batch's reset, and a failed reset
        # discards the grader, so the next batch would have started a new one
        assert pool.stats["created"] == 1 and pool.stats["reset_failed"] == 0 and pool.stats["reset_ok"] >= 3
