"""Ray actors of the RL system (the execution layer): the learner, rollout workers and the OPD teacher.

- `LearnerActor` wraps `rl.learner.Learner` (model + per-family optimiser in a DeepSpeed engine): it
  packs trajectories into micro-batches, recomputes π_prox, steps, checkpoints, and publishes its
  weights as `(version, state_dict)`; returned from a Ray method that pair lands in the object store
  once and every worker on the machine reads it from there (weight sync by version; across GPUs the
  NCCL path of rl/weight_sync.py replaces it).
- `RolloutWorker` (an async actor) holds an InferenceEngine and runs whole GRPO groups of episodes
  concurrently (rl/rollout.py), batched through one engine; with rollout.agent=server it serves that
  engine with flashpost-serve on loopback and the external agent loop plays the episodes through it.
- `TeacherActor` returns, for the same packing as the learner's, full-vocabulary logits or hidden
  states plus its head (the learner rebuilds the logits chunk by chunk).
The trajectory buffer is owned by the driver (rl/rl_loop.py): one owner, no extra hop.
Not here: admission control, the driver loop, losses.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from rl.config import EnvConfig, ModelChoice, RolloutConfig, TrainerConfig
from rl.losses import mismatch_means, same_version_mismatch
from rl.payloads import TrainBatch, Trajectory, pack_trajectories
from rl.rollout import (
    RolloutRequest,
    SamplingParams,
    SessionBatcher,
    fresh_prefix_cache,
    run_sandbox_episode,
    run_toy_episode,
)


def build_model(choice: ModelChoice, seed: int = 0):
    """(Transformer with initialised weights, ChatTemplate) of a model choice, default tokenizer."""
    from model.chat_template import ChatTemplate
    from model.engram import EngramHasher
    from model.tokenizer import Tokenizer
    from model.transformer import Transformer

    args = choice.build_args()
    tokenizer = Tokenizer.default()
    if args.vocab_size < tokenizer.vocab_size:
        raise ValueError(f"model vocab_size {args.vocab_size} < tokenizer's {tokenizer.vocab_size}: override "
                         "model.overrides.vocab_size (and engram_compressed_vocab_size=2742 for the default one)")
    model = Transformer(args, engram_hasher=EngramHasher(args, tokenizer) if args.engram_layer_ids else None)
    model.init_weights(seed=seed)
    return model, ChatTemplate(tokenizer)


def pack_for_learner(trajs: list[Trajectory], cfg: TrainerConfig, advantages: list[float] | None = None,
                     pad_id: int = 0) -> list[TrainBatch]:
    """The one packing shared by the learner and the teacher (their micro-batches must line up)."""
    return pack_trajectories(trajs, max_tokens=cfg.micro_batch_tokens, advantages=advantages, pad_id=pad_id)


def build_engine(policy, template, rollout: RolloutConfig, device: torch.device, record_routing: bool = False):
    """The rollout InferenceEngine with the V4.1 inference path switches of `rollout` (rl/config.py);
    `record_routing` (trainer.routing_replay) records every token's experts, the engine's CUDA graphs off."""
    from model.engine import InferenceEngine
    from model.prefix_cache import PrefixCache
    from model.speculative import SpeculativeConfig

    # packed bytes are exact only on the QAT grid: without QAT the prefix tier's banks stay dense too
    prefix = PrefixCache(packed=policy.args.qat) if rollout.prefix_cache else None
    spec = SpeculativeConfig(min_speedup=rollout.spec_min_speedup) if rollout.speculative else None
    if spec is not None and policy.args.dspark_block_size <= 0:
        raise ValueError("rollout.speculative=true needs a model with a DSpark drafter (dspark_block_size > 0): "
                         "set rollout.speculative=false for this model")
    return InferenceEngine(policy.to(device), template, max_sessions=4096, device=device,
                           prefill_mode=rollout.prefill_mode, prefix_cache=prefix, speculative=spec,
                           packed_cache=rollout.live_packed(policy.args.qat),
                           compile_decode=None if rollout.compile_decode else False,
                           record_routing=record_routing)  # fmt: skip


def _drafter_changed(engine, weights: dict[str, torch.Tensor]) -> bool:
    """Whether `weights` hold other DSpark drafter (mtp.*) values than the engine's model has now."""
    current = engine.model.state_dict()
    return any(not torch.equal(v.to(current[k].device), current[k]) for k, v in weights.items() if k.startswith("mtp."))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _non_pad_tokens(batches: list[TrainBatch]) -> int:
    return int(sum(int((b.doc_ids >= 0).sum()) for b in batches))


def actor_device() -> torch.device:
    """cuda when Ray gave this actor a GPU (`num_gpus` > 0 in its options: Ray then sets its
    CUDA_VISIBLE_DEVICES), else cpu; an actor built outside Ray (tests) stays on cpu."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    try:
        import ray

        return torch.device("cuda") if ray.is_initialized() and ray.get_gpu_ids() else torch.device("cpu")
    except RuntimeError:  # not inside a Ray worker
        return torch.device("cpu")


def _teacher_output_to(out, device: torch.device):
    """The teacher's tensors on `device` (they travel through the object store on cpu)."""
    from rl.learner import TeacherOutput

    move = lambda t: None if t is None else t.to(device)  # noqa: E731
    return TeacherOutput(logits=move(out.logits), hidden=move(out.hidden), head=move(out.head))


class LearnerActor:
    """Create with `ray.remote(LearnerActor).options(...).remote(model, trainer, threads)`; `init_checkpoint`:
    a model.safetensors whose weights replace the seeded initialisation (a resume overrides both)."""

    def __init__(self, model: ModelChoice, trainer: TrainerConfig, threads: int = 1, init_seed: int = 0,
                 init_checkpoint: str | None = None):  # fmt: skip
        from rl.learner import Learner

        torch.set_num_threads(threads)
        torch.manual_seed(trainer.seed)
        # a one-process learner: its own rendezvous, not one inherited from the driver's environment
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", LOCAL_RANK="0",
                          WORLD_SIZE="1")
        policy, _ = build_model(model, seed=init_seed)
        if init_checkpoint:  # start from trained weights (e.g. an SFT or DSpark run); fresh optimiser state
            from model.checkpoint import load_checkpoint

            load_checkpoint(policy, init_checkpoint)
        self.cfg = trainer
        self.device = actor_device()
        self.learner = Learner(policy.to(self.device), trainer)

    # ------------------------------------------------------------------ weights
    @property
    def version(self) -> int:
        return self.learner.step

    def get_version(self) -> int:
        return self.version

    def get_weights(self) -> tuple[int, dict[str, torch.Tensor]]:
        """(policy version, full state dict on CPU): the payload of a weight sync."""
        return self.version, {k: v.detach().to("cpu", copy=True) for k, v in self.learner.model.state_dict().items()}

    # ------------------------------------------------------------------ steps
    def train_rl(self, trajs: list[Trajectory], advantages: list[float],
                 probe: list[Trajectory] | None = None) -> dict[str, float]:  # fmt: skip
        """One decoupled-PPO update on kept trajectories and their advantages; π_prox recomputed first.
        `probe`: the step's other (untrained, e.g. zero-spread) trajectories, to measure the train/rollout
        mismatch on when the trained ones hold no token of the learner's version."""
        t0 = time.perf_counter()
        batches = pack_for_learner(trajs, self.cfg, advantages)
        for b in batches:
            b.old_logprobs = self.learner.logprobs(b)
        # π_prox is the learner at the current version: on tokens sampled at that version it measures the
        # train/rollout mismatch at equal weights for free
        sums = [self._mismatch(b, b.old_logprobs) for b in batches]
        if not any(x["n"] for x in sums) and probe:
            sums = self._first_batch_mismatch(probe)
        return self._timed(self.learner.train_step(batches, "rl") | mismatch_means(sums), batches, t0)

    def _mismatch(self, batch: TrainBatch, logp: torch.Tensor) -> dict[str, float]:
        return same_version_mismatch(logp.cpu(), batch.logprobs, batch.versions, batch.loss_mask, self.version)

    def _first_batch_mismatch(self, trajs: list[Trajectory]) -> list[dict[str, float]]:
        """The mismatch on the first micro-batch of `trajs`, one extra no-grad forward, when that micro-batch
        holds tokens sampled at the learner's version (none otherwise)."""
        batches = pack_for_learner(trajs, self.cfg)
        first = batches[0] if batches and bool((batches[0].versions == self.version).any()) else None
        return [self._mismatch(first, self.learner.logprobs(first))] if first is not None else []

    def train_sft(self, trajs: list[Trajectory]) -> dict[str, float]:
        t0 = time.perf_counter()
        batches = pack_for_learner(trajs, self.cfg)
        return self._timed(self.learner.train_step(batches, "sft"), batches, t0)

    def train_opd(self, trajs: list[Trajectory], teacher_outputs: list) -> dict[str, float]:
        t0 = time.perf_counter()
        batches = pack_for_learner(trajs, self.cfg)
        if len(teacher_outputs) != len(batches):
            raise ValueError(f"{len(teacher_outputs)} teacher outputs for {len(batches)} micro-batches")
        teacher_outputs = [_teacher_output_to(o, self.device) for o in teacher_outputs]
        mismatch = mismatch_means(self._first_batch_mismatch(trajs))  # the train/rollout mismatch, equal weights
        return self._timed(self.learner.train_step(batches, "opd", extras=teacher_outputs) | mismatch, batches, t0)

    def train_dspark(self, trajs: list[Trajectory]) -> dict[str, float]:
        t0 = time.perf_counter()
        batches = pack_for_learner(trajs, self.cfg)
        return self._timed(self.learner.train_step(batches, "dspark"), batches, t0)

    def _timed(self, metrics: dict[str, float], batches: list[TrainBatch], t0: float) -> dict[str, float]:
        seconds = time.perf_counter() - t0
        metrics["learner_s"] = seconds
        metrics["learner_tokens_per_s"] = _non_pad_tokens(batches) / max(seconds, 1e-9)
        return metrics

    # ------------------------------------------------------------------ checkpoints
    def save(self, root: str, extra: dict[str, Any] | None = None) -> str:
        return str(self.learner.save(root, extra))

    def load(self, path: str) -> int:
        self.learner.load(path)
        return self.version

    def pid(self) -> int:
        return os.getpid()


class RolloutWorker:
    """An async actor: `rollout_group` calls run concurrently (create with max_concurrency > 1), all
    their episodes share one batched engine. Weights arrive by version (`set_weights`)."""

    def __init__(self, model: ModelChoice, rollout: RolloutConfig, env: EnvConfig | None = None, index: int = 0,
                 record_routing: bool = False):
        torch.set_num_threads(rollout.threads_per_worker)
        policy, self.template = build_model(model, seed=0)  # placeholder values until the first set_weights
        # record_routing (trainer.routing_replay): trajectories carry their routing for the learner's replay
        self.engine = build_engine(policy, self.template, rollout, actor_device(), record_routing)
        self.drafter_version = -1  # the policy version whose weights changed the DSpark drafter last
        sampling = SamplingParams(temperature=rollout.temperature, top_p=rollout.top_p,
                                  max_new_tokens=rollout.max_new_tokens)
        self._lock = None  # asyncio.Lock of the actor's event loop: engine access, weight loads
        self._batcher = None  # the sandbox episodes' SessionBatcher (continuous), made on the actor's loop
        self._sampling = sampling
        self._toy_tokens = 0  # tokens of the toy groups' own batchers (the shared batcher counts its own)
        self.tokens_generated = 0
        self.rollout_cfg, self.env_cfg, self.index = rollout, env or EnvConfig(), index
        self.version = -1
        self._sandboxes = self._graders = None
        self._sandbox_slots: asyncio.Semaphore | None = None  # created on the actor's event loop
        self.n_episodes = 0
        self.served = None  # rollout.agent=server: (Server, ServerThread); the engine then belongs to its loop
        if rollout.agent == "server":
            from rl.serve_app import Server, ServerThread, build_app
            from rl.serve_engine import ServeConfig

            # a turn is one engine call, as in engine mode: the same draws, and CED turns where episodes have them
            cfg = ServeConfig(max_sessions=4096, max_pending=4096, decode_chunk=0, prefill_mode=rollout.prefill_mode,
                              threads=rollout.threads_per_worker)  # fmt: skip
            server = Server(self.engine, self.template, cfg)
            self.served = (server, ServerThread(build_app(server)).start())

    def _engine_lock(self):
        import asyncio

        if self._lock is None:  # created inside the actor's event loop
            self._lock = asyncio.Lock()
        return self._lock

    def _shared_batcher(self) -> SessionBatcher:
        """Every sandbox episode's turns, whatever its group, in one continuous engine call: a turn that
        comes back from its tool joins the running call instead of waiting for it to end."""
        if self._batcher is None:
            self._batcher = SessionBatcher(self.engine, self._sampling, 0.005, self._engine_lock())
        return self._batcher

    async def set_weights(self, payload: tuple[int, dict[str, torch.Tensor]]) -> int:
        version, weights = payload
        if self.engine.speculative is not None and (self.drafter_version < 0 or _drafter_changed(self.engine, weights)):
            self.drafter_version = version
        if self.served is not None:
            import asyncio

            def load(engine) -> None:  # in the server's engine thread, between two engine calls
                engine.load_state_dict(weights, version)
                if engine.prefix_cache is not None:  # its states were computed under the old weights
                    engine.prefix_cache = fresh_prefix_cache(engine.prefix_cache)

            await asyncio.to_thread(lambda: self.served[0].loop.call(load).result())
            self.version = version
            return version
        await self._shared_batcher().load_weights(weights, version)  # a waiting load stops its admissions
        self.version = version
        return version

    async def rollout_group(
        self, requests: list[RolloutRequest], on_episode: Callable[[Trajectory], None] | None = None
    ) -> list[Trajectory]:
        """Run the episodes of one group concurrently; one Trajectory per request, in order.
        `on_episode` (in-process callers, e.g. flashpost-eval's progress bar) sees each as it ends."""
        import asyncio

        async def report(coro):
            t = await coro
            if on_episode is not None:
                on_episode(t)
            return t

        if self.version < 0:
            raise RuntimeError("rollout worker has no policy weights yet: call set_weights first")
        t0 = time.perf_counter()
        if self.served is not None:
            trajs = await asyncio.gather(*(report(self._served_episode(r)) for r in requests))
            self.tokens_generated = self.served[0].loop.stats["tokens_generated"]
        else:
            # in-process (toy) groups get a batcher of their own: their engine batches, hence their numbers,
            # do not depend on what else the worker runs; sandbox episodes share the continuous one
            in_process = all(r.env == "toy" for r in requests)
            batcher = SessionBatcher(self.engine, self._sampling, None, self._engine_lock()) if in_process \
                else self._shared_batcher()  # fmt: skip
            trajs = await asyncio.gather(*(report(self._episode(r, batcher)) for r in requests))
            if in_process:
                self._toy_tokens += batcher.tokens_generated
            shared = self._batcher.tokens_generated if self._batcher is not None else 0
            self.tokens_generated = self._toy_tokens + shared
        seconds = time.perf_counter() - t0
        for t in trajs:
            t.engine_version = f"worker{self.index}"
            t.drafter_version = self.drafter_version
            t.timings["group_s"] = seconds
        self.n_episodes += len(trajs)
        return list(trajs)

    async def _episode(self, req: RolloutRequest, batcher: SessionBatcher) -> Trajectory:
        if req.env == "toy":
            return await run_toy_episode(req, batcher, self.template)
        if req.env == "sandbox":
            # An episode waits for a sandbox slot here, on the event loop. Waiting inside the pool's
            # blocking semaphore parks one of the loop's few executor threads per waiting episode; with
            # more episodes admitted than sandboxes, the threads that the live episodes need for their
            # tool calls and generation would all be parked (a deadlock).
            if self._sandbox_slots is None:
                self._sandbox_slots = asyncio.Semaphore(self.env_cfg.max_concurrent)
            async with self._sandbox_slots:
                return await run_sandbox_episode(req, batcher, self.template, *self._sandbox_tools())
        raise ValueError(f"unknown rollout env {req.env!r}")

    async def _served_episode(self, req: RolloutRequest) -> Trajectory:
        import asyncio

        from rl.serve_rollout import run_served_episode, run_served_sandbox_episode

        server, thread = self.served
        args = (req, thread.base_url, server.cfg.model_name, self._sampling, self.template)
        if req.env == "toy":
            return await asyncio.to_thread(run_served_episode, *args)
        if req.env == "sandbox":
            return await run_served_sandbox_episode(*args, server.max_seq_len, *self._sandbox_tools())
        raise ValueError(f"unknown rollout env {req.env!r}")

    def _sandbox_tools(self) -> tuple:
        """(sandbox factory, grade, episode config) over this worker's pools, created on first use; the
        episode's turn limit is rollout.max_turns, its grading's tests get the task's measured budget capped
        by env.grading_timeout_s (envs.grading.grading_timeout)."""
        import functools

        from envs.episode import EpisodeConfig
        from envs.grading import grade_in_budget
        from envs.pool import GraderPool, SandboxPool

        if self._sandboxes is None:
            self._sandboxes = SandboxPool(self.env_cfg.max_concurrent)
            self._graders = GraderPool(max_graders=self.env_cfg.max_concurrent)
        pool = self._sandboxes

        def factory(task):
            return pool.sandbox(task.image, labels={"flashpost.task_id": task.task_id})

        grade = functools.partial(grade_in_budget, pool=self._graders, cap_s=self.env_cfg.grading_timeout_s)
        return factory, grade, EpisodeConfig(max_turns=self.rollout_cfg.max_turns, wall_time_s=300.0)

    def stats(self) -> dict[str, float]:
        return {
            "tokens_generated": float(self.tokens_generated),
            "episodes": float(self.n_episodes),
            "sandboxes_live": float(self._sandboxes.live if self._sandboxes else 0),
            "sandboxes_max": float(self.env_cfg.max_concurrent),
            "version": float(self.version),
        }

    def pid(self) -> int:
        return os.getpid()

    def close(self) -> None:
        if self._graders is not None:
            self._graders.close()
        if self.served is not None:
            self.served[1].stop()
            self.served[0].loop.close()


class TeacherActor:
    """A fixed teacher for OPD: a checkpoint (or seeded init) of a model choice with the student's
    vocabulary. `outputs` packs exactly as the learner does and returns one TeacherOutput per micro-batch."""

    def __init__(self, model: ModelChoice, trainer: TrainerConfig, threads: int = 1):
        torch.set_num_threads(threads)
        self.model, _ = build_model(trainer.teacher_model or model, seed=trainer.teacher_seed)
        if trainer.teacher_checkpoint:
            from model.checkpoint import load_checkpoint

            load_checkpoint(self.model, trainer.teacher_checkpoint)
        self.device = actor_device()
        self.model.to(self.device).eval()
        self.cfg = trainer

    @torch.no_grad()
    def outputs(self, trajs: list[Trajectory]) -> list:
        from rl.learner import TeacherOutput

        outs = []
        for b in pack_for_learner(trajs, self.cfg):
            b = b.to(self.device)
            o = self.model(b.input_ids, b.doc_ids, compute_indexer_loss=False)
            if self.cfg.teacher_ship == "logits":
                outs.append(TeacherOutput(logits=o.logits.cpu()))
            else:
                outs.append(TeacherOutput(hidden=o.hidden.cpu(), head=self.model.head.weight.detach().cpu()))
        return outs

    def vocab_size(self) -> int:
        return self.model.args.vocab_size
