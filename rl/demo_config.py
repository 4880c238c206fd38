"""The demo's configuration: `demo:` of `flashpost-train experiment=demo` (rl.config.JobConfig.demo).

The demo is the product's jobs in a row (rl/demo.py); this file says what each job is told. Every job
gets Hydra overrides, the same strings a user types after `flashpost-train` / `flashpost-eval`:
`jobs` go to every training and evaluation job (model, rollout), `train` to every training job, and
each stage adds its own (`sft`, `rl`, `student`, `student_sft`, `opd`, `eval`). The run folders, task
set and checkpoints are filled in by rl/demo.py. Defaults are the measured ones for a 2-core machine
(docs/demo_measurements.md); a longer run, e.g. `demo.sft_steps=200 demo.rl_steps=40`, on the command line.
Not here: running the jobs (rl/demo.py) or the report (rl/demo_report.py); this module imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def _list(*items: str):
    return field(default_factory=lambda: list(items))


@dataclass(kw_only=True)
class DemoConfig:
    """What `make demo` builds and how long each job trains."""

    seed: int = 0  # experiment=demo sets it from trainer.seed; it seeds the task sets and every job
    # the factory's two sources: the bundled sample repository (verified tasks wanted; 0: skip it) and the
    # synthetic families (`--budget` family-A tasks with demonstrations, half as many family-B, tests only)
    factory_budget: int = 2
    families_budget: int = 96
    families_heldout: int = 12  # held-out tasks of each family (the evaluations' A and B rows)
    # each training job's steps (its trainer.max_steps) and each evaluation's episodes per held-out task
    # (pass@1 is their mean; pass@k uses k = eval_samples; more than 1 needs a sampling temperature in
    # `eval`, whose greedy episodes are all alike). SFT needs ~100 steps of 6 before the edit's arguments
    # follow the task (the line from the statement, the text from the viewed line; 60 left them constant)
    sft_steps: int = 150
    rl_steps: int = 16  # updates of 2 groups of 8 episodes each: 311-363 s on 2 cores (docs/demo_measurements.md)
    student_sft_steps: int = 40
    opd_steps: int = 4
    eval_samples: int = 1
    # Overrides of every training and evaluation job: the policy (conf/model/) and the rollout engine's
    # inference path. CED prefill with bounded decoder replay in rollouts, its simulation in training.
    # A family episode's longest call (edit) is 38-44 tokens: 48 new tokens a turn leave room, and an untrained
    # policy's babble ends sooner; 5 turns hold view -> edit -> tests -> submit, or view -> a failed edit ->
    # tests -> a second edit -> tests (an episode that ends at the turn limit is graded too).
    # No grading timeout here: each family task's grading budget, measured when the families source grades
    # its template's gold patch (synth/taskset_sources.py `family_grading_budgets`), bounds its gradings
    # below env.grading_timeout_s, so an edit that makes a loop endless (the agent's own test runner stops
    # each test after 1 s, the grader has no per-test limit) holds its RL step for seconds, not the cap.
    jobs: list[str] = _list("model=tiny_demo", "++rollout.prefill_mode=ced", "++rollout.max_turns=5",
                            "++rollout.max_new_tokens=48")
    # env.max_concurrent covers every episode admission control lets run at once ((lag + 1) x groups_per_step x
    # group_size = 32), so all of them decode in one batch instead of waiting for a sandbox slot
    train: list[str] = _list("++trainer.simulate_replay=true", "++trainer.optim.compile_muon=false",
                             "++env.max_concurrent=32")
    # flashpost-eval overrides beyond samples=k=eval_samples: greedy episodes (pass@1 is then one episode
    # per task; the RL job samples at its own temperature), all of an evaluation's episodes in one batch,
    # 16 sandboxes at a time
    eval: list[str] = _list("++rollout.temperature=0.0", "++env.max_concurrent=16")
    # the seeded initialisation's evaluation: it never emits a parsed tool call, so every turn runs to
    # max_new_tokens; 2 turns measure its pass@1 at half the cost of 4
    eval_base: list[str] = _list("++rollout.max_turns=2")
    # SFT on the demonstrations of every train task (families A and the sample repository's): the learner
    # alone on both cores; 2048-token rows (a family demonstration is ~630 tokens, the sample repository's
    # up to ~1700: three family ones share a row; the attention and indexer cost is quadratic in the row,
    # 4 demonstrations in a 4096 row took 8.3 s a step against 5.1 in four 1024 rows); embedding and head at the
    # matrices' pace (sinkhorn_lr), warm-up then cosine decay; the DSpark drafter stays frozen (its term
    # slowed the policy's loss; rollouts switch speculation off where it does not pay)
    sft: list[str] = _list("trainer=sft", "++trainer.batch_size=6", "++trainer.threads=2",
                           "++trainer.micro_batch_tokens=2048", "++trainer.dspark_weight=0",
                           "++trainer.checkpoint_every=20", "++trainer.optim.lr=2e-3", "++trainer.optim.muon_lr=0.02",
                           "++trainer.optim.sinkhorn_lr=2e-3", "++trainer.optim.schedule=cosine",
                           "++trainer.optim.warmup_steps=5")
    # RL from the SFT policy on family B (tests only), DEMO_NOTES' recipe: T = 0.7 with log-probs at T,
    # groups of 8, zero-spread groups skipped (rl/advantages.py), lag 1
    rl: list[str] = _list("trainer=rl", "++trainer.checkpoint_every=4",
                          "++task_filter.families=[B]", "++rollout.temperature=0.7", "++rollout.group_size=8",
                          "++rollout.groups_per_step=2", "++rollout.max_policy_lag=1", "++trainer.optim.lr=1e-4",
                          "++trainer.optim.muon_lr=2e-3")
    # the student: the policy at half width (same vocabulary, so OPD compares whole distributions)
    student: list[str] = _list("++model.overrides.dim=64", "++model.overrides.moe_inter_dim=64")
    # the student's SFT at six times the policy's rates: over its short cosine schedule the policy's rates left
    # its loss at 5.64 after 20 steps, these at 0.44 (40 steps: 0.13-0.16, the episode's format learned; the
    # edit's arguments still constant, as the policy's are before ~100 steps; docs/demo_measurements.md)
    student_sft: list[str] = _list("trainer=sft", "++trainer.batch_size=6", "++trainer.threads=2",
                                   "++trainer.micro_batch_tokens=2048", "++trainer.dspark_weight=0",
                                   "++trainer.checkpoint_every=20", "++trainer.optim.lr=1.2e-2",
                                   "++trainer.optim.muon_lr=0.12", "++trainer.optim.sinkhorn_lr=1.2e-2",
                                   "++trainer.optim.schedule=cosine", "++trainer.optim.warmup_steps=5")
    # OPD continues from the SFT-only student towards the RL'd policy (the teacher: `teacher_model`)
    opd: list[str] = _list("trainer=opd", "++trainer.checkpoint_every=4",
                           "++rollout.group_size=2", "++rollout.groups_per_step=4", "++rollout.temperature=1.0",
                           "++trainer.optim.lr=1e-4", "++trainer.optim.muon_lr=0.01")
    teacher_model: str = "tiny_demo"  # conf/model/ option of the teacher (the policy RL trained)
    until: str = ""  # stop after this stage (a name of rl/demo.py Demo.stages; the report covers what ran)

    def __post_init__(self) -> None:
        steps = (self.sft_steps, self.rl_steps, self.student_sft_steps, self.opd_steps, self.eval_samples)
        if min(steps) < 1:
            raise ValueError(f"demo: sft_steps, rl_steps, student_sft_steps, opd_steps and eval_samples must be >= 1, "
                             f"got {steps}")
        if self.factory_budget < 0 or self.families_budget < 2 or self.families_heldout < 1:
            raise ValueError(f"demo.factory_budget={self.factory_budget} must be >= 0 (0: no sample repository) and "
                             f"demo.families_budget={self.families_budget} >= 2 (family B gets half), "
                             f"demo.families_heldout={self.families_heldout} >= 1")
