"""Stage 5, solver ensemble: each built task is attempted by the search-based repair agent
(synth/solver.py) and, when an OpenAI-compatible endpoint is configured, by an LLM agent running
the envs/episode.py tool loop. The pass matrix (solver x attempt -> reward) and each solver's
first passing patch are stored; solving is evidence for the inspector, not a gate by itself.

Not here: the gates (inspect).
"""

from __future__ import annotations

import functools
import time

from envs.episode import EpisodeConfig, run_episode_sync
from envs.grading import grade_patch
from envs.pool import GraderPool
from envs.task import Task
from synth.config import Context
from synth.llm import ChatClient
from synth.records import TaskRecord
from synth.solver import search_repair

NAME = "solve"
OUTPUT = TaskRecord


def units(tasks: list[TaskRecord], ctx: Context) -> list[TaskRecord]:
    return [t for t in tasks if t.ok]


def unit_key(rec: TaskRecord) -> str:
    return rec.key


def process(rec: TaskRecord, ctx: Context) -> TaskRecord:
    t0 = time.monotonic()
    out = TaskRecord.from_dict(rec.to_dict())
    task = Task.from_dict(rec.task)
    opts = ctx.opts
    with GraderPool(max_graders=1, graders_per_image=1) as pool:
        rewards, notes = [], []
        for attempt in range(opts.solver_attempts):
            res = search_repair(task, pool=pool, budget=opts.solver_budget, seed=attempt)
            rewards.append(res.reward)
            notes.append({"candidates": res.candidates, "tried": res.tried, "graded": res.graded, "note": res.note,
                          "top_lines": [f"{p}:{ln}" for p, ln, _ in res.suspicious[:5]]})
            if res.reward and "search" not in out.solutions:
                out.solutions["search"] = res.patch
        out.pass_matrix["search"] = rewards
        out.verdicts["search_trajectories"] = notes
        if opts.llm_base_url and opts.llm_model:
            client = ChatClient(opts.llm_base_url, opts.llm_model, opts.llm_api_key)
            name = f"llm:{opts.llm_model}"
            out.pass_matrix[name] = []
            for _ in range(opts.solver_attempts):
                res = run_episode_sync(task, client.policy, config=EpisodeConfig(max_turns=20),
                                       grade=functools.partial(grade_patch, pool=pool))
                out.pass_matrix[name].append(float(res.reward or 0.0))
                if res.reward and name not in out.solutions:
                    out.solutions[name] = res.final_diff or ""
    out.seconds = time.monotonic() - t0
    return out
