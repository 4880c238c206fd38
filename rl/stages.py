"""Resumable job stages: each stage runs once per run folder and records its summary.

A stage is a function `fn(stage_dir: Path) -> dict` (a JSON-able summary). Its completion is a
`done.json` written atomically inside `run_dir/<stage name>/`; a rerun of the same job loads that
summary instead of running the stage again, so killing a job loses at most the stage in flight
(and stages that checkpoint internally lose less). This module knows nothing about what the
stages do.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

StageFn = Callable[[Path], dict[str, Any]]


@dataclass(frozen=True)
class StageOutcome:
    name: str
    summary: dict[str, Any]
    seconds: float
    resumed: bool


def write_json_atomic(path: Path, payload: Any) -> None:
    """Write JSON to a temp file in the same folder, fsync, then rename over `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + f".tmp{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=2, sort_keys=True, default=str)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def run_stage(run_dir: Path, name: str, fn: StageFn) -> StageOutcome:
    """Run `fn` unless `run_dir/name/done.json` says it already finished; print one status line."""
    stage_dir = run_dir / name
    done = stage_dir / "done.json"
    if done.exists():
        record = json.loads(done.read_text())
        print(f"[stage] {name}: already done in a previous run ({record['seconds']:.1f} s), resuming after it")
        return StageOutcome(name, record["summary"], record["seconds"], resumed=True)
    stage_dir.mkdir(parents=True, exist_ok=True)
    print(f"[stage] {name}: running", flush=True)
    t0 = time.perf_counter()
    summary = fn(stage_dir)
    seconds = time.perf_counter() - t0
    write_json_atomic(done, {"summary": summary, "seconds": seconds, "finished_at": time.time()})
    print(f"[stage] {name}: done in {seconds:.1f} s", flush=True)
    return StageOutcome(name, summary, seconds, resumed=False)


def record_run(run_dir: Path, resolved_config_yaml: str) -> None:
    """Save what reproduces this run beside its outputs: resolved config, git revision and diff."""
    import subprocess

    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.resolved.yaml").write_text(resolved_config_yaml)
    repo = Path(__file__).resolve().parents[1]

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            return ""

    (run_dir / "git_revision.txt").write_text(git("rev-parse", "HEAD").strip() + "\n")
    (run_dir / "git_diff.patch").write_text(git("diff", "HEAD"))
