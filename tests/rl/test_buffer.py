"""Admission control bounds policy lag under random rollout durations; state round-trips losslessly."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from rl.buffer import TrajectoryBuffer
from rl.payloads import Trajectory

torch.set_num_threads(1)


def _finished(start_version: int, v_now: int, rng: random.Random) -> Trajectory:
    """A multi-turn rollout whose later turns may have been sampled by newer policies."""
    n = rng.randint(1, 6)
    versions = sorted(rng.randint(start_version, v_now) for _ in range(n))
    return Trajectory(
        token_ids=list(range(2 + n)),
        loss_mask=[False, False] + [True] * n,
        logprobs=[math.nan, math.nan] + [-1.0] * n,
        versions=[-1, -1] + versions,
        turn_starts=[2],
    )


def _simulate(seed: int, lag: int, batch: int, workers: int, updates: int = 60):
    rng = random.Random(seed)
    buf = TrajectoryBuffer(batch, lag)
    v, running, k, lags, ticks = 0, {}, 0, [], 0
    while v < updates:
        ticks += 1
        assert ticks < 50_000, "the learner starved: admission control or get_batch deadlocked"
        while len(running) < workers and buf.can_start(v):
            key = f"r{k}"
            k += 1
            buf.on_started(key, v)
            running[key] = [v, rng.randint(1, 15)]
        for key in list(running):
            running[key][1] -= 1
            if running[key][1] <= 0:
                buf.put(key, _finished(running.pop(key)[0], v, rng))
        got = buf.get_batch(batch, v)
        if got is not None:
            assert len(got) == batch
            lags += [v - t.oldest_version for t in got]
            v += 1
    return lags, buf


@pytest.mark.parametrize("lag", [0, 1, 2, 4])
def test_no_trained_token_lags_more_than_max_policy_lag(lag):
    for seed in range(6):
        lags, buf = _simulate(seed, lag, batch=4, workers=1 + 2 * seed)
        assert max(lags) <= lag
        assert sum(buf.lag_histogram.values()) == len(lags)
        if lag == 0:
            assert set(lags) == {0}


def test_admission_rule_is_areals():
    buf = TrajectoryBuffer(batch_size=3, max_policy_lag=1, capacity=100)
    started = 0
    while buf.can_start(0):
        buf.on_started(f"r{started}", 0)
        started += 1
    assert started == (1 + 0 + 1) * 3
    assert buf.can_start(1)  # a new version admits B more
    with pytest.raises(RuntimeError):
        buf.on_started("extra", 0)


def test_state_dict_round_trip_neither_drops_nor_replays():
    rng = random.Random(0)
    buf = TrajectoryBuffer(batch_size=2, max_policy_lag=1)
    for i in range(4):
        buf.on_started(f"r{i}", 0, meta={"task_id": f"t{i}", "seed": i})
    buf.put("r1", _finished(0, 0, rng))
    buf.put("r3", _finished(0, 0, rng))
    state = json.loads(json.dumps(buf.state_dict()))
    restored = TrajectoryBuffer(batch_size=1, max_policy_lag=0)
    restored.load_state_dict(state)
    assert restored.state_dict() == buf.state_dict()
    assert set(restored.pending_restarts()) == {"r0", "r2"}
    assert restored.pending_restarts()["r2"].meta == {"task_id": "t2", "seed": 2}
    assert not restored.can_start(0)  # restarts are not new admissions: N_started was restored
    for key in restored.pending_restarts():
        restored.put(key, _finished(0, 0, rng))
    got = restored.get_batch(2, 0) + restored.get_batch(2, 1)
    assert len(got) == 4 and restored.get_batch(1, 2) is None
    with pytest.raises(KeyError):
        restored.put("r1", _finished(0, 0, rng))  # already delivered: a replay is refused
