"""The factory's options (field names follow `rl.config.SynthConfig`) and the context every stage gets.

Not here: reading YAML or flags (synth/cli.py) or running stages (synth/runner.py).
"""

from __future__ import annotations

import dataclasses
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

SAMPLE_REPO = Path(__file__).resolve().parent / "sample_repo"


@dataclass(kw_only=True)
class PolicySolverOptions:
    """A flashpost checkpoint run through model/engine.py as an episode policy (off when no checkpoint)."""

    checkpoint: str = ""  # a .safetensors file or a folder of them (model/checkpoint.py)
    flavor: str = ""  # model/config.py flavor, when the checkpoint header stores no ModelArgs
    device: str = "cpu"
    max_new_tokens: int = 256  # per assistant turn
    temperature: float = 0.0
    max_turns: int = 8
    max_seq_len: int = 0  # 0: the model's own


@dataclass(kw_only=True)
class LLMSolverOptions:
    """An OpenAI-compatible endpoint run as an episode policy (off unless base_url and model are set)."""

    base_url: str = field(default_factory=lambda: os.environ.get("FLASHPOST_LLM_BASE_URL", ""))
    model: str = field(default_factory=lambda: os.environ.get("FLASHPOST_LLM_MODEL", ""))
    api_key: str = field(default_factory=lambda: os.environ.get("FLASHPOST_LLM_API_KEY", ""), repr=False)
    max_turns: int = 20


@dataclass(kw_only=True)
class SolverOptions:
    """The ensemble beyond the search solver (which always runs)."""

    policy: PolicySolverOptions = field(default_factory=PolicySolverOptions)
    llm: LLMSolverOptions = field(default_factory=LLMSolverOptions)


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
    history_commits: int = 50  # newest commits of a git source considered for inversion
    unit_budget_s: dict[str, float] = field(default_factory=dict)  # stage -> seconds per unit (default: BUDGET_S)
    solvers: SolverOptions = field(default_factory=SolverOptions)

    @property
    def source(self) -> str:
        return str(SAMPLE_REPO) if self.repo == "sample" else self.repo

    def to_dict(self, *, secrets: bool = False) -> dict:
        doc = dataclasses.asdict(self)
        if not secrets:
            doc["solvers"]["llm"].pop("api_key")
        return doc

    @classmethod
    def from_dict(cls, doc: dict) -> FactoryOptions:
        """Inverse of `to_dict` (options.json); unknown keys are ignored, missing ones default."""
        names = {f.name for f in dataclasses.fields(cls)}
        flat = {k: v for k, v in doc.items() if k in names and k != "solvers"}
        sv = doc.get("solvers") or {}
        solvers = SolverOptions(policy=PolicySolverOptions(**sv.get("policy", {})),
                                llm=LLMSolverOptions(**sv.get("llm", {})))
        return cls(**flat, solvers=solvers)


@dataclass
class Context:
    opts: FactoryOptions
    out_dir: Path
    hooks: dict = field(default_factory=dict)  # replaceable parts, e.g. "statement_writer"
    _pools: dict = field(default_factory=dict)
    _shared: dict = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    stopping: threading.Event = field(default_factory=threading.Event)  # set on Ctrl-C: stop early if you can
    _notes: dict = field(default_factory=dict)  # unit key -> what it is doing now (the progress postfix)
    _local: threading.local = field(default_factory=threading.local)

    def begin_unit(self, key: str) -> None:
        self._local.key = key

    def end_unit(self, key: str) -> None:
        self._local.key = None
        self._notes.pop(key, None)

    def note(self, text: str) -> None:
        """Say what the current unit is doing (shown in its stage's progress bar, and in its drop reason
        if it runs out of time); a no-op outside a unit."""
        key = getattr(self._local, "key", None)
        if key is not None:
            self._notes[key] = text

    def unit_note(self, key: str) -> str:
        return self._notes.get(key, "")

    def shared_pool(self, image: str):
        """One warm GraderPool per image for the whole run (closed by `close`)."""
        from envs.pool import GraderPool

        with self._lock:
            if image not in self._pools:
                n = max(1, self.opts.concurrency)
                self._pools[image] = GraderPool(max_graders=n, graders_per_image=n)
            return self._pools[image]

    def shared(self, name: str, make):
        """One `make()` per name until `close` (e.g. a loaded policy model, shared by a stage's threads)."""
        with self._lock:
            if name not in self._shared:
                self._shared[name] = make()
            return self._shared[name]

    def close(self) -> None:
        with self._lock:
            pools, self._pools = list(self._pools.values()), {}
            self._shared.clear()
        for p in pools:
            p.close()
