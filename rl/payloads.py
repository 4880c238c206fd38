"""Typed payloads from rollout to learner: `Trajectory` (one sampled conversation) and `TrainBatch`
(packed rows the learner consumes), the first-fit packer, and JSON (de)serialisation for checkpoints.

Token-in/token-out: `Trajectory.token_ids` is exactly what the engine consumed and produced, never a
re-tokenisation of text. Not here: sampling, grading, advantages (rl/advantages.py), losses.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch


@dataclass(kw_only=True)
class Trajectory:
    """One rollout, all lists of length T = len(token_ids) unless noted.

    token_ids       list[int] [T]    prompt + every generation + tool observations, in order
    loss_mask       list[bool] [T]   True on tokens the policy generated (assistant tokens)
    logprobs        list[float] [T]  rollout (behaviour μ) log-prob of each token; NaN where not generated
    versions        list[int] [T]    policy version that produced each token; -1 where not generated
    turn_starts     list[int]        prompt end N_k of each generation turn k (strictly increasing, < T)
    reward          float            scalar reward from the verifier (ignored when infra_failed)
    verifier        dict             the verifier's report (JSON-serialisable)
    task_id, group_id               group_id identifies the GRPO group (same prompt, several samples)
    infra_failed    bool             sandbox crash / set-up timeout: excluded from group statistics
    seed, engine_version, timings   what is needed to replay the rollout offline
    drafter_version int              version of the DSpark drafter weights loaded when the episode ended
                                     (the last weights that drafted it; -1: not drafted speculatively)
    rollout_stats   dict[str, float] what the inference path did for the episode (rl/rollout.py
                                     TokenPolicy.engine_stats: cache bytes, replay segments, prefix-cache
                                     lookups, DSpark drafts/acceptances)
    demo            bool             a demonstration (SFT data): loss-mask tokens need no log-prob/version
    transcript      list[dict]       the conversation in chat-template form (assistant turns carry their
                                     generated `token_ids`): rendering it gives token_ids back exactly
    routing         int32 [T, n_layers, K] or None: each token's MoE experts per backbone layer as the
                                     rollout engine routed it (record_routing engines, trainer.routing_replay);
                                     -1 rows: not recorded (routed afresh by the learner)
    """

    token_ids: list[int]
    loss_mask: list[bool]
    logprobs: list[float]
    versions: list[int]
    turn_starts: list[int]
    reward: float = 0.0
    verifier: dict[str, Any] = field(default_factory=dict)
    task_id: str = ""
    group_id: str = ""
    infra_failed: bool = False
    seed: int = 0
    engine_version: str = ""
    drafter_version: int = -1
    timings: dict[str, float] = field(default_factory=dict)
    rollout_stats: dict[str, float] = field(default_factory=dict)
    demo: bool = False
    transcript: list[dict[str, Any]] = field(default_factory=list)
    routing: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.validate()

    def __len__(self) -> int:
        return len(self.token_ids)

    def validate(self) -> None:
        """Raise ValueError on inconsistent lengths, NaN log-probs on generated tokens or bad turns."""
        n = len(self.token_ids)
        for name in ("loss_mask", "logprobs", "versions"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"Trajectory.{name} has {len(getattr(self, name))} entries, token_ids {n}")
        for i, (m, lp, v) in enumerate(zip(self.loss_mask, self.logprobs, self.versions)):
            if m and not self.demo and (math.isnan(lp) or v < 0):
                raise ValueError(f"generated token {i} lacks a rollout log-prob or a policy version")
        if self.routing is not None and (self.routing.dim() != 3 or self.routing.size(0) != n):
            raise ValueError(f"Trajectory.routing {tuple(self.routing.shape)} must be [{n}, n_layers, K]")
        if self.loss_mask and self.loss_mask[0]:
            raise ValueError("token 0 cannot be generated: it has no context")
        if any(b <= a for a, b in zip(self.turn_starts, self.turn_starts[1:])):
            raise ValueError(f"turn_starts must increase strictly: {self.turn_starts}")
        if self.turn_starts and not 0 < self.turn_starts[0] <= self.turn_starts[-1] < n:
            raise ValueError(f"turn_starts {self.turn_starts} out of range for {n} tokens")

    @property
    def n_generated(self) -> int:
        return sum(self.loss_mask)

    @property
    def oldest_version(self) -> int:
        """The oldest policy version among generated tokens (-1 if none were generated)."""
        gen = [v for v, m in zip(self.versions, self.loss_mask) if m]
        return min(gen) if gen else -1

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["routing"] = None if self.routing is None else self.routing.tolist()
        d["logprobs"] = [None if math.isnan(x) else x for x in self.logprobs]  # JSON has no NaN
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Trajectory:
        d = dict(d)
        d["logprobs"] = [math.nan if x is None else float(x) for x in d["logprobs"]]
        if d.get("routing") is not None:
            d["routing"] = torch.tensor(d["routing"], dtype=torch.int32)
        return cls(**d)


@dataclass(kw_only=True)
class TrajectoryGroup:
    """The samples of one prompt (a GRPO group), the unit of admission control and batching: group
    statistics need every member, so a group is trained whole or not at all. Members that failed for
    infrastructure reasons stay in the group (marked `infra_failed`) and are excluded from its statistics."""

    group_id: str
    trajectories: list[Trajectory]

    def __len__(self) -> int:
        return len(self.trajectories)

    @property
    def oldest_version(self) -> int:
        versions = [t.oldest_version for t in self.trajectories if t.oldest_version >= 0]
        return min(versions) if versions else -1

    def to_json(self) -> dict[str, Any]:
        return {"group_id": self.group_id, "trajectories": [t.to_json() for t in self.trajectories]}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> TrajectoryGroup:
        return cls(group_id=d["group_id"], trajectories=[Trajectory.from_json(t) for t in d["trajectories"]])


@dataclass(kw_only=True)
class TrainBatch:
    """Packed rows for one learner micro-batch; B rows of S tokens, padding has doc_id -1.

    input_ids      int64   [B,S]
    doc_ids        int64   [B,S]  0,1,2,.. per row (restart each row), -1 on padding
    loss_mask      bool    [B,S]  True where position t predicts input_ids[t] from t-1 (token-aligned:
                                  the log-prob of token t, produced by logits at t-1)
    logprobs       float32 [B,S]  behaviour (rollout) log-prob μ of token t; 0 where not in loss_mask
    old_logprobs   float32 [B,S]  proximal π_prox log-prob (filled by the learner before the update)
    advantages     float32 [B,S]  per-token advantage (the trajectory's, broadcast)
    versions       int64   [B,S]  policy version of token t; -1 where not generated
    traj_index     list[list[int]] which input trajectory each document of each row came from
    ref_logprobs   float32 [B,S] or None: reference-policy log-probs for the optional k3 KL term
    turn_starts    per row, per document: its trajectory's turn_starts, relative to the document start
                   (what the simulated decoder replay needs)
    routing        int32 [B,S,n_layers,K] or None: the trajectories' recorded routing, placed like their
                   tokens, -1 on padding and on trajectories without one (None: no trajectory has one)
    """

    input_ids: torch.Tensor
    doc_ids: torch.Tensor
    loss_mask: torch.Tensor
    logprobs: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    versions: torch.Tensor
    traj_index: list[list[int]]
    ref_logprobs: torch.Tensor | None = None
    turn_starts: list[list[list[int]]] | None = None
    routing: torch.Tensor | None = None

    @property
    def n_tokens(self) -> int:
        """Valid (loss) tokens: the per-micro-batch share of the global token-mean denominator."""
        return int(self.loss_mask.sum())

    def to(self, device: torch.device | str) -> TrainBatch:
        moved = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in vars(self).items()}
        return TrainBatch(**moved)


def pack_trajectories(
    trajs: list[Trajectory],
    max_tokens: int,
    advantages: list[float] | None = None,
    rows_per_batch: int = 1,
    pad_id: int = 0,
) -> list[TrainBatch]:
    """First-fit packing of whole trajectories into rows of `max_tokens` (documents never split).

    Trajectories are placed in order into the first row with room (first-fit, no sorting, so the
    order of documents inside a row is the input order). Each row restarts doc_ids at 0; rows
    are grouped `rows_per_batch` to a TrainBatch of width S = max_tokens. A trajectory longer
    than max_tokens raises ValueError (truncating would break token-in/token-out).
    """
    if advantages is not None and len(advantages) != len(trajs):
        raise ValueError(f"{len(advantages)} advantages for {len(trajs)} trajectories")
    rows: list[list[int]] = []
    room: list[int] = []
    for i, t in enumerate(trajs):
        if len(t) > max_tokens:
            raise ValueError(f"trajectory {i} has {len(t)} tokens > max_tokens={max_tokens}")
        slot = next((r for r, free in enumerate(room) if free >= len(t)), None)
        if slot is None:
            rows.append([])
            room.append(max_tokens)
            slot = len(rows) - 1
        rows[slot].append(i)
        room[slot] -= len(t)
    batches = []
    for start in range(0, len(rows), rows_per_batch):
        chunk = rows[start : start + rows_per_batch]
        batches.append(_build_batch(trajs, chunk, max_tokens, advantages, pad_id))
    return batches


def _build_batch(
    trajs: list[Trajectory], rows: list[list[int]], S: int, advantages: list[float] | None, pad_id: int
) -> TrainBatch:
    B = len(rows)
    input_ids = torch.full((B, S), pad_id, dtype=torch.long)
    doc_ids = torch.full((B, S), -1, dtype=torch.long)
    loss_mask = torch.zeros(B, S, dtype=torch.bool)
    logprobs = torch.zeros(B, S, dtype=torch.float32)
    adv = torch.zeros(B, S, dtype=torch.float32)
    versions = torch.full((B, S), -1, dtype=torch.long)
    recorded = [trajs[i].routing for members in rows for i in members if trajs[i].routing is not None]
    routing = None if not recorded else torch.full((B, S, *recorded[0].shape[1:]), -1, dtype=torch.int32)
    for b, members in enumerate(rows):
        pos = 0
        for d, i in enumerate(members):
            t, n = trajs[i], len(trajs[i])
            sl = slice(pos, pos + n)
            input_ids[b, sl] = torch.tensor(t.token_ids, dtype=torch.long)
            doc_ids[b, sl] = d
            mask = torch.tensor(t.loss_mask, dtype=torch.bool)
            loss_mask[b, sl] = mask
            lp = torch.tensor(t.logprobs, dtype=torch.float32)
            logprobs[b, sl] = torch.where(mask & ~lp.isnan(), lp, torch.zeros_like(lp))
            versions[b, sl] = torch.tensor(t.versions, dtype=torch.long)
            adv[b, sl] = (0.0 if advantages is None else advantages[i]) * mask.float()
            if routing is not None and t.routing is not None:
                routing[b, sl] = t.routing.to(torch.int32)
            pos += n
    return TrainBatch(
        input_ids=input_ids,
        doc_ids=doc_ids,
        loss_mask=loss_mask,
        logprobs=logprobs,
        old_logprobs=logprobs.clone(),
        advantages=adv,
        versions=versions,
        traj_index=rows,
        turn_starts=[[list(trajs[i].turn_starts) for i in members] for members in rows],
        routing=routing,
    )
