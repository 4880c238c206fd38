"""The asynchronous driver of trainer=rl (GRPO-family, decoupled PPO) and trainer=opd (reverse KL to a
teacher on student samples): rollout → score → update → sync → log → checkpoint, as named phases.

Dataflow (DESIGN §3.1): the prompt stream yields GRPO groups (group g: train task g mod n, group_size
samples with fixed seeds); a group starts only while the buffer's admission rule allows it at the
current policy version (max_policy_lag 0 = synchronous), runs whole on one rollout worker, and enters
the buffer whole; the learner trains on the oldest `groups_per_step` groups as soon as they are ready,
while workers keep sampling; after each update the new weights go to every worker by version through
the object store. A dead worker is replaced and its groups are re-issued (same keys, same seeds).
Checkpoints hold the learner (weights, optimiser, RNG) and this driver's state (buffer with its
in-flight groups, prompt-stream position, ledger of trained groups) in one atomic folder; a resume
re-issues the in-flight groups exactly once and trains every group exactly once.
Not here: episodes (rl/rollout.py), actors (rl/actors.py), losses (rl/losses.py).
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rl.advantages import ADVANTAGE_FNS
from rl.audit import TaskAudit
from rl.buffer import TrajectoryBuffer
from rl.config import JobConfig
from rl.payloads import Trajectory, TrajectoryGroup
from rl.rollout import RolloutRequest

MAX_GROUP_RETRIES = 3
MAX_WORKER_REPLACEMENTS = 3  # consecutive deaths of one worker slot (a result from it resets the count)


def _actor_gone() -> tuple[type[BaseException], ...]:
    """Ray's "that actor is dead" errors (imported late: Ray must not load before rl.cluster set it up)."""
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

    return (RayActorError, ActorDiedError, ActorUnavailableError)


@dataclass
class Scored:
    """The trainable part of a batch of groups: kept trajectories and their advantages."""

    trajs: list[Trajectory]
    advantages: list[float]
    stats: dict[str, float] = field(default_factory=dict)


def score_groups(groups: list[TrajectoryGroup], estimator: str, eps: float) -> Scored:
    """Group-relative advantages; infra-failed members are excluded from their group's statistics and
    from training, zero-spread groups carry no signal and are dropped."""
    trajs = [t for g in groups for t in g.trajectories]
    adv = ADVANTAGE_FNS[estimator](
        [t.reward for t in trajs], [t.group_id for t in trajs], [t.infra_failed for t in trajs], eps
    )
    valid = [t for t in trajs if not t.infra_failed]
    stats = {
        "reward_mean": sum(t.reward for t in valid) / max(len(valid), 1),
        "pass_rate": sum(bool(t.verifier.get("passed")) for t in valid) / max(len(valid), 1),
        "infra_failed": float(len(trajs) - len(valid)),
        "zero_spread_groups": float(len(adv.zero_spread_groups)),
        "trajectories": float(len(trajs)),
    }
    keep = adv.keep.tolist()
    return Scored([t for t, k in zip(trajs, keep) if k], [float(a) for a, k in zip(adv.values, keep) if k], stats)


def lag_stats(trajs: list[Trajectory], version: int) -> dict[str, float]:
    """Version lag (training version − producing version) over every generated token."""
    lags = [version - v for t in trajs for v, m in zip(t.versions, t.loss_mask) if m]
    if not lags:
        return {"policy_lag_max": 0.0, "policy_lag_mean": 0.0}
    return {"policy_lag_max": float(max(lags)), "policy_lag_mean": sum(lags) / len(lags)}


def rollout_stats(trajs: list[Trajectory], job: JobConfig) -> dict[str, float]:
    """The inference path of a rollout batch: which features were on (1/0), packed cache bytes per token,
    CED replay segments per episode, prefix-cache hit rate, DSpark acceptance overall and by (drafter
    version, policy version) as `dspark_rollout_acceptance/d<drafter>/p<oldest policy version>`, the
    fraction of decode steps that drafted and of turns that ran plain because speculation could not win
    (`dspark_rollout_off_frac`: the engine's cost model switched it off for that generate call)."""
    r = job.rollout
    out = {"feature_ced": float(r.prefill_mode == "ced"), "feature_prefix_cache": float(r.prefix_cache),
           "feature_packed_cache": float(r.live_packed(job.model.build_args().qat)),
           "feature_speculative": float(r.speculative),
           "feature_simulate_replay": float(bool(job.trainer.simulate_replay)),
           "feature_routing_replay": float(job.trainer.routing_replay)}  # fmt: skip
    started = [t for t in trajs if t.rollout_stats]
    if not started:
        return out
    total = Counter()
    by_version: dict[str, Counter] = {}
    for t in started:
        st = t.rollout_stats
        total.update(st)
        total["tokens"] += len(t)
        total["cache_bytes"] += st.get("cache_bytes_per_token", 0.0) * len(t)
        if "spec_drafted" in st:
            c = by_version.setdefault(f"dspark_rollout_acceptance/d{t.drafter_version}/p{t.oldest_version}", Counter())
            c.update(drafted=st["spec_drafted"], accepted=st["spec_accepted"])
    out["cache_bytes_per_token"] = total["cache_bytes"] / max(total["tokens"], 1)
    out["replay_segments_per_episode"] = total["replay_segments"] / len(started)
    lookups = total["prefix_global_hit"] + total["prefix_global_miss"]
    if lookups:
        out["prefix_hit_rate"] = total["prefix_global_hit"] / lookups
    if "spec_drafted" in total:
        steps = total["spec_steps"] + total["spec_plain_steps"]
        out["dspark_rollout_drafting_frac"] = total["spec_steps"] / max(steps, 1)
        # turns whose generate call ran plain: speculation switched itself off (cost model)
        turns = sum(len(t.turn_starts) for t in started)
        out["dspark_rollout_off_frac"] = total["spec_off_calls"] / max(turns, 1)
        if total["spec_drafted"]:
            out["dspark_rollout_acceptance"] = total["spec_accepted"] / total["spec_drafted"]
        out |= {k: c["accepted"] / c["drafted"] for k, c in by_version.items() if c["drafted"]}
    return out


def load_tasks(job: JobConfig, progress: bool = True) -> list[dict[str, Any]]:
    """The train split of job.tasks as episode payloads ({"task_id", "env", "task"}: rl/tasks.py)."""
    return load_train_split(job, progress)[0]


def load_train_split(job: JobConfig, progress: bool = True) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """(episode payloads of the train split, task id -> fewest turns of its verified solver runs)."""
    from rl.audit import solver_turns
    from rl.tasks import episode_tasks, read

    ts = read(job.tasks, job.task_filter, "train", progress=progress)
    return episode_tasks(ts.tasks), solver_turns(ts.demos)


def actor_cpus(n_actors: int, cluster_cpus: float) -> float:
    """Ray CPUs each of a job's n_actors asks for: one each, or an equal share when the cluster has fewer
    (learner, rollout workers and the OPD teacher on a 2-core machine), so that all of them are scheduled
    instead of the last one waiting forever for a CPU nobody frees."""
    return min(1.0, cluster_cpus / n_actors)


@dataclass
class Hooks:
    """Observation points for tests and tools: `on_step(version, driver)` after each update is synced."""

    on_step: Callable[[int, AsyncDriver], None] | None = None


class AsyncDriver:
    """Owns the buffer and the actors of one rl/opd job; `run()` trains up to trainer.max_steps, from
    `init_checkpoint` (a model.safetensors, e.g. of an SFT run) or the seeded initialisation."""

    def __init__(self, job: JobConfig, run_dir: Path, *, hooks: Hooks | None = None, progress: bool = True,
                 ray_metrics: bool = True, worker_options: dict[str, Any] | None = None,
                 init_checkpoint: str | None = None):  # fmt: skip
        if job.trainer.kind not in ("rl", "opd"):
            raise ValueError(f"AsyncDriver runs trainer=rl or trainer=opd, not {job.trainer.kind!r}")
        self.job, self.kind, self.run_dir = job, job.trainer.kind, Path(run_dir)
        self.hooks, self.progress, self.ray_metrics = hooks or Hooks(), progress, ray_metrics
        self.worker_options = worker_options or {}
        # starting weights (model.safetensors) when not resuming: the argument, else trainer.init_checkpoint
        self.init_checkpoint = init_checkpoint or job.trainer.init_checkpoint
        r = job.rollout
        self.tasks, solver = load_train_split(job, progress)
        # trainer=rl: tasks whose rewards look exploited are held out of sampling (rl/audit.py)
        self.audit = TaskAudit(self.run_dir / "audit.jsonl", job.trainer.audit, solver) if self.kind == "rl" else None
        self.buffer = TrajectoryBuffer(batch_size=r.groups_per_step, max_policy_lag=r.max_policy_lag)
        self.version = 0
        self.next_group = 0
        self.trained: list[str] = []  # ledger: group keys in the order they were trained
        self.issued: Counter[str] = Counter()  # group key -> times issued by this process
        self.reissued_on_resume: list[str] = []
        self.history: list[dict[str, float]] = []
        self.in_flight: dict[Any, tuple[str, int]] = {}  # ObjectRef -> (group key, worker index)
        self.retries: Counter[str] = Counter()
        self.train_ref = None
        self.train_info: dict[str, Any] = {}
        self.last_batch: list[TrajectoryGroup] = []  # the groups of the latest update (for inspection)
        self.rollout_tokens = 0
        self.n_replaced = 0  # rollout workers replaced after dying
        self.replacements: Counter[int] = Counter()
        self.t_last = time.perf_counter()
        self.t_start = self.t_last

    # ------------------------------------------------------------------ actors
    def start_actors(self) -> None:
        import ray

        from rl.actors import LearnerActor, RolloutWorker, TeacherActor

        job = self.job
        gpus = job.cluster  # GPU shares per actor (0 = cpu); fractions let actors share one GPU
        cpus = actor_cpus(1 + job.rollout.n_workers + (self.kind == "opd"), ray.cluster_resources().get("CPU", 1.0))
        learner_cls = ray.remote(LearnerActor).options(num_cpus=cpus, num_gpus=gpus.learner_gpus, max_concurrency=1)
        self.learner = learner_cls.remote(
            job.model, job.trainer, threads=job.trainer.threads, init_seed=job.trainer.seed,
            init_checkpoint=self.init_checkpoint
        )
        self._worker_cls = ray.remote(RolloutWorker).options(
            num_cpus=cpus, num_gpus=gpus.rollout_gpus, max_concurrency=64, **self.worker_options)
        self.workers = [self._new_worker(i) for i in range(job.rollout.n_workers)]
        self.teacher = None
        if self.kind == "opd":
            self.teacher = ray.remote(TeacherActor).options(num_cpus=cpus, num_gpus=gpus.teacher_gpus).remote(
                job.model, job.trainer)

    def _new_worker(self, index: int):
        return self._worker_cls.remote(self.job.model, self.job.rollout, self.job.env, index,
                                       record_routing=self.job.trainer.routing_replay)

    def close(self) -> None:
        import ray

        for ref in list(self.in_flight):
            ray.cancel(ref, force=False)
        for actor in [self.learner, *self.workers, self.teacher]:
            if actor is not None:
                ray.kill(actor)

    # ------------------------------------------------------------------ checkpoints
    @property
    def ckpt_root(self) -> Path:
        return self.run_dir / "checkpoints"

    def state_dict(self) -> dict[str, Any]:
        return {"version": self.version, "next_group": self.next_group, "buffer": self.buffer.state_dict(),
                "trained": self.trained}  # fmt: skip

    def checkpoint(self) -> Path:
        import ray

        return Path(ray.get(self.learner.save.remote(str(self.ckpt_root), {"driver": self.state_dict()})))

    def resume(self) -> bool:
        """Continue from ckpt_root/latest if there is one: learner state, buffer, stream position."""
        import ray

        latest = self.ckpt_root / "latest"
        if not latest.exists():
            return False
        path = self.ckpt_root / latest.read_text().strip()
        state = json.loads((path / "driver.json").read_text())
        self.version = ray.get(self.learner.load.remote(str(path)))
        assert self.version == state["version"], (self.version, state["version"])
        self.next_group, self.trained = state["next_group"], list(state["trained"])
        self.buffer.load_state_dict(state["buffer"])
        return True

    # ------------------------------------------------------------------ phases
    def group_requests(self, g: int) -> list[RolloutRequest]:
        r = self.job.rollout
        task = self.tasks[g % len(self.tasks)]
        key = f"g{g:06d}"
        return [RolloutRequest(key=f"{key}/{m}", group_id=key, task_id=task["task_id"],
                               seed=r.seed * 1_000_003 + g * r.group_size + m, env=task["env"],
                               task=task["task"])
                for m in range(r.group_size)]  # fmt: skip

    def issue(self, key: str, worker: int | None = None) -> None:
        """Send group `key` to a worker (the least loaded unless given)."""
        if worker is None:
            load = Counter(w for _, w in self.in_flight.values())
            worker = min(range(len(self.workers)), key=lambda i: load[i])
        ref = self.workers[worker].rollout_group.remote(self.group_requests(int(key[1:])))
        self.in_flight[ref] = (key, worker)
        self.issued[key] += 1

    def admit(self) -> None:
        """Start new groups while admission control allows it at the current version."""
        while self.buffer.can_start(self.version):
            key = f"g{self.next_sampled_group():06d}"
            self.buffer.on_started(key, self.version, {"group": key})
            self.issue(key)

    def next_sampled_group(self) -> int:
        """The next group number of the prompt stream whose task the audit does not hold (group g's task
        stays g mod n_tasks, so a re-issued group is the same experiment)."""
        held = self.audit.held if self.audit is not None else set()
        for _ in range(len(self.tasks)):
            g, self.next_group = self.next_group, self.next_group + 1
            if self.tasks[g % len(self.tasks)]["task_id"] not in held:
                return g
        raise RuntimeError(
            f"the online audit holds every task of tasks={self.job.tasks} ({self.audit.path}): re-check them "
            "(flashpost-factory inspect, or a re-grade of the gold patch) and return them to sampling with "
            f"`python -m rl.audit release {self.run_dir} TASK_ID --by inspect`"
        )

    def sync_weights(self, indices: list[int] | None = None) -> None:
        """Publish the learner's weights once (object store) and load them into the workers; a worker
        found dead here is replaced (and its groups re-issued) like one found dead by a rollout."""
        import ray

        weights = self.learner.get_weights.remote()
        indices = list(range(len(self.workers))) if indices is None else indices
        refs = [(self.workers[i].set_weights.remote(weights), i) for i in indices]
        for ref, i in refs:
            try:
                ray.get(ref)
            except _actor_gone():
                self.replace_worker(i)

    def replace_worker(self, index: int) -> None:
        """Worker `index` died: start a new one with the current weights, re-issue its groups."""
        import ray

        # a failed sync may be the learner's death (its weights never arrive): that ends the job here
        ray.get(self.learner.get_version.remote(), timeout=600)
        self.replacements[index] += 1
        if self.replacements[index] > MAX_WORKER_REPLACEMENTS:
            raise RuntimeError(f"rollout worker {index} died {self.replacements[index]} times in a row")
        lost = [(ref, key) for ref, (key, w) in self.in_flight.items() if w == index]
        for ref, _ in lost:
            del self.in_flight[ref]
        try:
            ray.kill(self.workers[index])
        except Exception:  # already gone
            pass
        self.workers[index] = self._new_worker(index)
        self.n_replaced += 1
        self.sync_weights([index])
        for _, key in lost:
            self.issue(key, index)

    def on_rollout_done(self, ref) -> None:
        import ray

        key, worker = self.in_flight[ref]
        try:
            trajs: list[Trajectory] = ray.get(ref)
        except _actor_gone():
            self.replace_worker(worker)
            return
        except Exception:  # the episode code raised: retry the same group, then give up loudly
            del self.in_flight[ref]
            self.retries[key] += 1
            if self.retries[key] > MAX_GROUP_RETRIES:
                raise
            self.issue(key)
            return
        del self.in_flight[ref]
        self.replacements[worker] = 0
        self.rollout_tokens += sum(t.n_generated for t in trajs)
        self.buffer.put(key, TrajectoryGroup(group_id=key, trajectories=trajs))

    def start_update(self) -> None:
        """If the learner is idle and the oldest groups are ready, launch one update (non-blocking)."""
        if self.train_ref is not None:
            return
        groups = self.buffer.get_batch(self.job.rollout.groups_per_step, self.version)
        if groups is None:
            return
        trajs = [t for g in groups for t in g.trajectories]
        self.last_batch = groups
        info: dict[str, Any] = {"groups": [g.group_id for g in groups], **lag_stats(trajs, self.version),
                                **rollout_stats(trajs, self.job)}  # fmt: skip
        if self.kind == "rl":
            scored = score_groups(groups, self.job.trainer.advantage, self.job.trainer.advantage_eps)
            info.update(scored.stats)
            # untrained episodes sampled at the learner's version: where the step's mismatch is measured when
            # every trained one is older (or none is trained)
            probe = [t for t in trajs if not t.infra_failed and t.n_generated and t.oldest_version == self.version]
            self.train_ref = self.learner.train_rl.remote(scored.trajs, scored.advantages, probe[:1])
        else:
            valid = [t for t in trajs if not t.infra_failed]
            info.update(trajectories=float(len(trajs)), infra_failed=float(len(trajs) - len(valid)),
                        reward_mean=sum(t.reward for t in valid) / max(len(valid), 1))
            outputs = self.teacher.outputs.remote(valid)
            self.train_ref = self.learner.train_opd.remote(valid, outputs)
        self.train_info = info

    def on_update_done(self) -> dict[str, float]:
        import ray

        metrics = ray.get(self.train_ref)
        self.train_ref = None
        self.version += 1
        assert int(metrics["step"]) == self.version, (metrics["step"], self.version)
        self.trained += self.train_info.pop("groups")
        self.sync_weights()
        if self.audit is not None:  # every episode of the update, zero-spread groups too (an exploit passes all)
            self.audit.refresh()
            flags = self.audit.observe([t for g in self.last_batch for t in g.trajectories], self.version)
            self.train_info.update(audit_flagged=float(len(self.audit.held)), audit_new_flags=float(len(flags)))
        now = time.perf_counter()
        record = {**metrics, **self.train_info, "version": float(self.version), "wall_s": now - self.t_start,
                  "rollout_tokens": float(self.rollout_tokens),
                  "rollout_tokens_per_s": self.rollout_tokens / max(now - self.t_last, 1e-9),
                  "samples_per_s": self.train_info.get("trajectories", 0.0) / max(now - self.t_last, 1e-9),
                  "in_flight_groups": float(len(self.in_flight)), "buffered_groups": float(len(self.buffer.ready))}
        self.rollout_tokens, self.t_last = 0, now
        self.history.append(record)
        return record

    # ------------------------------------------------------------------ the loop
    def run(self) -> list[dict[str, float]]:
        import ray

        from rl.metrics import RunMetrics

        self.start_actors()
        resumed = self.resume()
        self.sync_weights()
        if resumed:  # in-flight groups of the checkpoint start again, exactly once (not counted again)
            self.reissued_on_resume = sorted(self.buffer.pending_restarts())
            for key in self.reissued_on_resume:
                self.issue(key)
        total = self.job.trainer.max_steps
        metrics = RunMetrics(self.run_dir, total, f"{self.kind} steps", self.ray_metrics, self.version, self.progress)
        try:
            while self.version < total:
                self.admit()
                self.start_update()
                waiting = list(self.in_flight) + ([self.train_ref] if self.train_ref is not None else [])
                if not waiting:
                    raise RuntimeError("driver stalled: nothing in flight and no update possible")
                ready, _ = ray.wait(waiting, num_returns=1, timeout=60.0)
                for ref in ready:
                    if ref is self.train_ref or ref == self.train_ref:
                        record = self.on_update_done()
                        record.update(self._worker_stats())
                        metrics.log(self.version, record)
                        if self.version % self.job.trainer.checkpoint_every == 0 or self.version == total:
                            self.checkpoint()
                        if self.hooks.on_step is not None:
                            self.hooks.on_step(self.version, self)
                    else:
                        self.on_rollout_done(ref)
        finally:
            metrics.close()
        return self.history

    def _worker_stats(self) -> dict[str, float]:
        import ray

        try:
            stats = ray.get([w.stats.remote() for w in self.workers], timeout=30)
        except Exception:  # a worker just died; the next rollout result replaces it
            return {}
        return {"sandboxes_live": sum(s["sandboxes_live"] for s in stats)}


def run_async(job: JobConfig, run_dir: Path, **kwargs: Any) -> list[dict[str, float]]:
    """Train trainer=rl or trainer=opd to max_steps (resuming from run_dir/checkpoints if present)."""
    driver = AsyncDriver(job, run_dir, **kwargs)
    try:
        return driver.run()
    finally:
        driver.close()
