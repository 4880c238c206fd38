"""The learner: a V4.1 model and its family optimiser inside a DeepSpeed engine, one `train_step` per
optimiser update over any number of packed micro-batches, and atomic checkpoints.

Losses are token-sums over a GLOBAL denominator (valid tokens of all micro-batches on all ranks), so
gradients are exact regardless of packing; DeepSpeed's data-parallel mean is undone by scaling with
the world size. The engine drives one client optimizer, `rl.optim.FamilyOptimizer` (Muon / Sinkhorn
/ AdamW by family): ZeRO stage 0 only for now, since ZeRO 1-3 flatten parameters and would hide the
per-tensor families from it. Runs on CPU with gloo (tests) and on GPUs with NCCL.
Not here: rollouts, Ray actors, weight sync, DSpark losses.
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
from torch import nn

from model.checkpoint import load_checkpoint, save_checkpoint
from model.moe import update_expert_bias
from model.transformer import TransformerOutput
from rl.config import TrainerConfig
from rl.losses import balance_terms, indexer_term, opd_reverse_kl, policy_loss, sft_loss, token_logprobs
from rl.optim import build_optimizer
from rl.payloads import TrainBatch


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
    logp = token_logprobs(out.logits, batch.input_ids)
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


LOSS_KINDS: dict[str, LossFn] = {"sft": _sft, "rl": _rl, "opd": _opd}


class Learner:
    """Owns the DeepSpeed engine. `model` must be a `model.transformer.Transformer` (or anything with
    the same forward contract and an `args` attribute), with initialised weights."""

    def __init__(self, model: nn.Module, cfg: TrainerConfig, ds_overrides: dict[str, Any] | None = None):
        import deepspeed

        if cfg.zero_stage != 0:
            # ZeRO flattens parameters, and the per-family optimiser (Muon per head, Sinkhorn rows,
            # sparse Engram rows) needs them per tensor; sharded learners are issue 11's work
            raise ValueError(
                f"trainer.zero_stage={cfg.zero_stage} is not supported by the per-family optimiser yet: "
                "run with trainer.zero_stage=0"
            )
        ensure_distributed()
        self.cfg = cfg
        self.model = model
        self.optimizer = build_optimizer(model, cfg.optim)
        ds_config = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": cfg.zero_stage},
            "gradient_clipping": cfg.grad_clip,
            "steps_per_print": 10**9,
            **(ds_overrides or {}),
        }
        self.engine, _, _, _ = deepspeed.initialize(model=model, optimizer=self.optimizer, config=ds_config)
        self.device = next(model.parameters()).device
        self.step = 0

    @property
    def world_size(self) -> int:
        import torch.distributed as dist

        return dist.get_world_size() if dist.is_initialized() else 1

    def global_counts(self, batches: list[TrainBatch]) -> tuple[torch.Tensor, int]:
        """(Σ valid tokens, Σ micro-batches) over these micro-batches and all data-parallel ranks: the
        token-mean denominator of the losses and the mean divisor of the per-micro-batch aux terms."""
        import torch.distributed as dist

        n = torch.tensor([float(sum(b.n_tokens for b in batches)), float(len(batches))], device=self.device)
        if self.world_size > 1:
            dist.all_reduce(n)
        return n[0].clamp_min(1.0), int(n[1])

    @torch.no_grad()
    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """Token log-probs [B,S] under the current weights (π_prox for the decoupled PPO loss)."""
        self.engine.eval()
        b = batch.to(self.device)
        out = self.engine(b.input_ids, b.doc_ids, compute_indexer_loss=False)
        self.engine.train()
        return token_logprobs(out.logits, b.input_ids).masked_fill(~b.loss_mask, 0.0)

    def train_step(
        self, batches: TrainBatch | list[TrainBatch], loss_kind: str, extras: list[Any] | None = None
    ) -> dict[str, float]:
        """One optimiser update over `batches` (this rank's micro-batches); `extras[i]` is micro-batch
        i's TeacherOutput for "opd". For "rl", fill `batch.old_logprobs` with `logprobs` first.
        Metrics are global (summed over ranks: token-weighted means, loss = the global loss)."""
        totals, counts = self.accumulate_grads(batches, loss_kind, extras)
        self.engine.step()
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
        extras = extras or [None] * len(batches)
        denom, n_micro = self.global_counts(batches)
        self.engine.train()
        totals: dict[str, float] = {"loss": 0.0, "indexer_loss": 0.0, "balance_loss": 0.0}
        counts: list[torch.Tensor] = []
        for i, (mb, extra) in enumerate(zip(batches, extras)):
            mb = mb.to(self.device)
            self.engine.set_gradient_accumulation_boundary(i == len(batches) - 1)
            out = self.engine(mb.input_ids, mb.doc_ids)
            loss, metrics = fn(self, out, mb, denom, extra)
            idx = indexer_term(out.indexer_loss, self.cfg.indexer_loss_weight) / n_micro
            bal, layer_counts = balance_terms(out.router_stats, self.cfg.balance_alpha, mb.doc_ids >= 0)
            bal = bal / n_micro
            # DeepSpeed averages gradients over ranks; the losses are already global sums: undo the mean
            self.engine.backward((loss + idx + bal) * self.world_size, scale_wrt_gas=False)
            counts = layer_counts if not counts else [a + b for a, b in zip(counts, layer_counts)]
            totals["loss"] += float(loss.detach())
            totals["indexer_loss"] += float(idx.detach())
            totals["balance_loss"] += float(bal.detach())
            for k, v in metrics.items():
                totals[k] = totals.get(k, 0.0) + v * mb.n_tokens / float(denom)
        keys = sorted(k for k in totals if k != "n_tokens")
        if self.world_size > 1:
            summed = torch.tensor([totals[k] for k in keys], dtype=torch.float64, device=self.device)
            dist.all_reduce(summed)
            totals = dict(zip(keys, summed.tolist()))
        totals["n_tokens"] = float(denom)
        return totals, counts

    def _update_expert_biases(self, counts: list[torch.Tensor]) -> None:
        import torch.distributed as dist

        gates = [m.ffn.gate for m in getattr(self.model, "layers", [])]
        for gate, c in zip(gates, counts):
            if self.world_size > 1:
                dist.all_reduce(c)
            update_expert_bias(gate.bias, c, self.cfg.expert_bias_rate)

    # ------------------------------------------------------------------ checkpoints
    def save(self, root: str | os.PathLike) -> Path:
        """root/step-XXXXXXXX/{model.safetensors, trainer_state.pt}, written to a temporary folder
        and renamed into place (atomic), then root/latest is replaced atomically."""
        root = Path(root)
        final = root / f"step-{self.step:08d}"
        tmp = root / f".tmp-step-{self.step:08d}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_checkpoint(self.model, tmp / "model.safetensors", args=getattr(self.model, "args", None))
        state = {"optimizer": self.optimizer.state_dict(), "step": self.step, "rng": torch.get_rng_state()}
        torch.save(state, tmp / "trainer_state.pt")
        with open(tmp / "trainer_state.pt", "rb") as fh:
            os.fsync(fh.fileno())
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        latest_tmp = root / f".latest.tmp{os.getpid()}"
        latest_tmp.write_text(final.name)
        os.replace(latest_tmp, root / "latest")
        return final

    def load(self, path: str | os.PathLike) -> None:
        """Restore from a step folder, or from a root holding `latest`."""
        path = Path(path)
        if (path / "latest").exists():
            path = path / (path / "latest").read_text().strip()
        load_checkpoint(self.model, path / "model.safetensors")
        state = torch.load(path / "trainer_state.pt", map_location=self.device, weights_only=False)
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = state["step"]
        torch.set_rng_state(state["rng"].cpu())
