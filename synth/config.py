"""The factory's options (field names follow `rl.config.SynthConfig`) and the context every stage gets.

Not here: reading YAML or flags (synth/cli.py) or running stages (synth/runner.py).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

SAMPLE_REPO = Path(__file__).resolve().parent / "sample_repo"


@dataclass(kw_only=True)
class FactoryOptions:
    repo: str = "sample"  # a path, a git URL/path, "pypi:NAME==VERSION", or "sample"
    out_dir: str = "runs/factory"
    task_budget: int = 20  # tasks wanted out of the inspector
    concurrency: int = 2  # units of work in flight per stage
    flaky_reruns: int = 3  # extra gold runs for per-test flip rates
    gold_runs: int = 2  # the gold gate: K of K
    spec_margin: float = 1.5  # specify this many x task_budget candidates (later gates drop some)
    seed: int = 0
    solver_attempts: int = 1
    solver_budget: int = 150  # candidate edits the search solver may try per attempt
    run_slow_hacks: bool = False  # hacks that take the grader to its timeout (fork bomb)
    retries: int = 1  # reruns of a unit that raised (infrastructure errors)
    llm_base_url: str = field(default_factory=lambda: os.environ.get("FLASHPOST_LLM_BASE_URL", ""))
    llm_model: str = field(default_factory=lambda: os.environ.get("FLASHPOST_LLM_MODEL", ""))
    llm_api_key: str = field(default_factory=lambda: os.environ.get("FLASHPOST_LLM_API_KEY", ""))

    @property
    def source(self) -> str:
        return str(SAMPLE_REPO) if self.repo == "sample" else self.repo


@dataclass
class Context:
    opts: FactoryOptions
    out_dir: Path
    hooks: dict = field(default_factory=dict)  # replaceable parts, e.g. "statement_writer"
    _pools: dict = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def shared_pool(self, image: str):
        """One warm GraderPool per image for the whole run (closed by `close`)."""
        from envs.pool import GraderPool

        with self._lock:
            if image not in self._pools:
                n = max(1, self.opts.concurrency)
                self._pools[image] = GraderPool(max_graders=n, graders_per_image=n)
            return self._pools[image]

    def close(self) -> None:
        with self._lock:
            pools, self._pools = list(self._pools.values()), {}
        for p in pools:
            p.close()
