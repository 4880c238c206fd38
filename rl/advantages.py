"""Group-relative advantage estimators (GRPO, RLOO) over one batch of scalar rewards.

Rollouts that failed for infrastructure reasons are excluded from their group's statistics and get
advantage 0 and `keep=False`, so the trainer drops them rather than scoring them 0. Groups whose
valid rewards have zero spread carry no signal: their advantages are 0 and they are reported.
Not here: per-token shaping (the learner broadcasts a trajectory's advantage to its tokens).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class Advantages:
    """values fp32 [N] (0 for dropped rollouts); keep bool [N] (False: infra-failed or in a
    zero-spread group, so the trainer may skip them); zero_spread_groups: group ids with no signal."""

    values: torch.Tensor
    keep: torch.Tensor
    zero_spread_groups: list[str]


def _group_index(group_ids: list[str]) -> dict[str, list[int]]:
    groups: dict[str, list[int]] = {}
    for i, g in enumerate(group_ids):
        groups.setdefault(g, []).append(i)
    return groups


def _estimate(
    rewards: torch.Tensor,
    group_ids: list[str],
    infra_failed: torch.Tensor,
    per_group: Callable[[torch.Tensor], torch.Tensor],
    min_valid: int,
) -> Advantages:
    rewards = torch.as_tensor(rewards, dtype=torch.float32)
    failed = torch.as_tensor(infra_failed, dtype=torch.bool)
    if not (len(rewards) == len(group_ids) == len(failed)):
        raise ValueError(f"rewards {len(rewards)}, group_ids {len(group_ids)}, infra_failed {len(failed)} differ")
    values = torch.zeros_like(rewards)
    keep = torch.zeros_like(failed)
    zero_spread = []
    for g, idx in _group_index(group_ids).items():
        valid = [i for i in idx if not failed[i]]
        r = rewards[valid]
        if len(valid) < min_valid or bool((r == r[0]).all()):
            zero_spread.append(g)
            continue
        values[valid] = per_group(r)
        keep[valid] = True
    return Advantages(values, keep, zero_spread)


def grpo_advantages(
    rewards: torch.Tensor | list[float],
    group_ids: list[str],
    infra_failed: torch.Tensor | list[bool],
    eps: float = 1e-6,
) -> Advantages:
    """GRPO: A_i = (R_i − mean_g) / (std_g + eps) over the valid (not infra-failed) members of group g;
    std is the population std (ddof 0)."""
    return _estimate(
        rewards, group_ids, infra_failed, lambda r: (r - r.mean()) / (r.std(unbiased=False) + eps), min_valid=2
    )


def rloo_advantages(
    rewards: torch.Tensor | list[float],
    group_ids: list[str],
    infra_failed: torch.Tensor | list[bool],
    eps: float = 1e-6,
) -> Advantages:
    """RLOO: A_i = R_i − mean of the other valid members of its group (leave-one-out baseline)."""
    return _estimate(rewards, group_ids, infra_failed, lambda r: (r - r.mean()) * len(r) / (len(r) - 1), min_valid=2)


ADVANTAGE_FNS: dict[str, Callable[..., Advantages]] = {
    "grpo": grpo_advantages,
    "rloo": rloo_advantages,
}
