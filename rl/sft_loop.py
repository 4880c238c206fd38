"""The driver of trainer=sft (cross-entropy on demonstration trajectories) and trainer=dspark (the drafter
alone against the frozen policy, on the same data), with resumable data-loader position.

Demonstrations are a task set's (synth/taskset.py, `tasks=`) train-split transcripts, rendered with the
chat template (tools in the system turn for sandbox tasks):
token ids and the assistant loss mask come from `ChatTemplate.render`, turn starts from its spans. The
stream is an endless sequence of epochs, each a seeded permutation of the demonstrations; its
position is checkpointed with the learner (one atomic folder), so a resume continues mid-epoch.
Not here: the learner (rl/learner.py via rl/actors.py), rollouts.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from rl.config import JobConfig
from rl.payloads import Trajectory


def demonstrations(conversations: list[list[dict[str, Any]]], task_ids: list[str], env: str,
                   template, task_tools: dict[str, list[str]] | None = None) -> list[Trajectory]:  # fmt: skip
    """Rendered demonstrations (a task set's messages, rl/tasks.py): sandbox conversations with the schemas
    of their task's tools (`task_tools[task_id]`, TaskRow.tools; missing or []: every tool) in the system
    turn, as that task's episodes render them; loss on assistant tokens."""
    from envs.tools import tool_schemas

    task_tools = task_tools or {}
    out = []
    for messages, task_id in zip(conversations, task_ids, strict=True):
        tools = tool_schemas(task_tools.get(task_id)) if env == "sandbox" else None
        chat = template.render(messages, tools=tools)
        n = len(chat.token_ids)
        starts = [s.body_start for s in chat.turn_spans if s.role == "assistant"]
        out.append(Trajectory(token_ids=chat.token_ids, loss_mask=chat.loss_mask, logprobs=[float("nan")] * n,
                              versions=[-1] * n, turn_starts=starts, reward=1.0, task_id=task_id,
                              group_id=task_id, demo=True))  # fmt: skip
    return out


def load_demonstrations(job: JobConfig, template, progress: bool = True) -> list[Trajectory]:
    """The train split's demonstrations of job.tasks, rendered."""
    from rl.tasks import demo_conversations, read

    ts = read(job.tasks, job.task_filter, "train", progress=progress)
    return demonstrations(*demo_conversations(ts, f"tasks={job.tasks}"), template, {r.id: r.tools for r in ts.tasks})


class DemoStream:
    """Epochs of seeded permutations; `position` counts items handed out since the start."""

    def __init__(self, items: list[Trajectory], seed: int, position: int = 0):
        self.items, self.seed, self.position = items, seed, position

    def _order(self, epoch: int) -> list[int]:
        order = list(range(len(self.items)))
        random.Random(self.seed * 7919 + epoch).shuffle(order)
        return order

    def take(self, n: int) -> list[Trajectory]:
        out = []
        for _ in range(n):
            epoch, i = divmod(self.position, len(self.items))
            out.append(self.items[self._order(epoch)[i]])
            self.position += 1
        return out


def run_supervised(job: JobConfig, run_dir: Path, *, progress: bool = True, ray_metrics: bool = True,
                   demos: list[Trajectory] | None = None) -> list[dict[str, float]]:  # fmt: skip
    """Train trainer=sft or trainer=dspark to max_steps on demonstrations, resuming from checkpoints."""
    import ray

    from rl.actors import LearnerActor, build_model
    from rl.metrics import RunMetrics

    kind = job.trainer.kind
    if kind not in ("sft", "dspark"):
        raise ValueError(f"run_supervised runs trainer=sft or trainer=dspark, not {kind!r}")
    if demos is None:
        _, template = build_model(job.model)
        demos = load_demonstrations(job, template, progress)
    stream = DemoStream(demos, job.trainer.seed)
    threads = job.trainer.threads  # the learner runs alone here: trainer.threads may take every core
    cpus = min(threads, ray.cluster_resources().get("CPU", 1.0))
    learner = ray.remote(LearnerActor).options(num_cpus=cpus).remote(job.model, job.trainer, threads,
                                                                      init_seed=job.trainer.seed)  # fmt: skip
    root = Path(run_dir) / "checkpoints"
    version = 0
    if (root / "latest").exists():
        path = root / (root / "latest").read_text().strip()
        version = ray.get(learner.load.remote(str(path)))
        stream.position = json.loads((path / "data.json").read_text())["position"]
    step_fn = learner.train_sft if kind == "sft" else learner.train_dspark
    metrics = RunMetrics(Path(run_dir), job.trainer.max_steps, f"{kind} steps", ray_metrics, version, progress)
    history = []
    try:
        while version < job.trainer.max_steps:
            record = ray.get(step_fn.remote(stream.take(job.trainer.batch_size)))
            version = int(record["step"])
            metrics.log(version, record)
            history.append(record)
            if version % job.trainer.checkpoint_every == 0 or version == job.trainer.max_steps:
                ray.get(learner.save.remote(str(root), {"data": {"position": stream.position}}))
    finally:
        metrics.close()
        ray.kill(learner)
    return history
