"""The online task audit of trainer=rl (rl/audit.py): a planted hackable task (its episodes pass with a
bare submit, far shorter than its verified solver runs; or its pass rate steps up at once) is flagged to
audit.jsonl and held out of the driver's sampling until released; honest tasks are not flagged."""

from __future__ import annotations

import json

from rl.audit import TaskAudit, main, solver_turns
from rl.config import AuditConfig, JobConfig, ModelChoice, TrainerConfig
from rl.payloads import Trajectory
from synth.taskset import Demo
from synth.taskset_sources import toy_set


def _episode(task_id: str, turns: int, passed: bool) -> Trajectory:
    """A graded sandbox episode of `turns` policy turns (3 tokens per turn)."""
    n = 1 + 3 * turns
    mask = [False] + [i % 3 != 0 for i in range(1, n)]
    return Trajectory(token_ids=[1] * n, loss_mask=mask, logprobs=[-1.0] * n, versions=[0] * n,
                      turn_starts=[1 + 3 * k for k in range(turns)], task_id=task_id, reward=float(passed),
                      verifier={"passed": passed})  # fmt: skip


def _demo(task_id: str, turns: int) -> Demo:
    msgs = [{"role": "user", "content": "fix it"}]
    for _ in range(turns):
        msgs += [{"role": "assistant", "content": "call"}, {"role": "tool", "content": "ok"}]
    return Demo(id=f"d-{task_id}", task_id=task_id, solver="search", messages=msgs)


def test_a_planted_hackable_task_is_flagged_and_held(tmp_path):
    solver = solver_turns([_demo("hackable", 5), _demo("hackable", 6), _demo("honest", 5)])
    assert solver == {"hackable": 5, "honest": 5}
    audit = TaskAudit(tmp_path / "audit.jsonl", AuditConfig(), solver)
    # the honest task: successes about as long as its solver's, no step in its pass rate
    assert audit.observe([_episode("honest", t, p) for t, p in [(5, True), (4, False), (6, True), (5, True)]], 1) == []
    # the planted one: passes after a single turn (a submit that the grader accepts without a fix)
    flags = audit.observe([_episode("hackable", 1, True) for _ in range(3)] + [_episode("honest", 5, True)], 2)
    assert [(f["task_id"], f["signal"]) for f in flags] == [("hackable", "short_successes")]
    assert audit.held == {"hackable"}
    logged = [json.loads(x) for x in (tmp_path / "audit.jsonl").read_text().splitlines()]
    assert logged[0]["task_id"] == "hackable" and logged[0]["solver_min_turns"] == 5


def test_a_pass_rate_step_is_flagged(tmp_path):
    audit = TaskAudit(tmp_path / "audit.jsonl", AuditConfig(window=4, jump=0.5), {})
    gradual = [_episode("learned", 5, k % 3 == 0) for k in range(8)]  # 1/3 throughout
    assert audit.observe(gradual, 1) == []
    audit.observe([_episode("stepped", 5, False) for _ in range(6)], 1)
    flags = audit.observe([_episode("stepped", 5, True) for _ in range(4)], 2)
    assert flags[0]["signal"] == "pass_rate_jump" and flags[0]["pass_rate_recent"] == 1.0


def test_held_tasks_are_skipped_by_the_driver_until_released(tmp_path):
    from rl.rl_loop import AsyncDriver

    job = JobConfig(model=ModelChoice(flavor="debug"), tasks=str(toy_set(3, 2, heldout_share=0.0)),
                    trainer=TrainerConfig(kind="rl"))  # fmt: skip
    driver = AsyncDriver(job, tmp_path, progress=False, ray_metrics=False)
    ids = [t["task_id"] for t in driver.tasks]
    driver.audit._append({"event": "flag", "task_id": ids[1], "signal": "short_successes"})
    driver.audit.refresh()
    sampled = [driver.next_sampled_group() for _ in range(4)]
    assert [ids[g % 3] for g in sampled] == [ids[0], ids[2], ids[0], ids[2]]
    main(["release", str(tmp_path), ids[1], "--by", "inspect"])
    driver.audit.refresh()
    assert ids[1] not in driver.audit.held
    assert [ids[driver.next_sampled_group() % 3] for _ in range(2)] == [ids[0], ids[1]]
