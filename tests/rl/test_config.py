"""Every combination of conf/ groups composes and converts to the typed config tree."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from rl.config import FactoryJobConfig, JobConfig, register_schemas, to_factory_config, to_job_config

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


def test_demo_follows_model_and_seed_and_types_its_budgets():
    """experiment=demo: the demo policy is `model:` (swappable), its seed trainer.seed, every DemoConfig
    field is overridable and type-checked; a flavor sized for the released tokenizer is fitted to the
    shipped one (rl.demo_learning.demo_args)."""
    from hydra.errors import ConfigCompositionException

    from model.config import get_flavor
    from rl.demo_config import DemoConfig
    from rl.demo_learning import demo_args

    job = to_job_config(_compose("train", ["experiment=demo"]))
    demo = job.demo
    assert (job.entry, demo.flavor, demo.overrides, demo.seed) == ("demo", "tiny", {"n_layers": 4, "hc_mult": 2}, 0)
    assert job.demo.rl == DemoConfig().rl and job.demo.device == "auto"  # DemoConfig's defaults, not repeated in YAML
    overrides = ["experiment=demo", "model=small", "trainer.seed=3", "demo.rl.seconds=5", "demo.device=cpu"]
    job = to_job_config(_compose("train", overrides))
    assert (job.demo.flavor, job.demo.overrides, job.demo.seed, job.demo.rl.seconds) == ("small", {}, 3, 5.0)
    args = demo_args(job.demo.flavor, job.demo.overrides)
    assert args.dim == get_flavor("small").dim and args.vocab_size == get_flavor("tiny").vocab_size
    assert demo_args(job.demo.flavor, job.demo.overrides, shrink=2).dim == args.dim // 2
    with pytest.raises(ConfigCompositionException, match="demo.rl.seconds"):  # typed at composition
        _compose("train", ["experiment=demo", "demo.rl.seconds=soon"])
    with pytest.raises(ValueError, match="demo.device"):
        to_job_config(_compose("train", ["experiment=demo", "demo.device=tpu"]))


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
