"""Stage 5, solver ensemble: each built task is attempted by the search-based repair agent
(synth/solver.py), by a policy checkpoint through the inference engine when `solvers.policy.checkpoint`
is set (synth/policy.py), and by an LLM agent when an OpenAI-compatible endpoint is configured
(synth/llm.py). Both episode solvers run the envs/episode.py tool loop in a sandbox of the task image
and are graded by envs/grading.py, exactly like RL rollouts.

The pass matrix (solver x attempt -> reward) and each solver's first passing patch are stored with the
task, and every episode's trajectory summary (termination, tool calls, touched files) for the
inspector's trajectory rules. An episode that ends without a grade (a policy or sandbox error) is a 0
in the matrix, with its reason kept; solving is evidence for the inspector, not a gate by itself.
Not here: the gates (inspect).
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable

from envs.episode import EpisodeConfig, EpisodeResult, estimate_tokens, run_episode_sync
from envs.grading import grade_patch
from envs.pool import GraderPool
from envs.task import Task
from synth.config import Context
from synth.llm import ChatClient
from synth.records import TaskRecord
from synth.solver import search_repair

NAME = "solve"
BUDGET_S = 1800.0  # seconds per unit (FactoryOptions.unit_budget_s overrides)
OUTPUT = TaskRecord
_ARG_CHARS = 300  # of each tool call's arguments kept in a trajectory summary


def units(tasks: list[TaskRecord], ctx: Context) -> list[TaskRecord]:
    return [t for t in tasks if t.ok]


def unit_key(rec: TaskRecord) -> str:
    return rec.key


def summarize(res: EpisodeResult) -> dict:
    """What the inspector's trajectory rules read: every tool call (arguments clipped), how the episode
    ended, and the files its diff touches."""
    tr = res.transcript
    calls = [{"name": c.name, "args": json.dumps(c.arguments, ensure_ascii=False)[:_ARG_CHARS]}
             for turn in tr.turns for c in turn.calls]
    diff = res.final_diff or ""
    touched = sorted({ln[len("+++ b/"):] for ln in diff.splitlines() if ln.startswith("+++ b/")} |
                     {ln[len("--- a/"):] for ln in diff.splitlines() if ln.startswith("--- a/")})
    return {"reward": res.reward, "termination": tr.termination, "error": (tr.error or "")[:500],
            "turns": len(tr.turns), "n_tokens": tr.n_tokens, "calls": calls, "touched": touched,
            "parse_errors": sum(len(t.parse_errors) for t in tr.turns),
            "grade_reason": res.grade.reason[:300] if res.grade else ""}


def run_episodes(name: str, make_policy: Callable[[int], Callable], task: Task, out: TaskRecord, ctx: Context,
                 pool: GraderPool, *, config: EpisodeConfig, count_tokens: Callable[[str], int] = estimate_tokens,
                 ) -> None:
    """`solver_attempts` episodes of one solver; fills its pass-matrix row, solution and trajectories."""
    rewards, notes = [], []
    for attempt in range(ctx.opts.solver_attempts):
        ctx.note(f"{name} episode {attempt + 1}/{ctx.opts.solver_attempts}")
        policy = make_policy(attempt)
        try:
            res = run_episode_sync(task, policy, config=config, count_tokens=count_tokens,
                                   grade=functools.partial(grade_patch, pool=pool))
        finally:
            if hasattr(policy, "close"):
                policy.close()
        reward = float(res.reward or 0.0)  # ungraded (policy/sandbox error) is a failed attempt
        rewards.append(reward)
        notes.append(summarize(res))
        if reward == 1.0 and name not in out.solutions:
            out.solutions[name] = res.final_diff or ""
    out.pass_matrix[name] = rewards
    out.verdicts.setdefault("episode_trajectories", {})[name] = notes


def process(rec: TaskRecord, ctx: Context) -> TaskRecord:
    t0 = time.monotonic()
    out = TaskRecord.from_dict(rec.to_dict())
    task = Task.from_dict(rec.task)
    opts = ctx.opts
    with GraderPool(max_graders=1, graders_per_image=1) as pool:
        rewards, notes = [], []
        for attempt in range(opts.solver_attempts):
            res = search_repair(task, pool=pool, budget=opts.solver_budget, seed=attempt,
                                note=lambda text, a=attempt: ctx.note(f"search {a + 1}: {text}"))
            rewards.append(res.reward)
            notes.append({"candidates": res.candidates, "tried": res.tried, "graded": res.graded, "note": res.note,
                          "top_lines": [f"{p}:{ln}" for p, ln, _ in res.suspicious[:5]]})
            if res.reward and "search" not in out.solutions:
                out.solutions["search"] = res.patch
        out.pass_matrix["search"] = rewards
        out.verdicts["search_trajectories"] = notes
        pol = opts.solvers.policy
        if pol.checkpoint:
            from synth.policy import CheckpointModel  # torch is imported only when a checkpoint is configured

            model = ctx.shared(f"policy:{pol.checkpoint}", lambda: CheckpointModel(pol))
            run_episodes(model.name, lambda seed: model.policy(seed, task.tools), task, out, ctx, pool,
                         count_tokens=model.count_tokens,
                         config=EpisodeConfig(max_turns=pol.max_turns, max_tokens=model.max_seq_len))
        llm = opts.solvers.llm
        if llm.base_url and llm.model:
            client = ChatClient(llm.base_url, llm.model, llm.api_key)
            run_episodes(f"llm:{llm.model}", lambda _: client.policy, task, out, ctx, pool,
                         config=EpisodeConfig(max_turns=llm.max_turns))
    out.seconds = time.monotonic() - t0
    return out
