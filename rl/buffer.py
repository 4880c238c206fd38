"""Bounded trajectory buffer between rollout workers and the learner, with AReaL-style admission control.

A rollout may start only while `(max_policy_lag + v_current + 1)·B − N_started > 0` (B: trajectories
per update, N_started: rollouts ever started). `get_batch` hands out the oldest trajectories first
in start order and waits (returns None) for older in-flight rollouts, so no trained token lags more
than `max_policy_lag` versions (proof in `get_batch`); nothing is discarded for age.
`state_dict` holds in-flight and buffered rollouts so a resume neither drops nor replays a sample.
An item is one `Trajectory` or one `TrajectoryGroup` (the RL driver admits and trains whole GRPO groups).
Not here: Ray queues, sampling, advantages.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from rl.payloads import Trajectory, TrajectoryGroup

Item = Trajectory | TrajectoryGroup


def _item_to_json(item: Item) -> dict[str, Any]:
    return {"group": item.to_json()} if isinstance(item, TrajectoryGroup) else item.to_json()


def _item_from_json(d: dict[str, Any]) -> Item:
    return TrajectoryGroup.from_json(d["group"]) if "group" in d else Trajectory.from_json(d)


@dataclass
class InFlight:
    """A started, unfinished rollout: the policy version it started under and the caller's replay info
    (task id, seed, ...), enough to restart it after a resume."""

    start_version: int
    meta: dict[str, Any] = field(default_factory=dict)


class TrajectoryBuffer:
    """Admission-controlled buffer. Not thread-safe: one owner (the driver or a buffer actor)."""

    def __init__(self, batch_size: int, max_policy_lag: int, capacity: int | None = None):
        if batch_size < 1 or max_policy_lag < 0:
            raise ValueError(f"batch_size={batch_size} must be >= 1 and max_policy_lag={max_policy_lag} >= 0")
        self.batch_size = batch_size
        self.max_policy_lag = max_policy_lag
        self.capacity = capacity if capacity is not None else (max_policy_lag + 2) * batch_size
        self.n_started = 0
        self.n_consumed = 0
        self.in_flight: dict[str, InFlight] = {}
        self.ready: list[tuple[int, str, Item]] = []  # (start_version, key, trajectory)
        self.lag_histogram: Counter[int] = Counter()

    # ------------------------------------------------------------------ producer side
    def can_start(self, v_current: int) -> bool:
        """AReaL's rule (plus the hard capacity bound)."""
        admitted = (self.max_policy_lag + v_current + 1) * self.batch_size - self.n_started > 0
        return admitted and len(self.in_flight) + len(self.ready) < self.capacity

    def on_started(self, key: str, v_current: int, meta: dict[str, Any] | None = None) -> None:
        """Record that rollout `key` started sampling under policy version v_current."""
        if key in self.in_flight:
            raise KeyError(f"rollout {key!r} is already in flight")
        if not self.can_start(v_current):
            raise RuntimeError(f"admission control refuses a new rollout at version {v_current}")
        self.in_flight[key] = InFlight(v_current, dict(meta or {}))
        self.n_started += 1

    def put(self, key: str, traj: Item) -> None:
        """A finished rollout (also infra-failed ones: the advantage step excludes them)."""
        if key not in self.in_flight:
            raise KeyError(f"rollout {key!r} was never started (or was already put)")
        start = self.in_flight.pop(key).start_version
        if 0 <= traj.oldest_version < start:
            raise ValueError(f"rollout {key!r} has a token of version {traj.oldest_version} < its start {start}")
        self.ready.append((start, key, traj))

    # ------------------------------------------------------------------ consumer side
    def get_batch(self, n: int, v_current: int) -> list[Item] | None:
        """n trajectories for the update that trains policy version v_current, or None (wait).

        Batches are taken in order of start version, then key (equal versions are interchangeable): the n
        oldest ready rollouts, and only once no in-flight rollout started earlier than the newest of
        them. With admission control this bounds the lag: a batch item started at s < v_current − L
        would need v_current·B + 1 rollouts started at versions <= s, but the rule admits at most
        (L + s + 1)·B <= v_current·B of them. Waiting never deadlocks: the rollouts waited for finish.
        """
        if len(self.ready) < n:
            return None
        # equal start versions are interchangeable for the lag bound; ordering them by key makes the
        # batch (and its packing, hence the loss to the last bit) independent of finishing order
        order = sorted(range(len(self.ready)), key=lambda i: (self.ready[i][0], self.ready[i][1]))
        take = order[:n]
        newest = self.ready[take[-1]][0]
        if any(f.start_version < newest for f in self.in_flight.values()):
            return None
        lags = [v_current - self.ready[i][0] for i in take]
        if max(lags) > self.max_policy_lag:  # only if the caller skipped versions or bypassed can_start
            raise RuntimeError(f"batch would lag {max(lags)} > max_policy_lag={self.max_policy_lag}")
        chosen = set(take)
        batch = [self.ready[i][2] for i in take]
        self.ready = [r for i, r in enumerate(self.ready) if i not in chosen]
        self.n_consumed += n
        for t in batch:
            self.lag_histogram[v_current - t.oldest_version if t.oldest_version >= 0 else 0] += 1
        return batch

    # ------------------------------------------------------------------ checkpointing
    def pending_restarts(self) -> dict[str, InFlight]:
        """In-flight rollouts to resubmit after a resume (same key and meta; not counted again)."""
        return dict(self.in_flight)

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable, lossless."""
        return {
            "batch_size": self.batch_size,
            "max_policy_lag": self.max_policy_lag,
            "capacity": self.capacity,
            "n_started": self.n_started,
            "n_consumed": self.n_consumed,
            "in_flight": {k: {"start_version": f.start_version, "meta": f.meta} for k, f in self.in_flight.items()},
            "ready": [[v, k, _item_to_json(t)] for v, k, t in self.ready],
            "lag_histogram": {str(k): v for k, v in self.lag_histogram.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.batch_size, self.max_policy_lag = state["batch_size"], state["max_policy_lag"]
        self.capacity = state["capacity"]
        self.n_started, self.n_consumed = state["n_started"], state["n_consumed"]
        self.in_flight = {k: InFlight(v["start_version"], dict(v["meta"])) for k, v in state["in_flight"].items()}
        self.ready = [(v, k, _item_from_json(t)) for v, k, t in state["ready"]]
        self.lag_histogram = Counter({int(k): v for k, v in state["lag_histogram"].items()})
