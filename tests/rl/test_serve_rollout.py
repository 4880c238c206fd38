"""An RL run whose episodes come from the external agent loop (rl/agent_loop.py) through flashpost-serve:
rollout.agent=server on real Ray actors and a real DeepSpeed learner (debug model, toy family, CPU). The
trained trajectories are the server's session records, and the learner's weights reach the server by
version."""

from __future__ import annotations

import pytest

from rl.cluster import ClusterConfig, shutdown, start_or_join
from rl.config import JobConfig, ModelChoice, OptimConfig, RolloutConfig, TrainerConfig
from rl.rl_loop import AsyncDriver, Hooks
from synth.taskset_sources import toy_set

pytestmark = pytest.mark.ray

DEBUG = ModelChoice(flavor="debug", overrides={"vocab_size": 4096, "engram_compressed_vocab_size": 2742,
                                               "max_seq_len": 256})  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def ray_local():
    handle = start_or_join(ClusterConfig(num_cpus=4, include_dashboard=False), quiet=True)
    yield handle
    shutdown(handle)


def test_rl_steps_train_on_episodes_played_through_the_server(tmp_path):
    import ray

    optim = OptimConfig(lr=1e-3, sinkhorn_lr=1e-3, muon_lr=1e-2)
    job = JobConfig(
        model=DEBUG, tasks=str(toy_set(4, 2, heldout_share=0.0)),
        trainer=TrainerConfig(kind="rl", max_steps=2, micro_batch_tokens=256, global_batch_tokens=256,
                              checkpoint_every=10, optim=optim),
        rollout=RolloutConfig(agent="server", n_workers=1, group_size=3, groups_per_step=2, max_policy_lag=0,
                              max_new_tokens=6, max_turns=2, temperature=1.0),
    )  # fmt: skip
    seen = {}

    def on_step(version: int, driver: AsyncDriver) -> None:
        seen[version] = ray.get(driver.workers[0].stats.remote())

    driver = AsyncDriver(job, tmp_path, hooks=Hooks(on_step=on_step), progress=False)
    try:
        history = driver.run()
    finally:
        driver.close()
    assert [int(r["step"]) for r in history] == [1, 2]
    assert len(driver.trained) == 2 * 2
    assert all(s["version"] == v for v, s in seen.items()), "the server got each new version"
    assert seen[2]["tokens_generated"] > seen[1]["tokens_generated"] > 0
    assert all(r["policy_lag_max"] == 0 for r in history)
