"""Every combination of conf/ groups composes and converts to the typed config tree."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from rl.config import (
    FactoryJobConfig,
    JobConfig,
    register_schemas,
    to_eval_config,
    to_factory_config,
    to_job_config,
)

CONF = Path(__file__).resolve().parents[2] / "conf"
register_schemas()  # as the entry point does (rl/train.py)


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def _compose(name: str, overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name=name, overrides=overrides, return_hydra_config=False)


def test_groups_exist():
    for group in ("model", "trainer", "rollout", "env", "cluster", "synth", "experiment"):
        assert _options(group), f"conf/{group}/ has no options"


@pytest.mark.parametrize(
    "model,trainer,env,cluster",
    list(itertools.product(_options("model"), _options("trainer"), _options("env"), _options("cluster"))),
)
def test_train_combination_converts(model, trainer, env, cluster):
    cfg = _compose("train", [f"model={model}", f"trainer={trainer}", f"env={env}", f"cluster={cluster}"])
    job = to_job_config(cfg)
    assert isinstance(job, JobConfig)
    assert job.model.flavor == OmegaConf.load(CONF / "model" / f"{model}.yaml").flavor and job.trainer.kind == trainer


@pytest.mark.parametrize("experiment", _options("experiment"))
def test_experiments_convert(experiment):
    job = to_job_config(_compose("train", [f"experiment={experiment}"]))
    assert isinstance(job, JobConfig)


def test_demo_is_typed_and_its_jobs_compose():
    """experiment=demo: its seed is trainer.seed, DemoConfig's fields are typed on the command line, and
    every job it runs composes from the job's own primary config into a valid typed config: the demo's
    policy (an encoder/decoder split with a Reindex layer, QAT, Engram, DSpark, CED prefill with its
    simulation in training), the half-width student and OPD's teacher of the policy's architecture."""
    from hydra.errors import ConfigCompositionException

    from model.ced import check_ced
    from rl.demo import compose as job_config
    from rl.demo_config import DemoConfig

    job = to_job_config(_compose("train", ["experiment=demo", "trainer.seed=3", "demo.rl_steps=5"]))
    assert (job.entry, job.demo.seed, job.demo.rl_steps, job.demo.sft) == ("demo", 3, 5, DemoConfig().sft)
    with pytest.raises(ConfigCompositionException, match="demo.rl_steps"):  # typed at composition
        _compose("train", ["experiment=demo", "demo.rl_steps=soon"])
    d = DemoConfig()
    policy = to_job_config(job_config("train", [*d.jobs, *d.train, *d.rl]))
    assert (policy.trainer.kind, policy.rollout.prefill_mode, policy.trainer.simulate_replay) == ("rl", "ced", True)
    assert policy.task_filter.families == ["B"] and policy.rollout.temperature == 0.7
    args = policy.model.build_args()
    check_ced(args)
    roles = [r["role"] for r in args.role_table()[: args.n_layers]]
    assert "reindex" in roles[args.n_encoder_layers :] and args.qat and args.engram_layer_ids and args.dspark_enabled
    assert args.window_size < 1000  # the decoder's bounded replay is shorter than an episode's ~1100-token prompt
    opd = to_job_config(job_config("train", [*d.jobs, *d.train, *d.student, *d.opd,
                                          f"+model@trainer.teacher_model={d.teacher_model}"]))  # fmt: skip
    assert opd.trainer.kind == "opd" and opd.model.build_args().dim == args.dim // 2
    assert opd.trainer.teacher_model.build_args().dim == args.dim
    ev = to_eval_config(job_config("eval", [*d.jobs, *d.eval]))
    assert ev.model == policy.model and ev.rollout.prefill_mode == "ced"
    sft = to_job_config(job_config("train", [*d.jobs, *d.train, *d.sft, "++trainer.max_steps=30"]))
    # the SFT learner alone on both cores, one demonstration a row, cosine decay over the job's own steps
    assert (sft.trainer.threads, sft.trainer.micro_batch_tokens, sft.trainer.dspark_weight) == (2, 2048, 0.0)
    assert (sft.trainer.optim.schedule, sft.trainer.optim.decay_steps) == ("cosine", 30)


def test_trainer_threads_and_schedule_are_checked():
    from rl.config import OptimConfig, TrainerConfig

    with pytest.raises(ValueError, match="trainer.threads=0"):
        TrainerConfig(threads=0)
    with pytest.raises(ValueError, match="trainer.optim.schedule"):
        OptimConfig(schedule="linear")
    assert JobConfig(trainer=TrainerConfig(max_steps=12)).trainer.optim.decay_steps == 12
    assert JobConfig(trainer=TrainerConfig(optim=OptimConfig(decay_steps=5))).trainer.optim.decay_steps == 5


def test_factory_converts():
    assert isinstance(to_factory_config(_compose("factory", [])), FactoryJobConfig)


def test_unknown_key_is_rejected_with_its_name():
    cfg = _compose("train", [])
    OmegaConf.set_struct(cfg, False)
    cfg.trainer.learning_rate = 1.0
    with pytest.raises(Exception, match="learning_rate"):
        to_job_config(cfg)


def test_bad_choice_names_the_field():
    cfg = _compose("train", ["trainer.kind=ppo"])
    with pytest.raises(ValueError, match="trainer.kind"):
        to_job_config(cfg)


def test_model_flavors_build_args():
    pytest.importorskip("model.config")
    for flavor in _options("model"):
        job = to_job_config(_compose("train", [f"model={flavor}"]))
        args = job.model.build_args()
        assert args.n_layers > 0
    job = to_job_config(_compose("train", ["model=debug", "+model.overrides.not_a_field=3"]))
    with pytest.raises(ValueError, match="not_a_field"):
        job.model.build_args()


@pytest.mark.parametrize("flavor", ["tiny", "tiny_demo", "small"])
def test_trainable_flavors_fit_the_default_tokenizer(flavor):
    """The jobs tokenize with the shipped default tokenizer: these flavors' Engram hashers accept it (a
    flavor sized for the released tokenizer is refused, compressed vocab 2742 != 99092)."""
    from model.engram import EngramHasher
    from model.tokenizer import Tokenizer

    args = to_job_config(_compose("train", [f"model={flavor}"])).model.build_args()
    tokenizer = Tokenizer.default()
    assert args.vocab_size >= tokenizer.vocab_size
    EngramHasher(args, tokenizer)


@pytest.mark.parametrize("trainer", ["sft", "rl", "opd", "dspark"])
def test_installed_entry_point_runs_outside_the_repository(tmp_path, trainer):
    # The console script imports rl.train as a module; its config path must not depend on the cwd.
    import shutil
    import subprocess
    import sys

    exe = shutil.which("flashpost-train", path=str(Path(sys.executable).parent))
    assert exe, "flashpost-train is not installed next to this interpreter"
    proc = subprocess.run([exe, f"trainer={trainer}", "dry_run=true"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "configuration is valid" in proc.stdout
    assert f"kind: {trainer}" in proc.stdout


def test_policy_loss_temperature_follows_the_rollout():
    """The learner's log-probs are taken at the temperature the rollout sampled at: unset, it is filled
    from rollout.temperature; set to another value for trainer=rl, it is refused with both names."""
    from rl.config import PolicyLossConfig, RolloutConfig, TrainerConfig

    job = JobConfig(trainer=TrainerConfig(kind="rl"), rollout=RolloutConfig(temperature=0.7))
    assert job.trainer.policy_loss.temperature == 0.7
    with pytest.raises(ValueError, match="rollout.temperature"):
        JobConfig(
            trainer=TrainerConfig(kind="rl", policy_loss=PolicyLossConfig(temperature=1.0)),
            rollout=RolloutConfig(temperature=0.7),
        )


def test_learner_logprob_temperature_matches_the_sampler():
    """token_logprobs at the rollout temperature == log q of model/sampling at that temperature."""
    import torch

    from model.sampling import sampling_logprobs
    from rl.losses import at_temperature, token_logprobs

    logits = torch.randn(1, 6, 50, generator=torch.Generator().manual_seed(0)) * 3
    ids = torch.randint(0, 50, (1, 6), generator=torch.Generator().manual_seed(1))
    got = token_logprobs(at_temperature(logits, 0.7), ids)[0, 1:]
    want = sampling_logprobs(logits[0, :-1], 0.7).gather(-1, ids[0, 1:, None]).squeeze(-1)
    torch.testing.assert_close(got, want)
    assert not torch.allclose(got, token_logprobs(logits, ids)[0, 1:])  # T = 1 would differ


def test_actor_cpus_fit_every_actor_of_a_job_on_a_small_cluster():
    from rl.rl_loop import actor_cpus

    assert actor_cpus(3, 16.0) == 1.0
    # learner + rollout worker + OPD teacher on 2 cores: each gets 2/3, so all three are scheduled
    assert actor_cpus(3, 2.0) * 3 <= 2.0 and actor_cpus(3, 2.0) > 0.5
