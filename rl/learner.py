"""The learner: a V4.1 model and its family optimiser inside a DeepSpeed engine, one `train_step` per
optimiser update over any number of packed micro-batches, and atomic checkpoints.

Losses are token-sums over a GLOBAL denominator (valid tokens of all micro-batches on all ranks), so
gradients are exact regardless of packing; DeepSpeed's data-parallel mean is undone by scaling with
the world size. The engine drives one client optimizer: `rl.optim.FamilyOptimizer` (Muon / Sinkhorn
/ AdamW by family) at ZeRO stage 0, or DeepSpeed's MuonWithAuxAdam at ZeRO 1/2 (rl/optim.py says what
that path lacks: Sinkhorn balancing, sparse Engram gradients). Runs on CPU with gloo (tests) and on GPUs with NCCL.
Data parallel: every rank calls train_step / save with its own micro-batches (any number, even none);
2 ranks equal 1 process at ZeRO 0/1/2 (tests/rl/test_multiprocess.py). ZeRO-3 is refused.
The DSpark drafter term (`trainer.dspark_weight`) joins every kind's loss: drafts from DETACHED backbone
features (Transformer.draft_teacher_forced) against the policy's own next-token distribution, so it
trains `mtp.*` only; kind "dspark" freezes the backbone and trains the drafter alone.
Not here: rollouts, Ray actors (rl/actors.py), weight sync.
"""

from __future__ import annotations

import os
import shutil
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from model.checkpoint import load_checkpoint, save_checkpoint
from model.dspark import DSparkLoss, align_to_drafts, draft_target_ids, dspark_loss_chunked
from model.moe import routing_replay, update_expert_bias
from model.transformer import TransformerOutput
from rl.config import TrainerConfig
from rl.losses import at_temperature, balance_terms, indexer_term, opd_reverse_kl, policy_loss, sft_loss, token_logprobs
from rl.optim import build_optimizer, build_zero_optimizer
from rl.payloads import TrainBatch, Trajectory, pack_trajectories

# length of the dummy micro-batch of a rank that has none while others train (see Learner._pad_ranks)
FILLER_TOKENS = 16
# the DSpark term's largest vocabulary-sized tensor (elements): its draft logits and targets are built over
# this many rows x k x vocab at a time (at the released tokenizer's vocabulary, 129,280, a 4096-token
# micro-batch's [4096,5,V] fp32 draft logits would be 10.6 GB; 2^27 elements, 512 MiB, is ~200 positions)
DSPARK_CHUNK_LOGITS = 1 << 27


@dataclass
class TeacherOutput:
    """What the teacher returns for one micro-batch, at every position of its rows: logits [B,S,V], or
    hidden [B,S,D] plus the teacher's `head` [V,D] (the learner rebuilds logits chunk by chunk)."""

    logits: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
    head: torch.Tensor | None = None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_distributed() -> None:
    """Single-process defaults (rank 0 of 1 on 127.0.0.1) unless a launcher already set them."""
    import deepspeed
    import torch.distributed as dist

    if dist.is_initialized():
        return
    for key, value in {"MASTER_ADDR": "127.0.0.1", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}.items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")


# ---------------------------------------------------------------------- per-kind micro-batch losses
LossFn = Callable[["Learner", TransformerOutput, TrainBatch, torch.Tensor, Any], tuple[torch.Tensor, dict]]


def _sft(learner: Learner, out: TransformerOutput, batch: TrainBatch, denom: torch.Tensor, extra: Any):
    loss = sft_loss(out.logits, batch.input_ids, batch.loss_mask, denom)
    return loss, {}


def _rl(learner: Learner, out: TransformerOutput, batch: TrainBatch, denom: torch.Tensor, extra: Any):
    logp = token_logprobs(at_temperature(out.logits, learner.cfg.policy_loss.temperature), batch.input_ids)
    loss, metrics = policy_loss(
        logp, batch.old_logprobs, batch.logprobs, batch.advantages, batch.loss_mask, learner.cfg.policy_loss, denom,
        logp_ref=batch.ref_logprobs,
    )  # fmt: skip
    lag = (learner.step - batch.versions)[batch.loss_mask].float()  # policy version = optimiser steps taken
    metrics["version_lag_mean"] = float(lag.mean()) if lag.numel() else 0.0
    return loss, metrics


def _opd(learner: Learner, out: TransformerOutput, batch: TrainBatch, denom: torch.Tensor, extra: TeacherOutput):
    # logits at t-1 predict token t, which loss_mask marks at t. The student side goes through hidden
    # states and the head too, so no second [tokens, V] logits copy or gradient buffer is made.
    mask = batch.loss_mask[:, 1:]
    teacher = extra.logits if extra.logits is not None else extra.hidden
    loss, D = opd_reverse_kl(
        out.hidden[:, :-1], teacher[:, :-1], mask, learner.cfg.opd_chunk_size,
        student_head=learner.model.head.weight, teacher_head=extra.head, denominator=denom,
    )  # fmt: skip
    return loss, {"opd_kl_mean": float(D.detach().mean()) if D.numel() else 0.0}


def _dspark_only(learner: Learner, out: TransformerOutput, batch: TrainBatch, denom: torch.Tensor, extra: Any):
    return out.logits.new_zeros(()), {}


LOSS_KINDS: dict[str, LossFn] = {"sft": _sft, "rl": _rl, "opd": _opd, "dspark": _dspark_only}


def dspark_term(
    model: nn.Module, out: TransformerOutput, batch: TrainBatch, chunk_logits: int = DSPARK_CHUNK_LOGITS
) -> DSparkLoss | None:
    """DSpark alignment on one micro-batch (DESIGN §3.1): row i of anchor s learns sg(p_policy) at s+i,
    on rows whose target token s+1+i is a generated (loss-mask) token of the same document. None when
    the model has no drafter or the batch no such row. Gradients reach `mtp.*` only (the drafter reads
    detached features).
    Only anchors with a trained row are drafted, and the loss is taken over them a chunk at a time
    (`dspark_loss_chunked`): no [B,S,k,V] draft logits or targets exist, only [1,chunk,k,V] with
    chunk·k·V <= `chunk_logits`."""
    if getattr(model, "mtp", None) is None or out.main_hidden is None:
        return None
    k = model.mtp.block_size
    S = batch.input_ids.size(1)
    in_doc = draft_target_ids(batch.input_ids, k, batch.doc_ids) >= 0
    generated = align_to_drafts(F.pad(batch.loss_mask[:, 1:], (0, 1), value=False), k, False)
    mask = in_doc & generated & (batch.doc_ids >= 0)[..., None]
    # only the anchors with a trained row (a few generated tokens of long prompts): drafts [1,n,k,..]
    anchors = mask.any(-1)
    b_n, s_n = anchors.nonzero(as_tuple=True)
    if b_n.numel() == 0:  # no generated token to align to (e.g. a rank's filler micro-batch)
        return None
    draft = model.draft_teacher_forced(
        out.main_hidden, batch.input_ids, k, doc_ids=batch.doc_ids, with_logits=False, anchors=anchors
    )
    logits = out.logits.detach()

    def target(lo: int, hi: int) -> torch.Tensor:
        # the policy's probabilities at s..s+k-1 of the selected anchors lo..hi-1 (none past the end)
        pos = s_n[lo:hi, None] + torch.arange(k, device=s_n.device)
        p = logits[b_n[lo:hi, None], pos.clamp(max=S - 1)].float().softmax(-1)
        return (p * (pos < S)[..., None])[None]

    chunk = max(1, chunk_logits // (k * model.head.weight.size(0)))
    return dspark_loss_chunked(
        model.mtp, draft, model.head.weight.detach(), target, mask=mask[anchors][None], chunk=chunk
    )


class Learner:
    """Owns the DeepSpeed engine. `model` must be a `model.transformer.Transformer` (or anything with
    the same forward contract and an `args` attribute), with initialised weights."""

    def __init__(self, model: nn.Module, cfg: TrainerConfig, ds_overrides: dict[str, Any] | None = None):
        import deepspeed

        if cfg.zero_stage == 3:
            # ZeRO-3 also partitions the parameters themselves: the model's forward (MoE gathers, Engram
            # tables, DSpark reading backbone weights) would need DeepSpeed's gather hooks everywhere
            raise ValueError("trainer.zero_stage=3 is not supported: use 0 (per-family optimiser) or 1/2")
        ensure_distributed()
        self.cfg = cfg
        self.model = model
        if cfg.kind == "dspark":  # the drafter alone; the backbone is the frozen policy it follows
            if getattr(model, "mtp", None) is None:
                raise ValueError("trainer=dspark needs a model with a DSpark drafter (dspark_block_size > 0)")
            for name, p in model.named_parameters():
                p.requires_grad_(p.requires_grad and name.startswith("mtp."))
        self.forward_fn = self._replay_forward() if cfg.simulate_replay else None
        # ZeRO 1/2: DeepSpeed's MuonWithAuxAdam (rl/optim.py says what it lacks); stage 0: the families
        self.optimizer = build_zero_optimizer(model, cfg.optim) if cfg.zero_stage else build_optimizer(model, cfg.optim)
        ds_config = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": cfg.zero_stage},
            # stage 0 clips per family in train_step (the drafter's gradients must not rescale the
            # backbone's update); ZeRO's partitioned gradients keep DeepSpeed's one global-norm clip
            "gradient_clipping": cfg.grad_clip if cfg.zero_stage else 0.0,
            "steps_per_print": 10**9,
            **(ds_overrides or {}),
        }
        self.engine, _, _, _ = deepspeed.initialize(model=model, optimizer=self.optimizer, config=ds_config)
        self._trainable = [p for p in model.parameters() if p.requires_grad]
        # the backbone's and the DSpark drafter's (`mtp.*`) parameters, clipped apart (`_clip_by_family`)
        self._clip_families = [[p for n, p in model.named_parameters() if n.startswith("mtp.") == d] for d in (0, 1)]
        self.device = next(model.parameters()).device
        if self.device.type == "cpu":
            # the backward of advanced indexing (index_put_ with accumulate) adds into fp32 with parallel
            # atomics on CPU unless deterministic algorithms are on, so one batch's gradients differed
            # between repeats on a loaded machine and a resumed run parted from an uninterrupted one
            # (docs/demo_measurements.md); deterministic mode makes those adds serial (~4% of a demo
            # step's forward and backward). Process-wide: a learner owns its process (LearnerActor).
            # Not on GPUs, where it would also switch scatters and index_put to sorting kernels
            torch.use_deterministic_algorithms(True, warn_only=True)
        self.step = 0

    @staticmethod
    def _replay_forward() -> Callable:
        """The training-side simulated decoder replay of model/ (DESIGN §3), when that module exists."""
        try:
            from model.replay import replay_forward  # type: ignore[import-not-found]
        except ImportError as e:
            raise ValueError(
                "trainer.simulate_replay=true needs model.replay.replay_forward (the training-side simulation "
                "of the engine's decoder replay); run with trainer.simulate_replay=false until it exists"
            ) from e
        return replay_forward

    def forward(self, batch: TrainBatch, compute_indexer_loss: bool | None = None) -> TransformerOutput:
        """The training forward of one micro-batch: plain teacher-forced, or with simulated decoder
        replay per generation turn (`trainer.simulate_replay`, turn starts from the batch); with
        `trainer.routing_replay` the MoE layers route by the rollout's recorded experts (batch.routing)."""
        routing = self._routing(batch)
        if self.forward_fn is not None:
            return self.forward_fn(
                self.engine,
                batch.input_ids,
                batch.doc_ids,
                batch.turn_starts,
                loss_mask=batch.loss_mask,
                compute_indexer_loss=compute_indexer_loss,
                routing=routing,
            )
        if routing is None:
            return self.engine(batch.input_ids, batch.doc_ids, compute_indexer_loss=compute_indexer_loss)
        with routing_replay(routing, range(self.model.args.n_layers)):
            return self.engine(batch.input_ids, batch.doc_ids, compute_indexer_loss=compute_indexer_loss)

    def _routing(self, batch: TrainBatch) -> torch.Tensor | None:
        """The routing to replay (trainer.routing_replay), None when off. A batch with generated tokens
        but no recorded routing is refused: its trajectories came from an engine that did not record."""
        if not self.cfg.routing_replay:
            return None
        if batch.routing is None and bool(batch.loss_mask.any()):
            raise ValueError(
                "trainer.routing_replay=true but the batch's trajectories carry no routing: roll out with "
                "an engine built with record_routing=True (RolloutWorker(record_routing=True)) or set "
                "trainer.routing_replay=false"
            )
        return batch.routing

    @property
    def world_size(self) -> int:
        import torch.distributed as dist

        return dist.get_world_size() if dist.is_initialized() else 1

    def global_counts(self, batches: list[TrainBatch]) -> tuple[torch.Tensor, int, int]:
        """(Σ valid tokens, Σ micro-batches, most micro-batches on one rank) over these micro-batches and
        all data-parallel ranks: the token-mean denominator of the losses, the mean divisor of the
        per-micro-batch aux terms, and how many backward passes every rank must make (`_pad_ranks`)."""
        import torch.distributed as dist

        n = torch.tensor([float(sum(b.n_tokens for b in batches)), float(len(batches))], device=self.device)
        if self.world_size == 1:
            return n[0].clamp_min(1.0), int(n[1]), int(n[1])
        per_rank = [torch.zeros_like(n) for _ in range(self.world_size)]
        dist.all_gather(per_rank, n)  # one collective for both the sums and the max
        stacked = torch.stack(per_rank)
        total = stacked.sum(0)
        return total[0].clamp_min(1.0), int(total[1]), int(stacked[:, 1].max())

    def _pad_ranks(self, batches: list[TrainBatch], extras: list[Any], n_max: int) -> tuple[list, list]:
        """Append zero-weight filler micro-batches up to `n_max`: every rank makes as many backward passes,
        because ZeRO-2 reduces gradients in each one (a rank with fewer would leave the others waiting in a
        collective). A filler is this rank's last micro-batch again, or a one-row dummy when the rank has
        none; its gradients are exactly 0 (at stage 0 a dummy's Engram rows join the sparse gradient with
        zero values, which the Sinkhorn family counts as touched rows)."""
        n_fill = n_max - len(batches)
        if batches:
            fill = batches[-1:] * n_fill
        else:
            n = FILLER_TOKENS
            dummy = Trajectory(token_ids=[0] * n, loss_mask=[False] + [True] * (n - 1), logprobs=[0.0] * n,
                               versions=[0] * n, turn_starts=[1])  # fmt: skip
            if self.cfg.routing_replay:  # nothing recorded: routed as usual
                a = self.model.args
                dummy.routing = torch.full((n, a.n_layers, a.n_activated_experts), -1, dtype=torch.int32)
            fill = pack_trajectories([dummy], max_tokens=n) * n_fill
        return batches + fill, extras + [None] * n_fill  # fillers take the SFT loss: no teacher output needed

    @torch.no_grad()
    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """Token log-probs [B,S] under the current weights (π_prox for the decoupled PPO loss)."""
        self.engine.eval()
        b = batch.to(self.device)
        out = self.forward(b, compute_indexer_loss=False)
        self.engine.train()
        logits = at_temperature(out.logits, self.cfg.policy_loss.temperature)
        return token_logprobs(logits, b.input_ids).masked_fill(~b.loss_mask, 0.0)

    def train_step(
        self, batches: TrainBatch | list[TrainBatch], loss_kind: str, extras: list[Any] | None = None
    ) -> dict[str, float]:
        """One optimiser update over `batches` (this rank's micro-batches); `extras[i]` is micro-batch
        i's TeacherOutput for "opd". For "rl", fill `batch.old_logprobs` with `logprobs` first.
        Metrics are global (summed over ranks: token-weighted means, loss = the global loss)."""
        batches = [batches] if isinstance(batches, TrainBatch) else list(batches)
        if self.global_counts(batches)[1] == 0:  # no rank has anything trainable (e.g. zero-spread groups)
            self.step += 1  # the version still advances, so admission control keeps its pace
            return {"step": float(self.step), "skipped": 1.0, "n_tokens": 0.0}
        totals, counts = self.accumulate_grads(batches, loss_kind, extras)
        if not self.cfg.zero_stage and self.cfg.grad_clip > 0:
            self._clip_by_family()
        self.engine.step()
        if loss_kind != "dspark":  # the frozen backbone's routing stays as the policy had it
            self._update_expert_biases(counts)
        self.step += 1
        totals["step"] = float(self.step)
        return totals

    def accumulate_grads(
        self, batches: TrainBatch | list[TrainBatch], loss_kind: str, extras: list[Any] | None = None
    ) -> tuple[dict[str, float], list[torch.Tensor]]:
        """Forward/backward of every micro-batch; leaves the data-parallel-reduced gradients in `.grad`.
        -> (global metrics, per-layer expert counts of this rank)."""
        import torch.distributed as dist

        batches = [batches] if isinstance(batches, TrainBatch) else list(batches)
        fn = LOSS_KINDS[loss_kind]
        extras = list(extras) if extras else [None] * len(batches)
        denom, n_micro, n_max = self.global_counts(batches)
        n_real = len(batches)
        batches, extras = self._pad_ranks(batches, extras, n_max)
        self.engine.train()
        totals: dict[str, float] = {"loss": 0.0, "indexer_loss": 0.0, "balance_loss": 0.0, "dspark_loss": 0.0}
        # Device scalars are read after the loop (key, value, its micro-batch's tokens or None for a plain sum):
        # on a GPU a read waits for all queued work, so one inside the loop would keep the host from queueing
        # the next micro-batch until the last one finished. The denominator is read once, before any work.
        pending: list[tuple[str, torch.Tensor, int | None]] = []
        denom_value = float(denom)
        counts: list[torch.Tensor] = []
        for i, (mb, extra) in enumerate(zip(batches, extras)):
            real = i < n_real
            n_tok = mb.n_tokens if real else 0  # counted on the host batch, before it moves
            mb = mb.to(self.device)
            self.engine.set_gradient_accumulation_boundary(i == len(batches) - 1)
            out = self.forward(mb)
            # a filler's loss kind needs no teacher output; its weight 0 still reaches every parameter
            loss, metrics = (fn if real else _sft)(self, out, mb, denom, extra)
            with torch.set_grad_enabled(self.cfg.dspark_weight > 0):  # weight 0: a frozen drafter, still measured
                ds = dspark_term(self.model, out, mb)
            drafter = (
                loss.new_zeros(())
                if ds is None or self.cfg.dspark_weight == 0
                else (ds.loss * self.cfg.dspark_weight / n_micro)
            )
            idx = indexer_term(out.indexer_loss, self.cfg.indexer_loss_weight) / n_micro
            bal, layer_counts = balance_terms(out.router_stats, self.cfg.balance_alpha, mb.doc_ids >= 0)
            bal = bal / n_micro
            # DeepSpeed averages gradients over ranks; the losses are already global sums: undo the mean
            self._backward((loss + idx + bal + drafter) * (self.world_size if real else 0.0))
            layer_counts = layer_counts if real else [torch.zeros_like(c) for c in layer_counts]
            counts = layer_counts if not counts else [a + b for a, b in zip(counts, layer_counts)]
            if not real:
                continue
            pending += [("loss", loss.detach(), None), ("indexer_loss", idx.detach(), None),
                        ("balance_loss", bal.detach(), None), ("dspark_loss", drafter.detach(), None)]  # fmt: skip
            if ds is not None:
                pending.append(("dspark_acceptance", ds.acceptance.detach(), n_tok))
            for k, v in metrics.items():
                totals[k] = totals.get(k, 0.0) + v * n_tok / denom_value
        for k, v, n in pending:
            totals[k] = totals.get(k, 0.0) + (float(v) if n is None else float(v) * n / denom_value)
        if self.world_size > 1:  # by key: a rank whose micro-batches were all fillers has fewer metrics
            per_rank: list[dict[str, float]] = [{} for _ in range(self.world_size)]
            dist.all_gather_object(per_rank, totals)
            totals = {k: sum(r.get(k, 0.0) for r in per_rank) for k in sorted(set().union(*per_rank))}
        totals["n_tokens"] = denom_value
        return totals, counts

    def _backward(self, total: torch.Tensor) -> None:
        """engine.backward, in an order every rank shares. ZeRO 1/2 reduce gradients through per-parameter
        hooks into buckets sliced by position: all ranks must hand in the same parameters in the same order,
        but autograd fires a hook when that parameter's gradient is complete, which depends on the data (an
        expert no token chose has no gradient at all; one chosen late completes late). So under ZeRO the
        gradients are taken first (`autograd.grad`, no hooks) and fed back through Σ⟨p, g⟩ over a fixed
        parameter list: d/dp = g exactly, hooks fire in graph order. Costs one gradient copy per
        micro-batch. Stage 0 needs none of it: DeepSpeed all-reduces at the boundary in parameter order."""
        if not self.cfg.zero_stage:
            self.engine.backward(total, scale_wrt_gas=False)
            return
        grads = torch.autograd.grad(total, self._trainable, allow_unused=True)
        replay = torch.stack([
            (p * (g if g is not None else torch.zeros_like(p))).sum() for p, g in zip(self._trainable, grads)
        ]).sum()  # fmt: skip
        self.engine.backward(replay, scale_wrt_gas=False)

    def _clip_by_family(self) -> None:
        """Global-norm clipping to grad_clip, separately for the backbone and the DSpark drafter (`mtp.*`):
        one shared norm would let the drafter's gradient size scale the policy's update. Sparse (Engram)
        gradients count their stored values."""
        for params in self._clip_families:
            grads = [p.grad for p in params if p.grad is not None]
            if not grads:
                continue
            values = [g.coalesce().values() if g.is_sparse else g for g in grads]
            norms = torch._foreach_norm(values, dtype=torch.float32)  # one call for all, each as .float().norm()
            coef = self.cfg.grad_clip / (torch.stack(norms).norm() + 1e-6)
            if coef < 1:
                for g in grads:
                    g.mul_(coef)

    def _update_expert_biases(self, counts: list[torch.Tensor]) -> None:
        import torch.distributed as dist

        gates = [m.ffn.gate for m in getattr(self.model, "layers", [])]
        for gate, c in zip(gates, counts):
            if self.world_size > 1:
                dist.all_reduce(c)
            update_expert_bias(gate.bias, c, self.cfg.expert_bias_rate)

    # ------------------------------------------------------------------ checkpoints
    def _optimizer(self):
        """The optimizer whose state is the run's: ZeRO's partitioned wrapper, or the family facade."""
        return self.engine.optimizer if self.cfg.zero_stage else self.optimizer

    def _barrier(self) -> None:
        import torch.distributed as dist

        if self.world_size > 1:
            dist.barrier()

    def save(self, root: str | os.PathLike, extra: dict[str, Any] | None = None) -> Path:
        """root/step-XXXXXXXX/{model.safetensors, trainer_state.pt, <name>.json for each `extra` item (the
        driver's buffer and prompt-stream state)}, written to a temporary folder and renamed into place
        (atomic: all or nothing), then root/latest is replaced atomically. With several data-parallel ranks
        every rank calls it: rank 0 writes all of that, each other rank its ZeRO optimizer partition
        (optimizer-rank<r>.pt; stage 0 state is the same on every rank), and rank 0 renames once all have."""
        import json

        import torch.distributed as dist

        root = Path(root)
        rank = dist.get_rank() if self.world_size > 1 else 0
        tag = [os.getpid()]  # rank 0's pid names the one temporary folder of all ranks
        if self.world_size > 1:
            dist.broadcast_object_list(tag, src=0)
        final = root / f"step-{self.step:08d}"
        tmp = root / f".tmp-step-{self.step:08d}-{tag[0]}"
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        self._barrier()
        if rank == 0:
            save_checkpoint(self.model, tmp / "model.safetensors", args=getattr(self.model, "args", None))
            state = {"optimizer": self._optimizer().state_dict(), "step": self.step, "rng": torch.get_rng_state(),
                     "world_size": self.world_size}  # fmt: skip
            torch.save(state, tmp / "trainer_state.pt")
            for name, payload in (extra or {}).items():
                (tmp / f"{name}.json").write_text(json.dumps(payload))
        elif self.cfg.zero_stage:
            torch.save(self._optimizer().state_dict(), tmp / f"optimizer-rank{rank}.pt")
        self._barrier()
        if rank == 0:
            for f in tmp.iterdir():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            latest_tmp = root / f".latest.tmp{os.getpid()}"
            latest_tmp.write_text(final.name)
            os.replace(latest_tmp, root / "latest")
        self._barrier()
        return final

    def load(self, path: str | os.PathLike) -> None:
        """Restore from a step folder, or from a root holding `latest`. ZeRO partitions need the data-parallel
        size they were saved with."""
        path = Path(path)
        if (path / "latest").exists():
            path = path / (path / "latest").read_text().strip()
        load_checkpoint(self.model, path / "model.safetensors")
        state = torch.load(path / "trainer_state.pt", map_location=self.device, weights_only=False)
        if self.cfg.zero_stage:  # ZeRO's optimizer takes one state per data-parallel rank of the saving run
            saved = state.get("world_size", 1)
            if saved != self.world_size:
                raise ValueError(f"{path} holds ZeRO optimizer partitions of {saved} ranks, this run has "
                                 f"{self.world_size}: resume with as many learner ranks")  # fmt: skip
            parts = [state["optimizer"]] + [
                torch.load(path / f"optimizer-rank{r}.pt", map_location=self.device, weights_only=False)
                for r in range(1, saved)
            ]
            self._optimizer().load_state_dict(parts, load_from_fp32_weights=True)
        else:
            self.optimizer.load_state_dict(state["optimizer"])
        self.step = state["step"]
        torch.set_rng_state(state["rng"].cpu())
