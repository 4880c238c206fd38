"""Starting a learner from trained weights (debug model, CPU, no Ray): `LearnerActor(init_checkpoint=...)`,
which `AsyncDriver(init_checkpoint=...)` passes on, publishes exactly the checkpoint's weights as
version 0 instead of the seeded initialisation (RL after an SFT or DSpark run)."""

from __future__ import annotations

import torch

from model.checkpoint import save_checkpoint
from rl.actors import LearnerActor, build_model
from rl.config import ModelChoice, OptimConfig, TrainerConfig

DEBUG = ModelChoice(flavor="debug", overrides={"vocab_size": 4096, "engram_compressed_vocab_size": 2742,
                                               "max_seq_len": 256})  # fmt: skip


def test_learner_starts_from_the_init_checkpoint(tmp_path):
    trained, _ = build_model(DEBUG, seed=3)
    path = tmp_path / "model.safetensors"
    save_checkpoint(trained, path, args=trained.args)
    cfg = TrainerConfig(kind="rl", micro_batch_tokens=256, global_batch_tokens=256, optim=OptimConfig(lr=1e-3))
    version, weights = LearnerActor(DEBUG, cfg, init_seed=0, init_checkpoint=str(path)).get_weights()
    assert version == 0
    expected = trained.state_dict()
    assert weights.keys() == expected.keys()
    assert all(torch.equal(weights[k], expected[k]) for k in expected)
    seeded, _ = build_model(DEBUG, seed=0)
    assert not all(torch.equal(weights[k], v) for k, v in seeded.state_dict().items())
