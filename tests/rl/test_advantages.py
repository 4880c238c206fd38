"""Group-relative advantages: GRPO/RLOO values, infra-failed rollouts excluded, zero-spread groups."""

from __future__ import annotations

import pytest
import torch

from rl.advantages import ADVANTAGE_FNS, grpo_advantages, rloo_advantages

torch.set_num_threads(1)


def test_grpo_normalises_within_each_group():
    rewards = [1.0, 0.0, 0.0, 1.0, 0.5, 0.2, 0.9, 0.2]
    groups = ["a"] * 4 + ["b"] * 4
    adv = grpo_advantages(rewards, groups, [False] * 8, eps=0.0)
    for lo in (0, 4):
        r = torch.tensor(rewards[lo : lo + 4])
        torch.testing.assert_close(adv.values[lo : lo + 4], (r - r.mean()) / r.std(unbiased=False))
    assert adv.keep.all() and adv.zero_spread_groups == []


def test_infra_failed_rollouts_are_excluded_from_group_statistics():
    rewards = [1.0, 0.0, 1.0, 0.0, 123.0]  # the crashed rollout's "reward" must not matter
    failed = [False, False, False, False, True]
    adv = grpo_advantages(rewards, ["g"] * 5, failed, eps=1e-6)
    ref = grpo_advantages(rewards[:4], ["g"] * 4, failed[:4], eps=1e-6)
    torch.testing.assert_close(adv.values[:4], ref.values)
    assert adv.values[4] == 0 and not adv.keep[4]
    # scoring it 0 instead would have moved every other advantage
    as_zero = grpo_advantages([1.0, 0.0, 1.0, 0.0, 0.0], ["g"] * 5, [False] * 5)
    assert not torch.allclose(as_zero.values[:4], adv.values[:4])


def test_zero_spread_groups_get_zero_and_are_reported():
    adv = grpo_advantages([1.0, 1.0, 1.0, 0.0, 1.0, 0.3], ["a", "a", "a", "b", "b", "c"], [False] * 6)
    assert adv.zero_spread_groups == ["a", "c"]  # "c" has a single member: no baseline
    assert adv.values[:3].eq(0).all() and not adv.keep[:3].any() and not adv.keep[5]
    assert adv.keep[3:5].all()
    # a group whose only spread came from a failed rollout has no signal either
    adv = grpo_advantages([1.0, 1.0, 0.0], ["a"] * 3, [False, False, True])
    assert adv.zero_spread_groups == ["a"] and adv.values.eq(0).all()


def test_rloo_is_leave_one_out():
    r = [1.0, 0.0, 0.5, 2.0]
    adv = rloo_advantages(r, ["g"] * 4, [False] * 4)
    expected = [r[i] - (sum(r) - r[i]) / 3 for i in range(4)]
    torch.testing.assert_close(adv.values, torch.tensor(expected))


def test_dispatch_dict_and_length_check():
    assert ADVANTAGE_FNS["grpo"] is grpo_advantages and ADVANTAGE_FNS["rloo"] is rloo_advantages
    with pytest.raises(ValueError):
        grpo_advantages([1.0, 0.0], ["a"], [False, False])
