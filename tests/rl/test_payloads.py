"""Trajectory validation and JSON round trip; the first-fit packer never splits documents."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from rl.payloads import Trajectory, pack_trajectories

torch.set_num_threads(1)


def _traj(n_prompt: int, n_gen: int, seed: int = 0, version: int = 0) -> Trajectory:
    rng = random.Random(seed)
    T = n_prompt + n_gen
    return Trajectory(
        token_ids=[rng.randrange(1, 500) for _ in range(T)],
        loss_mask=[False] * n_prompt + [True] * n_gen,
        logprobs=[math.nan] * n_prompt + [-rng.random() for _ in range(n_gen)],
        versions=[-1] * n_prompt + [version] * n_gen,
        turn_starts=[n_prompt],
        reward=rng.random(),
        verifier={"passed": ["t1"]},
        task_id=f"task{seed}",
        group_id=f"g{seed % 3}",
        seed=seed,
        timings={"gen_s": 0.5},
    )


def test_validation_rejects_inconsistent_records():
    with pytest.raises(ValueError, match="logprobs"):
        Trajectory(token_ids=[1, 2], loss_mask=[False, True], logprobs=[math.nan], versions=[-1, 0], turn_starts=[1])
    with pytest.raises(ValueError, match="lacks a rollout log-prob"):
        Trajectory(
            token_ids=[1, 2], loss_mask=[False, True], logprobs=[math.nan, math.nan], versions=[-1, 0], turn_starts=[1]
        )
    with pytest.raises(ValueError, match="increase"):
        Trajectory(
            token_ids=[1, 2, 3], loss_mask=[False, True, True], logprobs=[math.nan, -1, -1], versions=[-1, 0, 0],
            turn_starts=[2, 1],
        )  # fmt: skip


def test_json_round_trip_keeps_nan_and_fields():
    t = _traj(5, 7, seed=3, version=4)
    back = Trajectory.from_json(json.loads(json.dumps(t.to_json())))
    assert back.token_ids == t.token_ids and back.versions == t.versions and back.verifier == t.verifier
    assert all((math.isnan(a) and math.isnan(b)) or a == b for a, b in zip(back.logprobs, t.logprobs))
    assert back.oldest_version == 4 and back.n_generated == 7


def test_packer_never_splits_documents_and_resets_doc_ids():
    rng = random.Random(0)
    trajs = [_traj(rng.randint(1, 10), rng.randint(1, 20), seed=i) for i in range(40)]
    adv = [float(i) for i in range(40)]
    batches = pack_trajectories(trajs, max_tokens=48, advantages=adv, rows_per_batch=3)
    seen = []
    for b in batches:
        assert b.input_ids.shape[1] == 48
        for row, members in enumerate(b.traj_index):
            docs = b.doc_ids[row]
            pos = 0
            for d, i in enumerate(members):
                n = len(trajs[i])
                assert docs[pos : pos + n].eq(d).all(), "a document's doc_id must be constant over it"
                assert b.input_ids[row, pos : pos + n].tolist() == trajs[i].token_ids, "document split or altered"
                assert b.loss_mask[row, pos : pos + n].tolist() == trajs[i].loss_mask
                assert b.advantages[row, pos : pos + n][b.loss_mask[row, pos : pos + n]].eq(adv[i]).all()
                pos += n
            assert docs[pos:].eq(-1).all(), "padding carries doc_id -1"
            assert docs[0] == 0 if members else True, "doc_ids restart at 0 on every row"
            seen += members
    assert sorted(seen) == list(range(40)), "every trajectory is packed exactly once"
    assert not torch.isnan(torch.cat([b.logprobs for b in batches])).any()


def test_packer_is_first_fit_and_rejects_oversized():
    trajs = [_traj(2, 8, 0), _traj(2, 20, 1), _traj(2, 4, 2)]  # 10, 22, 6 tokens into rows of 24
    (batch,) = pack_trajectories(trajs, max_tokens=24, rows_per_batch=4)
    assert batch.traj_index == [[0, 2], [1]]
    with pytest.raises(ValueError, match="max_tokens"):
        pack_trajectories([_traj(2, 30)], max_tokens=16)
