"""The trainers' and the evaluator's view of a task set (synth/taskset.py): `tasks=PATH` or a shipped
name (conf/tasksets/NAME.yaml), filtered by `task_filter`, one split, images ensured.

`episode_tasks` gives the rollout payloads of the rows (env "sandbox": an envs Task without its gold
patch; env "toy": the in-process ToyTask fields); `demo_conversations` the demonstrations' messages
with the tool schemas they were recorded with. Not here: the format or its sources (synth/), episodes
(rl/rollout.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from synth.taskset import TaskFilter, TaskRow, TaskSet, TaskSetError


def read(spec: str, flt: TaskFilter, split: str, progress: bool = True) -> TaskSet:
    """The rows of set `spec` that `flt` keeps in `split` (flt.split, when set, wins); an empty result,
    or a set mixing toy and sandbox rows, raises TaskSetError naming the fix."""
    from synth import taskset
    from synth.taskset_sources import resolve

    path = resolve(spec, progress=progress)
    ts = taskset.select(taskset.load(path), dataclasses.replace(flt, split=flt.split or split), f"tasks={spec}")
    envs = {r.env for r in ts.tasks}
    if len(envs) > 1:
        raise TaskSetError(f"tasks={spec} mixes envs {sorted(envs)}: one run's episodes are all in-process or all "
                           "sandboxed; filter one of them out (`flashpost-factory tasks filter`)")
    return ts


def episode_tasks(rows: list[TaskRow]) -> list[dict[str, Any]]:
    """{"task_id", "env", "task": payload} per row; missing sandbox images are rebuilt first."""
    from synth.taskset_sources import ensure_images

    ensure_images(rows)
    return [{"task_id": r.id, "env": r.env, "task": r.payload if r.env == "toy" else r.agent_task().to_dict()}
            for r in rows]  # fmt: skip


def demo_conversations(ts: TaskSet, where: str) -> tuple[list[list[dict[str, Any]]], list[str], str]:
    """(messages per demonstration, their task ids, env); a set without demonstrations raises."""
    if not ts.demos:
        raise TaskSetError(f"{where} has no demonstrations in the selected split, so trainer=sft has nothing to "
                           "learn from: use a set whose sources record them (factory solver runs, families A, "
                           "fixtures, toy) or widen task_filter")
    env = ts.tasks[0].env
    return [d.messages for d in ts.demos], [d.task_id for d in ts.demos], env
