"""The demo's configuration: `demo:` of `flashpost-train experiment=demo` (rl.config.JobConfig.demo).

Sizes, budgets and learning settings of every demo stage, as plain dataclasses so Hydra can type them
(`demo.rl.seconds=150 demo.device=cuda` on the command line). Defaults are the measured ones for a
quiet 2-core machine (README: three seeds of `make demo`); the demo policy itself is `model:`
(conf/model/tiny_demo.yaml for `make demo`, any flavor with `model=...`).
Not here: the loops (rl/demo_learning.py, rl/demo_opd.py) or the stage wiring (rl/demo_stages.py);
this module imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# The recommended demo policy: `tiny` with 4 layers and 2 mHC streams (the V4.1 parts stay on), as
# conf/model/tiny_demo.yaml gives it to `make demo`.
DEMO_OVERRIDES: dict = {"n_layers": 4, "hc_mult": 2}
# The demo's task families, in report order, with what each holds (F: demo.factory_budget > 0)
TASK_FAMILIES = {"A": "demonstrations", "B": "tests only", "F": "factory, sample repository"}


@dataclass
class SFTConfig:
    """The demo's SFT (rl.demo_learning.run_sft): packed chat rows of family-A demonstrations."""

    seconds: float = 240.0  # wall-clock cap
    steps: int = 0  # step budget (0: none); with a cap above the quiet machine's time, load cannot change results
    seq_len: int = 256
    rows: int = 8  # rows per optimiser step
    lr: float = 2e-3
    muon_lr: float = 0.02
    dspark_weight: float = 1.0  # the DSpark drafter learns the policy on assistant tokens (0: untouched)
    dspark_every: int = 4  # ...on every n-th step: its k-token drafts over every position cost ~half a step
    # cosine decay to lr * lr_floor by the end of the stage, steps or seconds, whichever binds first
    # (rl.demo_learning.sft_lr_scale); 1.0: constant
    lr_floor: float = 0.1



@dataclass
class RLConfig:
    """The demo's asynchronous GRPO (rl.demo_learning.run_rl) on family B with real grading."""

    seconds: float = 240.0  # wall-clock cap
    steps: int = 0  # step budget (0: none)
    tasks_per_step: int = 4
    samples: int = 8
    temperature: float = 0.7
    # DEMO_NOTES' AdamW lr 3e-5 moved the greedy policy too little in the ~50-100 updates 2 cores
    # allow; Muon (matrices) needs a larger lr than AdamW for a similar step.
    lr: float = 1e-4
    muon_lr: float = 2e-3
    dspark_weight: float = 1.0  # keeps the drafter aligned with the moving policy
    dspark_every: int = 4  # on every n-th update
    # Task choice by template: weight p(1-p) + floor, p = the template's recent sampled reward, so
    # groups land where they have reward spread (all-0 or all-1 groups carry no GRPO signal).
    adaptive: bool = True
    adaptive_floor: float = 0.03
    adaptive_decay: float = 0.7  # EMA keep-factor of a template's p per group seen
    # RL draws family B only, and its updates wore family A down (held-out A -0.05..-0.13 per seed):
    # each update also takes an SFT term on ptx_rows packed family-A demonstration rows (InstructGPT's
    # "PPO-ptx" mix), weighted by ptx_weight (0: off).
    ptx_weight: float = 1.0
    ptx_rows: int = 2
    max_policy_lag: int = 1  # 1: the worker samples batch t+1 while batch t is graded and trained; 0: in turn



@dataclass
class OPDConfig:
    """Sizes from a sweep of 16 settings on the seed-0 SFT-only student (held-out A / B 0.475 / 0.250, the
    RL'd teacher 0.600 / 0.430): OPD first costs family A and then wins it back as the reverse KL falls,
    so steps count most: 15 steps of 16 prompts gave 0.40-0.42 / 0.26-0.34 at every learning rate tried,
    40 steps of 8 prompts 0.47 / 0.32, 80 steps 0.485 / 0.43. AdamW lr 1e-3 on the embedding, head and
    norms did worse than 1e-4 (0.42 / 0.31 against 0.47 / 0.32 at 40 steps); without the SFT term family
    A fell further (0.36 against 0.42 at 15 steps)."""

    seconds: float = 120.0  # wall-clock cap
    steps: int = 0  # step budget (0: none)
    prompts_per_step: int = 8  # fewer distinct prompts: fewer decode groups, more steps per second
    samples: int = 2  # student samples per prompt
    temperature: float = 1.0  # the student samples from its own distribution
    share_b: float = 0.5  # share of prompts from family B (the rest from family A)
    lr: float = 1e-4
    muon_lr: float = 0.01
    # SFT on ptx_rows packed family-A demonstration rows in every step (the demonstrations the SFT-only
    # student keeps training on), weighted by ptx_weight (0: pure OPD)
    ptx_weight: float = 1.0
    ptx_rows: int = 2


@dataclass(kw_only=True)
class DemoConfig:
    """Demo sizes and budgets. Each learning stage has a step budget and a wall-clock cap (`make demo`
    <= 20 minutes). On a 2-core machine SFT (70-73 of 200 steps in the recorded seeds), RL (92-100 of
    140), the student's SFT (53-69 of 330) and OPD (41 of 90) stop at their caps, so how far each
    gets depends on the machine's speed. With a constant learning rate that moved results as much as
    the seed did (held-out A 0.41 or 0.56 after 80 or 85 steps of seed 0's one SFT trajectory); SFT's
    learning rate now decays over whichever budget binds (SFTConfig.lr_floor), so it ends annealed.
    On a GPU (`model=small cluster=h200`) set the caps and `steps=0` for the time you have."""

    seed: int = 0  # experiment=demo sets it from trainer.seed
    # the demo policy: model.config.get_flavor(flavor, **overrides); experiment=demo sets both from `model:`
    flavor: str = "tiny"
    overrides: dict = field(default_factory=lambda: dict(DEMO_OVERRIDES))
    device: str = "auto"  # "auto": cuda when torch sees a GPU, else cpu
    threads: int = 2  # torch CPU threads of the learner (the rollout worker takes half the cores)
    # The student: the policy at 1/student_shrink of its width (dim and moe_inter_dim)
    student_shrink: int = 2
    # family F: tasks the factory builds from the bundled sample repository (synth/factory_family.py);
    # factory_budget tasks wanted out of its inspector (9-12 s per accepted task on 2 cores; budget 4 gave 6-7),
    # split train / held-out by task id; each SFT batch takes factory_demos_per_batch of the train
    # tasks' solver demonstrations (0 with factory_budget 0: no factory stage)
    factory_budget: int = 4
    factory_heldout_share: float = 0.5
    factory_demos_per_batch: int = 2
    n_train_a: int = 5000
    n_train_b: int = 300
    n_heldout: int = 150
    # held-out prompts decoded speculatively to measure DSpark acceptance (8, halved from 16 to make
    # room for the factory stage inside 20 minutes)
    n_acceptance: int = 8
    sft: SFTConfig = field(default_factory=lambda: SFTConfig(steps=200, seconds=200.0))
    # RL: 120 steps took 260-271 s on a quiet machine. With the evaluations' generation split
    # over two processes (rl.demo_learning.greedy_families) RL got their time: the 300 s cap stopped it
    # at 92-100 steps (the 245 s cap at 80-89); held-out B after RL was 0.36-0.58 over 3 seeds at 245 s,
    # 0.527-0.533 at 300 s
    rl: RLConfig = field(default_factory=lambda: RLConfig(steps=140, seconds=300.0))
    # The student: SFT alone (the SFT-only student), then OPD continues from its weights (the OPD
    # student). The half-width student's SFT flattens: 100 s more SFT after 160 s measured 0.475 /
    # 0.270 held-out A / B against 0.475 / 0.250 (seed 0, a loaded machine), so the comparison is OPD
    # against SFT alone, not against a student stopped early. OPD gains with steps (OPDConfig) and is
    # asynchronous like RL; with 120 s of SFT instead of 160 the student fell to 0.320 / 0.225
    # (seed 0), so SFT keeps 140 s and OPD gets 110 s. The student's SFT keeps a constant learning
    # rate: decayed over 140 s, its 60 steps reached only 0.19 / 0.12 (seed 0, a slow machine).
    student_sft: SFTConfig = field(default_factory=lambda: SFTConfig(steps=330, seconds=140.0, lr_floor=1.0))
    opd: OPDConfig = field(default_factory=lambda: OPDConfig(steps=90, seconds=110.0))

    def __post_init__(self) -> None:
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"demo.device={self.device!r}: use auto, cpu, cuda or cuda:N")
        if self.student_shrink < 1:
            raise ValueError(f"demo.student_shrink={self.student_shrink} must be >= 1 (1: a same-size student)")
