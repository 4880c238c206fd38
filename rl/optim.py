"""Optimisers by parameter family (DESIGN.md §3): explicit name rules on official tensor names assign
every trainable parameter to exactly one family, and one torch Optimizer facade steps all of them.

- "muon": 2-D hidden weights. DeepSpeed's `muon_update` (momentum + Newton-Schulz, with its per-head
  mode for Q-style projections: `attn.wq_b` per attention head, `indexer.wq_b` per indexer head).
- "sinkhorn": embedding, output head and Engram tables. Momentum, then the touched rows' update is
  Sinkhorn-balanced (alternate row/column RMS normalisation, SinkGD: arXiv 2502.06742); only rows
  with a gradient move, and Engram's sparse COO gradients are consumed as such.
- "adamw": norms, biases, scalars, hc_* mixes, attn_sink, Engram gains (DeepSpeed's `adam_update`).

One facade instead of three optimisers because a DeepSpeed engine drives a single client optimizer.

Under ZeRO 1/2 (`build_zero_optimizer`) parameters live in flat partitions, so per-tensor families
cannot run inside the optimizer: DeepSpeed's own `MuonWithAuxAdam` takes over, whose ZeRO path
all-gathers each Muon matrix's gradient and orthogonalises it whole (per head where tagged), and AdamW
updates the flat rest. What that path lacks: Sinkhorn balancing (row-wise, but rows are split across
partitions: that family falls back to AdamW there) and sparse gradients (ZeRO copies dense gradients into
flat buffers, so models with Engram tables are refused).
The learning-rate schedule (`lr_factor`: constant, or linear warm-up then cosine decay) scales every
family's lr inside `FamilyOptimizer.step`; its step count lives in the param groups, so it is saved and
resumed with the optimiser state. Not here: the engine (rl/learner.py).
"""

from __future__ import annotations

import math
import re

import torch
from torch import nn

from model.transformer import INTENTIONALLY_FROZEN
from rl.config import OptimConfig

FAMILIES = ("muon", "sinkhorn", "adamw")

# First match wins; `ndim` None matches any rank. Every trainable parameter must match a rule.
FAMILY_RULES: tuple[tuple[str, int | None, str], ...] = (
    (r"(^|\.)hc_[a-z_]+$", None, "adamw"),  # mHC mixes: fn, base, scale
    (r"\.attn_sink$", None, "adamw"),
    (r"norm\.weight$", None, "adamw"),  # attn_norm, ffn_norm, q_norm, kv_norm, k_norm, final norm
    (r"\.bias$", None, "adamw"),
    (r"\.engram\.[qk]_weight$", None, "adamw"),  # gains (only their product is used)
    (r"(^|\.)embed\.weight$", 2, "sinkhorn"),  # token embedding, Engram hash tables
    (r"(^|\.)head\.weight$", 2, "sinkhorn"),
    (r"\.weight$", 2, "muon"),
    (r".*", 1, "adamw"),
    (r".*", 0, "adamw"),
)

# Q-style projections orthogonalised per head: name pattern -> ModelArgs field holding the head count.
MUON_HEADS: dict[str, str] = {
    r"\.attn\.wq_b\.weight$": "n_heads",
    r"\.indexer\.wq_b\.weight$": "index_n_heads",
}


def is_frozen(name: str) -> bool:
    return name.endswith(INTENTIONALLY_FROZEN)


def family_of(name: str, param: torch.Tensor) -> str:
    for pattern, ndim, family in FAMILY_RULES:
        if (ndim is None or param.ndim == ndim) and re.search(pattern, name):
            return family
    raise ValueError(f"no optimiser family rule matches {name} {tuple(param.shape)}; add one to FAMILY_RULES")


def build_param_groups(model: nn.Module) -> dict[str, list[tuple[str, nn.Parameter]]]:
    """{family: [(name, param)]} over trainable parameters; frozen ones (requires_grad False, e.g.
    INTENTIONALLY_FROZEN router biases) land in no family."""
    groups: dict[str, list[tuple[str, nn.Parameter]]] = {f: [] for f in FAMILIES}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if is_frozen(name):
            raise ValueError(f"{name} is intentionally frozen but requires grad")
        groups[family_of(name, p)].append((name, p))
    return groups


def muon_heads(name: str, args) -> int | None:
    for pattern, field in MUON_HEADS.items():
        if re.search(pattern, name):
            return getattr(args, field)
    return None


def sinkhorn_balance(u: torch.Tensor, iters: int, eps: float = 1e-8) -> torch.Tensor:
    """Alternately scale rows, then columns, of u [R,C] to unit RMS (ends on columns)."""
    for _ in range(iters):
        u = u / (u.square().mean(dim=1, keepdim=True).sqrt() + eps)
        u = u / (u.square().mean(dim=0, keepdim=True).sqrt() + eps)
    return u


def lr_factor(cfg: OptimConfig, step: int) -> float:
    """The multiple of each family's lr at optimiser step `step` (1-based): 1 for "constant"; for "cosine",
    step / warmup_steps during warm-up, then cosine from 1 to min_lr_ratio at decay_steps, flat after."""
    if cfg.schedule == "constant":
        return 1.0
    if step <= cfg.warmup_steps:
        return step / cfg.warmup_steps
    span = max((cfg.decay_steps or step) - cfg.warmup_steps, 1)
    progress = min((step - cfg.warmup_steps) / span, 1.0)
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class FamilyOptimizer(torch.optim.Optimizer):
    """One param group per family (keys: family, names, num_heads per param, lr, ...)."""

    def __init__(self, named_groups: dict[str, list[tuple[str, nn.Parameter]]], cfg: OptimConfig, args=None):
        self.cfg = cfg
        lrs = {"muon": cfg.muon_lr, "sinkhorn": cfg.sinkhorn_lr, "adamw": cfg.lr}
        groups = []
        for family, named in named_groups.items():
            if not named:
                continue
            groups.append(
                {
                    "params": [p for _, p in named],
                    "family": family,
                    "names": [n for n, _ in named],
                    "num_heads": [muon_heads(n, args) if family == "muon" and args else None for n, _ in named],
                    "lr": lrs[family] * lr_factor(cfg, 1),
                    "base_lr": lrs[family],
                    "schedule_step": 0,  # optimiser steps taken (the schedule's clock; saved with the state)
                    "weight_decay": cfg.weight_decay,
                }
            )
        super().__init__(groups, {})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            group["schedule_step"] += 1
            group["lr"] = group["base_lr"] * lr_factor(self.cfg, group["schedule_step"])
            update = {"muon": self._muon, "sinkhorn": self._sinkhorn, "adamw": self._adamw}[group["family"]]
            for p, heads in zip(group["params"], group["num_heads"]):
                if p.grad is not None:
                    update(p, group, heads)
        return loss

    def _muon(self, p: torch.Tensor, group: dict, heads: int | None) -> None:
        from deepspeed.runtime.zero.muon.original_muon import muon_update

        state = self.state[p]
        if not state:
            state["momentum_buffer"] = torch.zeros_like(p)
        # torch.compile of muon_update costs seconds per shape on CPU; eager there (and when asked).
        stance = "force_eager" if p.device.type == "cpu" or not self.cfg.compile_muon else "default"
        with torch.compiler.set_stance(stance):
            u = muon_update(
                p.grad.clone(), state["momentum_buffer"], beta=self.cfg.momentum, ns_steps=self.cfg.ns_steps,
                ns_method=self.cfg.ns_method, num_heads=heads,
            )  # fmt: skip
        p.mul_(1 - group["lr"] * group["weight_decay"])
        p.add_(u.reshape(p.shape).to(p.dtype), alpha=-group["lr"])

    def _sinkhorn(self, p: torch.Tensor, group: dict, heads: int | None) -> None:
        state = self.state[p]
        if not state:
            state["momentum_buffer"] = torch.zeros_like(p)
        buf = state["momentum_buffer"]
        g = p.grad
        if g.is_sparse:
            g = g.coalesce()
            rows, vals = g.indices()[0], g.values()
        else:
            rows = (g != 0).any(dim=1).nonzero().squeeze(1)
            vals = g[rows]
        if rows.numel() == 0:
            return
        m = buf[rows].mul_(self.cfg.momentum).add_(vals)  # lazy momentum: untouched rows keep theirs
        buf[rows] = m
        u = sinkhorn_balance(m.float(), self.cfg.sinkhorn_iters)
        w = p[rows].mul_(1 - group["lr"] * group["weight_decay"]) - group["lr"] * u.to(p.dtype)
        p[rows] = w

    def _adamw(self, p: torch.Tensor, group: dict, heads: int | None) -> None:
        from deepspeed.runtime.zero.muon.original_muon import adam_update

        state = self.state[p]
        if not state:
            state["exp_avg"], state["exp_avg_sq"], state["step"] = torch.zeros_like(p), torch.zeros_like(p), 0
        state["step"] += 1
        betas = (self.cfg.beta1, self.cfg.beta2)
        u = adam_update(p.grad, state["exp_avg"], state["exp_avg_sq"], state["step"], betas, self.cfg.eps)
        p.mul_(1 - group["lr"] * group["weight_decay"])
        p.add_(u, alpha=-group["lr"])


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> FamilyOptimizer:
    return FamilyOptimizer(build_param_groups(model), cfg, getattr(model, "args", None))


def build_zero_optimizer(model: nn.Module, cfg: OptimConfig):
    """DeepSpeed's MuonWithAuxAdam for ZeRO 1/2: the Muon family tagged `use_muon` (with `muon_num_heads`
    per Q-style projection), Sinkhorn and AdamW families as one AdamW group. Raises for parameters
    with sparse gradients (Engram tables), which ZeRO cannot partition."""
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam

    if cfg.schedule != "constant":
        raise ValueError(f"trainer.optim.schedule={cfg.schedule!r} is applied by FamilyOptimizer (trainer."
                         "zero_stage=0); DeepSpeed's MuonWithAuxAdam under ZeRO 1/2 runs a constant lr: set "
                         "trainer.optim.schedule=constant or trainer.zero_stage=0")
    sparse = [n for n, m in model.named_modules() if isinstance(m, nn.Embedding) and m.sparse]
    if sparse:
        raise ValueError(
            f"trainer.zero_stage >= 1 cannot shard sparse-gradient tables {sparse[:3]}... (Engram): ZeRO copies "
            "dense gradients into flat partitions; run with trainer.zero_stage=0 or a config without Engram layers"
        )
    groups = build_param_groups(model)
    args = getattr(model, "args", None)
    for name, p in groups["muon"]:
        p.use_muon, p.muon_num_heads = True, muon_heads(name, args) if args else None
    rest = [p for _, p in groups["adamw"] + groups["sinkhorn"]]
    for p in rest:
        p.use_muon = False
    for _, p in model.named_parameters():
        if not hasattr(p, "use_muon"):  # frozen parameters: DeepSpeed checks every parameter for the tag
            p.use_muon = False
    return MuonWithAuxAdam([
        dict(params=[p for _, p in groups["muon"]], use_muon=True, lr=cfg.muon_lr, momentum=cfg.momentum,
             weight_decay=cfg.weight_decay, ns_method=cfg.ns_method),
        dict(params=rest, use_muon=False, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
             weight_decay=cfg.weight_decay),
    ])  # fmt: skip
