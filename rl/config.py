"""The typed configuration tree of flashpost jobs.

Hydra composes YAML from `conf/`; the entry points convert it exactly once, with `to_job_config`
/ `to_factory_config`, into these dataclasses. Below the entry point nothing sees a DictConfig
and functions receive their own sub-config. Defaults live here, not in YAML; derived values are
computed in code. This module holds no training logic.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, OmegaConf

from rl.cluster import ClusterConfig
from rl.demo_config import DemoConfig
from synth.taskset import TaskFilter

MODEL_FLAVORS = ("debug", "tiny", "small", "flash")
TRAINER_KINDS = ("sft", "rl", "opd", "dspark")


def _require(value: Any, allowed: tuple, key: str) -> None:
    if value not in allowed:
        raise ValueError(f"{key}={value!r} is not one of {allowed}; pick one with `{key.split('.')[0]}=<name>`")


@dataclass(kw_only=True)
class ModelChoice:
    """A named flavor of `model.config.get_flavor` plus field overrides (official ModelArgs names)."""

    flavor: str = "tiny"
    overrides: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _require(self.flavor, MODEL_FLAVORS, "model.flavor")

    def build_args(self):
        """The ModelArgs this choice denotes; unknown override keys fail with the list of valid ones."""
        import dataclasses

        from model.config import get_flavor

        args = get_flavor(self.flavor)
        known = {f.name for f in dataclasses.fields(args)}
        unknown = sorted(set(self.overrides) - known)
        if unknown:
            raise ValueError(f"model.overrides has unknown ModelArgs fields {unknown}; valid fields: {sorted(known)}")
        fixed = {k: tuple(v) if isinstance(v, list) else v for k, v in self.overrides.items()}
        return get_flavor(self.flavor, **fixed)  # re-derives the layer schedule when n_layers changes


@dataclass(kw_only=True)
class OptimConfig:
    """Optimiser families of rl/optim.py: AdamW (`lr`, betas, eps) for norms/scalars, Muon (`muon_lr`,
    `momentum`, `ns_steps`) for hidden matrices, Sinkhorn-balanced momentum (`sinkhorn_lr`) for
    embedding, head and Engram tables; decoupled weight decay for all."""

    lr: float = 3e-4
    muon_lr: float = 0.02
    sinkhorn_lr: float = 3e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.0
    momentum: float = 0.95
    # torch.compile DeepSpeed's muon_update on a GPU: faster steps, after seconds of compilation and
    # autotuning per matrix shape (minutes for `small`); the demo's minutes-long stages run it eager
    compile_muon: bool = True
    ns_steps: int = 5
    ns_method: str = "gram"  # DeepSpeed's Newton-Schulz variant: "gram" (fp16, fp32 on CPU) or "standard" (bf16)
    sinkhorn_iters: int = 5
    # learning-rate schedule of every family (rl/optim.py lr_factor): "constant", or "cosine": linear warm-up
    # over `warmup_steps`, then cosine decay to min_lr_ratio x lr at `decay_steps` (None: trainer.max_steps)
    schedule: str = "constant"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1
    decay_steps: int | None = None

    def __post_init__(self) -> None:
        _require(self.ns_method, ("gram", "standard"), "trainer.optim.ns_method")
        _require(self.schedule, ("constant", "cosine"), "trainer.optim.schedule")
        if self.warmup_steps < 0 or not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"trainer.optim needs warmup_steps >= 0 (got {self.warmup_steps}) and 0 <= min_lr_ratio "
                             f"<= 1 (got {self.min_lr_ratio})")


IS_MODES = ("token_tis", "mask")


@dataclass(kw_only=True)
class PolicyLossConfig:
    """Decoupled PPO of rl/losses.py: w = sg(π_prox/μ) truncated at `is_cap` ("token_tis") or tokens
    masked when w is outside [is_band_low, is_band_high] ("mask"); trust region clip(π_θ/π_prox,
    1−eps_low, 1+eps_high); dual clip at `dual_clip`·|A| for A < 0 (None = off); k3 KL to a
    reference policy weighted by `kl_coef` (0 = off). `temperature`: the learner's log-probs (π_θ, π_prox)
    are taken at the temperature the rollout log-probs μ were sampled at, so the ratios compare one
    distribution; None = rollout.temperature (JobConfig fills it; a different value is refused)."""

    is_mode: str = "token_tis"
    is_cap: float = 2.0
    is_band_low: float = 0.5
    is_band_high: float = 2.0
    eps_low: float = 0.2
    eps_high: float = 0.28
    dual_clip: float | None = None
    kl_coef: float = 0.0
    temperature: float | None = None

    def __post_init__(self) -> None:
        _require(self.is_mode, IS_MODES, "trainer.policy_loss.is_mode")
        if self.temperature is not None and self.temperature <= 0:
            raise ValueError(f"trainer.policy_loss.temperature={self.temperature} must be > 0 (RL samples)")
        if self.dual_clip is not None and self.dual_clip <= 1.0:
            raise ValueError(f"trainer.policy_loss.dual_clip={self.dual_clip} must be > 1")
        if not 0 < self.is_band_low <= 1.0 <= self.is_band_high:
            raise ValueError("trainer.policy_loss needs 0 < is_band_low <= 1 <= is_band_high")


@dataclass(kw_only=True)
class AuditConfig:
    """The online task audit of trainer=rl (rl/audit.py): a task is flagged and held out of sampling when
    its pass rate over its latest `window` episodes exceeds its earlier one by `jump`, or when its
    successful episodes (at least `min_successes`) take a median below `short_ratio` × the fewest turns
    of its verified solver runs."""

    enabled: bool = True
    window: int = 8
    jump: float = 0.5
    short_ratio: float = 0.5
    min_successes: int = 3

    def __post_init__(self) -> None:
        if self.window < 1 or self.min_successes < 1 or not 0 < self.jump <= 1 or not 0 < self.short_ratio <= 1:
            raise ValueError("trainer.audit needs window >= 1, min_successes >= 1, 0 < jump <= 1, 0 < short_ratio <= 1")


@dataclass(kw_only=True)
class TrainerConfig:
    """What the learner optimises and for how long."""

    kind: str = "sft"
    max_steps: int = 100
    # torch threads of the learner actor (it asks Ray for as many CPUs, at most the cluster's): 2 on a
    # 2-core machine when the learner runs alone (sft, dspark), 1 when rollouts share the cores
    threads: int = 1
    micro_batch_tokens: int = 4096
    global_batch_tokens: int = 16384
    seed: int = 0
    zero_stage: int = 0
    checkpoint_every: int = 50
    batch_size: int = 8  # trajectories per SFT / DSpark step (RL and OPD steps take rollout.groups_per_step groups)
    grad_clip: float = 1.0
    optim: OptimConfig = field(default_factory=OptimConfig)
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    advantage: str = "grpo"
    advantage_eps: float = 1e-6
    opd_chunk_size: int = 4096
    indexer_loss_weight: float = 1.0
    dspark_weight: float = 1.0  # DSpark drafter alignment, added in every trainer (0 = drafter frozen)
    # training forward with model/'s simulated decoder replay of each turn's CED prefill, so the learner's
    # log-probs are the rollout's; None: follows rollout.prefill_mode for rl/opd (JobConfig), off otherwise
    simulate_replay: bool | None = None
    # routing replay: rollout workers record every token's MoE experts (engine record_routing=True, CUDA
    # graphs off) and the learner's forward routes by them; the indexer still recomputes its top-k
    routing_replay: bool = False
    teacher_ship: str = "hidden"  # OPD: the teacher returns "hidden" states + its head, or full "logits"
    teacher_seed: int = 1  # OPD teacher weights when no teacher_checkpoint is given
    teacher_checkpoint: str | None = None
    # OPD: the teacher's architecture when it differs from the student's (`+model@trainer.teacher_model=NAME`
    # picks a conf/model/ option); None = the student's `model:`
    teacher_model: ModelChoice | None = None
    init_checkpoint: str | None = None  # rl/opd: start from these weights (a model.safetensors, e.g. of SFT)
    balance_alpha: float = 1e-4
    expert_bias_rate: float = 1e-3
    audit: AuditConfig = field(default_factory=AuditConfig)  # trainer=rl: online task audit (rl/audit.py)

    def __post_init__(self) -> None:
        _require(self.kind, TRAINER_KINDS, "trainer.kind")
        _require(self.advantage, ("grpo", "rloo"), "trainer.advantage")
        _require(self.teacher_ship, ("hidden", "logits"), "trainer.teacher_ship")
        if self.global_batch_tokens % self.micro_batch_tokens:
            raise ValueError(
                f"trainer.global_batch_tokens ({self.global_batch_tokens}) must be a multiple of "
                f"trainer.micro_batch_tokens ({self.micro_batch_tokens})"
            )
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"trainer.zero_stage={self.zero_stage} must be 0, 1, 2 or 3")
        if self.threads < 1:
            raise ValueError(f"trainer.threads={self.threads} must be >= 1")


@dataclass(kw_only=True)
class RolloutConfig:
    """How rollout workers sample and how stale their samples may be."""

    n_workers: int = 1
    temperature: float = 0.7
    top_p: float = 1.0
    max_new_tokens: int = 64
    group_size: int = 8
    groups_per_step: int = 2  # GRPO groups per learner update (admission control counts groups)
    max_policy_lag: int = 1
    max_turns: int = 4
    seed: int = 0
    threads_per_worker: int = 1
    # The V4.1 inference path of the rollout engine (model/engine.py), each a switch for ablation:
    # prefill_mode "ced": every turn's prompt through CED prefill with decoder bounded replay ("full": the
    # whole stack over every position; pairs with trainer.simulate_replay=false);
    prefill_mode: str = "ced"
    # prefix_cache: sessions start from the longest stored prefix (model/prefix_cache.py, banks stored as
    # packed FP4/MXFP4 bytes under QAT); a group's shared prompt is prefilled once for its G samples (an
    # episode's later turns continue its own session's cache); emptied at each weight load;
    prefix_cache: bool = True
    # packed_cache: live sessions hold their caches as packed bytes (FP8 windows, FP4/MXFP4 banks), which
    # the prefix cache stores and restores as they are; lossless only on the QAT grid (`live_packed`);
    packed_cache: bool = True
    # speculative: DSpark speculative decoding (engine.generate_speculative), the draft length scheduled
    # by the measured cost model, switched off per session while it measures a loss;
    speculative: bool = True
    spec_min_speedup: float = 1.0  # model.speculative.SpeculativeConfig.min_speedup
    # compile_decode: where the engine's decode steps replay CUDA graphs (CUDA, impl=triton, no routing
    # recording), their layers are compiled by inductor first: ~1.5x faster steps for a compile of
    # minutes the first time each batch bucket runs with each bank size (GRAPH_TOKENS steps of the
    # longest session: episodes that grow meet new ones; model/engine.py); false keeps the graphs uncompiled
    compile_decode: bool = True
    # "engine": episodes call the worker's engine in-process; "server": the worker serves its engine with
    # flashpost-serve on loopback and the episodes reach it only through the OpenAI API (rl/serve_rollout.py)
    agent: str = "engine"

    def live_packed(self, qat: bool) -> bool:
        """Whether the engine's live caches are packed: packed bytes are exact only on the QAT grid, so a
        model with qat off keeps dense caches whatever rollout.packed_cache says."""
        return self.packed_cache and qat

    def __post_init__(self) -> None:
        _require(self.agent, ("engine", "server"), "rollout.agent")
        _require(self.prefill_mode, ("ced", "full"), "rollout.prefill_mode")
        if self.prefix_cache and self.prefill_mode != "ced":
            raise ValueError("rollout.prefix_cache=true needs rollout.prefill_mode=ced (only CED states are cached); "
                             "set rollout.prefix_cache=false with prefill_mode=full")
        if self.max_policy_lag < 0:
            raise ValueError("rollout.max_policy_lag must be >= 0 (0 = synchronous)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"rollout.top_p={self.top_p} must be in (0, 1]")


@dataclass(kw_only=True)
class EnvConfig:
    """Sandboxes: the hardened limits of every container and how many may run at once."""

    memory_mb: int = 512
    pids_limit: int = 128
    cpus: float = 1.0
    workspace_mb: int = 256
    max_concurrent: int = 4
    exec_timeout_s: float = 30.0
    # the upper bound of a grading's tests: a task whose source measured a grading budget when it verified
    # it (verification["grading_budget_s"]: the factory's inspector, the demo's families) gets that budget
    # when smaller (envs.grading.grading_timeout), so an endless loop costs a few times the task's tests
    grading_timeout_s: float = 120.0


@dataclass(kw_only=True)
class SynthConfig:
    """The environment factory: where repositories come from and how many tasks to build."""

    repo: str = "sample"
    out_dir: str = "runs/factory"
    task_budget: int = 20
    concurrency: int = 2
    flaky_reruns: int = 3


@dataclass(kw_only=True)
class JobConfig:
    """Root of `flashpost-train` (conf/train.yaml)."""

    model: ModelChoice = field(default_factory=ModelChoice)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    # the task set (synth/taskset.py): a folder, or a shipped name of conf/tasksets/ ("toy", "fixtures",
    # "families"); sft reads its train demonstrations, rl/opd its train split as episodes (the rows' env
    # picks in-process or sandboxed episodes)
    tasks: str = "toy"
    task_filter: TaskFilter = field(default_factory=TaskFilter)
    run_dir: str = "runs/default"
    dry_run: bool = False
    entry: str = "train"  # "train": the trainer picked by trainer.kind; "demo": the embedded demo pipeline
    demo: DemoConfig = field(default_factory=DemoConfig)  # the demo's stages (entry "demo" only)

    def __post_init__(self) -> None:
        _require(self.entry, ("train", "demo"), "entry")
        if self.trainer.optim.decay_steps is None:  # the schedule decays over the job's own steps
            self.trainer.optim.decay_steps = self.trainer.max_steps
        pl = self.trainer.policy_loss
        if pl.temperature is None:
            pl.temperature = self.rollout.temperature
        elif self.trainer.kind == "rl" and pl.temperature != self.rollout.temperature:
            raise ValueError(
                f"trainer.policy_loss.temperature={pl.temperature} differs from rollout.temperature="
                f"{self.rollout.temperature}: the importance ratios would compare different distributions; "
                "leave trainer.policy_loss.temperature unset (it follows the rollout)"
            )
        # the learner reproduces the rollout's execution plan: decoder replay on both sides or neither
        ced = self.rollout.prefill_mode == "ced"
        if self.trainer.simulate_replay is None:
            self.trainer.simulate_replay = ced and self.trainer.kind in ("rl", "opd")
        elif self.trainer.kind in ("rl", "opd") and self.trainer.simulate_replay != ced:
            raise ValueError(
                f"trainer.simulate_replay={self.trainer.simulate_replay} needs rollout.prefill_mode="
                f"{'ced' if self.trainer.simulate_replay else 'full'} (got {self.rollout.prefill_mode!r}): the "
                "training forward must simulate what the rollout engine computed"
            )
        if self.trainer.routing_replay and self.rollout.agent != "engine":
            raise ValueError(
                "trainer.routing_replay=true needs rollout.agent=engine: served episodes do not return the "
                "engine's recorded routing; set rollout.agent=engine or trainer.routing_replay=false"
            )


@dataclass(kw_only=True)
class FactoryJobConfig:
    """Root of `flashpost-factory` (conf/factory.yaml)."""

    synth: SynthConfig = field(default_factory=SynthConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)


@dataclass(kw_only=True)
class EvalConfig:
    """Root of `flashpost-eval` (conf/eval.yaml): `samples` episodes per task of `split`, pass@1 and pass@k."""

    model: ModelChoice = field(default_factory=ModelChoice)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    tasks: str = "toy"
    task_filter: TaskFilter = field(default_factory=TaskFilter)
    split: str = "heldout"
    checkpoint: str | None = None  # a model.safetensors or a run folder (its latest); None = seeded init
    init_seed: int = 0  # the seeded initialisation's seed (no checkpoint)
    samples: int = 4
    k: int = 4
    seed: int = 0
    out_dir: str = "runs/eval"

    def __post_init__(self) -> None:
        if self.samples < 1 or not 1 <= self.k:
            raise ValueError(f"samples={self.samples} and k={self.k} must be >= 1 (pass@k uses min(k, samples))")


def _convert(cfg: DictConfig, schema: type):
    merged = OmegaConf.merge(OmegaConf.structured(schema), cfg)
    return OmegaConf.to_object(merged)


def register_schemas() -> None:
    """Dataclass nodes for Hydra's ConfigStore, so YAML can compose them in (`- /schema/demo@demo`)
    and every field is overridable and type-checked on the command line without repeating the
    defaults in YAML. Called once by the entry point that composes (rl/train.py)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(group="schema", name="demo", node=DemoConfig)


def to_job_config(cfg: DictConfig) -> JobConfig:
    """Hydra's composed config -> JobConfig, validating types and unknown keys."""
    return _convert(cfg, JobConfig)


def to_eval_config(cfg: DictConfig) -> EvalConfig:
    return _convert(cfg, EvalConfig)


def to_factory_config(cfg: DictConfig) -> FactoryJobConfig:
    return _convert(cfg, FactoryJobConfig)
