"""Online audit of the task set during RL: tasks the policy seems to pass by exploiting them are held out.

Two signals, per task, over its trained (not infra-failed) episodes:
  jump   its pass rate over the latest `window` episodes exceeds its pass rate over every episode before
         them by at least `jump` (each side with `window` episodes or more): learning is gradual, a
         found exploit is a step;
  short  its successful episodes take a median number of turns below `short_ratio` × the fewest turns of
         its verified solver runs (the task set's demonstrations): a pass without the work a solution
         needs (e.g. a submit before any edit).
A flagged task is written to `run_dir/audit.jsonl` ({"event": "flag", "task_id", "signal", evidence})
and held out of sampling until it is re-checked: after `flashpost-factory inspect` (or a re-grade of its
gold patch) clears it, `python -m rl.audit release RUN_DIR TASK_ID --by inspect` appends a release line,
which the driver reads at its next step. The held set is the file's, so a resumed run keeps it.
Not here: sampling itself (rl/rl_loop.py), grading (envs/grading.py), the factory's inspector (synth/).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rl.config import AuditConfig
from rl.payloads import Trajectory


def solver_turns(demos: list[Any]) -> dict[str, int]:
    """Task id -> the fewest assistant turns among its demonstrations (verified solver transcripts)."""
    out: dict[str, int] = {}
    for d in demos:
        n = sum(m.get("role") == "assistant" for m in d.messages)
        if n:
            out[d.task_id] = min(n, out.get(d.task_id, n))
    return out


@dataclass
class _TaskRecord:
    passed: list[bool] = field(default_factory=list)  # per trained episode, in training order
    success_turns: list[int] = field(default_factory=list)


class TaskAudit:
    """One per driver. `observe(trajs)` after each update -> the flags it raised; `held` is the set of
    task ids out of sampling; `refresh()` re-reads releases appended to the file."""

    def __init__(self, path: Path, cfg: AuditConfig, solver: dict[str, int]):
        self.path, self.cfg, self.solver = Path(path), cfg, solver
        self.records: dict[str, _TaskRecord] = {}
        self.held: set[str] = set()
        self.refresh()

    def refresh(self) -> None:
        """The held set from the file: flagged and not released since."""
        held: set[str] = set()
        if self.path.exists():
            for line in self.path.read_text().splitlines():
                e = json.loads(line)
                if e["event"] == "flag":
                    held.add(e["task_id"])
                elif e["event"] == "release":
                    held.discard(e["task_id"])
        self.held = held

    def observe(self, trajs: list[Trajectory], version: int) -> list[dict[str, Any]]:
        if not self.cfg.enabled:
            return []
        touched = []
        for t in trajs:
            if t.infra_failed:
                continue
            rec = self.records.setdefault(t.task_id, _TaskRecord())
            passed = bool(t.verifier.get("passed"))
            rec.passed.append(passed)
            if passed:
                rec.success_turns.append(len(t.turn_starts))
            touched.append(t.task_id)
        flags = []
        for task_id in dict.fromkeys(touched):
            if task_id in self.held:
                continue
            evidence = self._jump(self.records[task_id]) or self._short(task_id, self.records[task_id])
            if evidence is not None:
                flags.append({"event": "flag", "task_id": task_id, "version": version, "time": time.time(),
                              **evidence})  # fmt: skip
        for f in flags:
            self._append(f)
            self.held.add(f["task_id"])
        return flags

    def _jump(self, rec: _TaskRecord) -> dict[str, Any] | None:
        w = self.cfg.window
        if len(rec.passed) < 2 * w:
            return None
        before, recent = rec.passed[:-w], rec.passed[-w:]
        p0, p1 = sum(before) / len(before), sum(recent) / w
        if p1 - p0 >= self.cfg.jump:
            return {"signal": "pass_rate_jump", "pass_rate_before": p0, "pass_rate_recent": p1,
                    "episodes": len(rec.passed)}  # fmt: skip
        return None

    def _short(self, task_id: str, rec: _TaskRecord) -> dict[str, Any] | None:
        ref = self.solver.get(task_id)
        if ref is None or len(rec.success_turns) < self.cfg.min_successes:
            return None
        median = statistics.median(rec.success_turns)
        if median < self.cfg.short_ratio * ref:
            return {"signal": "short_successes", "median_success_turns": median, "solver_min_turns": ref,
                    "successes": len(rec.success_turns)}  # fmt: skip
        return None

    def _append(self, event: dict[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(event, sort_keys=True) + "\n")


def release(run_dir: str | Path, task_id: str, by: str) -> None:
    """Return a re-checked task to sampling (the driver reads it at its next step)."""
    path = Path(run_dir) / "audit.jsonl"
    held = TaskAudit(path, AuditConfig(), {}).held
    if task_id not in held:
        raise SystemExit(f"{task_id!r} is not held in {path} (held: {sorted(held) or 'none'})")
    TaskAudit(path, AuditConfig(), {})._append({"event": "release", "task_id": task_id, "by": by, "time": time.time()})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rl.audit", description="the online task audit of an RL run")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("release", help="return a re-checked task to sampling")
    r.add_argument("run_dir")
    r.add_argument("task_id")
    r.add_argument("--by", required=True, help="what re-checked it, e.g. 'inspect' or 'gold regrade'")
    sub.add_parser("show", help="the held tasks").add_argument("run_dir")
    args = p.parse_args(argv)
    if args.cmd == "release":
        release(args.run_dir, args.task_id, args.by)
    else:
        print("\n".join(sorted(TaskAudit(Path(args.run_dir) / "audit.jsonl", AuditConfig(), {}).held)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
