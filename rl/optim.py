"""Optimisers by parameter family (DESIGN.md §3): explicit name rules on official tensor names assign
every trainable parameter to exactly one family, and one torch Optimizer facade steps all of them.

- "muon": 2-D hidden weights. The update of DeepSpeed's `muon_update` (Nesterov momentum, Newton-Schulz
  in `ns_compute_dtype`, its aspect-ratio scale, its per-head mode for Q-style projections: `attn.wq_b`
  per attention head, `indexer.wq_b` per indexer head), batched: every matrix (or head block) of one
  shape goes through one stacked Newton-Schulz run (`muon_bucket_update`) instead of one call per
  matrix, whose per-call costs dominated the step on CPU and launch-bound it on a GPU (an MoE layer's
  experts share a shape). tests/rl/test_optim_batched.py holds it equal to DeepSpeed's per-matrix one.
- "sinkhorn": embedding, output head and Engram tables. Momentum, then the touched rows' update is
  Sinkhorn-balanced (alternate row/column RMS normalisation, SinkGD: arXiv 2502.06742); only rows
  with a gradient move, and Engram's sparse COO gradients are consumed as such.
- "adamw": norms, biases, scalars, hc_* mixes, attn_sink, Engram gains (DeepSpeed's `adam_update`,
  written with torch._foreach_* ops over all the family's tensors at once).

One facade instead of three optimisers because a DeepSpeed engine drives a single client optimizer.
State stays per parameter (`momentum_buffer`; `exp_avg`, `exp_avg_sq`, `step`) whatever the batching, so
checkpoints keep one layout.

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

import functools
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


# DeepSpeed's quintic Newton-Schulz coefficients (original_muon.py, after Keller Jordan's Muon)
NS_COEFFS = (3.4445, -4.7750, 2.0315)
# the Gram iteration restarts from X at this step, to bound its half-precision error (DeepSpeed's rule)
NS_GRAM_RESTART = 2


def newton_schulz(G: torch.Tensor, steps: int, method: str) -> torch.Tensor:
    """DeepSpeed's `zeropower_via_newtonschulz5` ("standard") / `zeropower_via_gram_newtonschulz` ("gram")
    over a stack G [N, r, c] of matrices, each normalised by its own Frobenius norm. The same iterates in
    the same dtype (`ns_compute_dtype`); each `b·A + c·A@A` and `a·X + B@X` is one baddbmm (one rounding
    instead of three, and no extra pass over the stack). Returns [N, r, c] in the compute dtype."""
    from deepspeed.runtime.zero.muon.original_muon import ns_compute_dtype

    a, b, c = NS_COEFFS
    dtype = ns_compute_dtype(method)
    tall = G.size(-2) > G.size(-1)
    if method == "gram":  # normalise before the cast: fp16 would overflow on a large fp32 gradient
        X = G.to(torch.float32 if G.dtype == torch.float16 else G.dtype)
        X = X.mT if tall else X
        X = (X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)).to(dtype)
    else:
        X = G.to(dtype)
        X = X.mT if tall else X
        X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    if method == "standard" or X.size(-1) <= X.size(-2):  # square: the Gram form saves nothing
        for _ in range(steps):
            A = X @ X.mT
            X = torch.baddbmm(X, torch.baddbmm(A, A, A, beta=b, alpha=c), X, beta=a)
        return X.mT if tall else X
    # Gram form: iterate on the small square R = X Xᵀ and accumulate the polynomial Q, X_k = Q X
    R, Q = X @ X.mT, None
    for i in range(steps):
        if i == NS_GRAM_RESTART:
            X, Q = Q @ X, None
            R = X @ X.mT
        Z = torch.baddbmm(R, R, R, beta=b, alpha=c)
        if Q is None:
            Q = Z.clone()
            Q.diagonal(dim1=-2, dim2=-1).add_(a)
        else:
            Q = torch.baddbmm(Q, Z, Q, beta=a)
        if i < steps - 1 and i + 1 != NS_GRAM_RESTART:
            RZ = torch.baddbmm(R, Z, R, beta=a)
            R = torch.baddbmm(RZ, Z, RZ, beta=a)
    return X.mT @ Q.mT if tall else Q @ X


def muon_bucket_update(
    G: torch.Tensor, M: torch.Tensor, finite: torch.Tensor, beta: float, steps: int, method: str, per_head: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSpeed's `muon_update` (nesterov) over a stack of same-shape blocks G, M [N, r, c] (whole matrices,
    or with `per_head` the heads' row blocks of per-head projections): -> (new momentum, update), both
    [N, r, c] in G's dtype. `finite` [N] says whether the block's PARAMETER had a finite gradient: where not,
    the momentum is kept, and a whole matrix's update is the (non-finite) Nesterov blend; DeepSpeed's
    per-head path returns the orthogonalised blend either way, and so does this. G is consumed."""
    ok = finite[:, None, None]
    M = torch.where(ok, M.lerp(G, 1 - beta), M)
    U = G.lerp_(M, beta)
    rows, cols = U.shape[-2:]
    scale = math.sqrt(rows / cols) if rows > cols else 1.0  # DeepSpeed's _aspect_ratio_scale of the block
    X = (newton_schulz(U, steps, method) * scale).to(U.dtype)
    return M, X if per_head else torch.where(ok, X, U)


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
            if group["family"] == "muon":
                self._muon(group)
            elif group["family"] == "adamw":
                self._adamw(group)
            else:
                for p in group["params"]:
                    if p.grad is not None:
                        self._sinkhorn(p, group)
        return loss

    def _muon(self, group: dict) -> None:
        """Every Muon matrix with a gradient, bucketed by block shape (rows per head when per-head), one
        `muon_bucket_update` per bucket; momentum stays one buffer per parameter."""
        buckets: dict[tuple, list[torch.Tensor]] = {}
        for p, heads in zip(group["params"], group["num_heads"]):
            if p.grad is None:
                continue
            rows, cols = p.shape
            if heads is not None and (heads < 1 or rows % heads):
                raise ValueError(f"per-head Muon needs rows {rows} to split evenly across num_heads={heads}")
            n_blocks = heads or 1
            key = (rows // n_blocks, cols, n_blocks, heads is not None, p.grad.dtype, p.device)
            buckets.setdefault(key, []).append(p)
            if not self.state[p]:
                self.state[p]["momentum_buffer"] = torch.zeros_like(p)
        for (rows, cols, n_blocks, per_head, _, device), params in buckets.items():
            # torch.compile costs seconds per shape on CPU; eager there (and when asked)
            eager = device.type == "cpu" or not self.cfg.compile_muon
            update = muon_bucket_update if eager else _compiled_muon_bucket_update()
            bufs = [self.state[p]["momentum_buffer"] for p in params]
            G = torch.cat([p.grad.reshape(-1, rows, cols) for p in params])  # a copy: .grad stays as it was
            M = torch.cat([b.reshape(-1, rows, cols) for b in bufs])
            # DeepSpeed's finiteness guard is per parameter: a head block follows its whole matrix
            finite = torch.isfinite(G).flatten(1).all(1).view(-1, n_blocks).all(1).repeat_interleave(n_blocks)
            M, U = update(G, M, finite, self.cfg.momentum, self.cfg.ns_steps, self.cfg.ns_method, per_head)
            torch._foreach_copy_(bufs, [m.view_as(b) for m, b in zip(M.split(n_blocks), bufs)])
            if group["weight_decay"]:
                torch._foreach_mul_(params, 1 - group["lr"] * group["weight_decay"])
            updates = [u.view_as(p).to(p.dtype) for u, p in zip(U.split(n_blocks), params)]
            torch._foreach_add_(params, updates, alpha=-group["lr"])

    def _sinkhorn(self, p: torch.Tensor, group: dict) -> None:
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

    def _adamw(self, group: dict) -> None:
        """DeepSpeed's `adam_update` over all the family's tensors with a gradient, as foreach ops (one call
        per op for all tensors), grouped by their step count (a tensor steps only when it has a gradient)."""
        b1, b2, eps, lr = self.cfg.beta1, self.cfg.beta2, self.cfg.eps, group["lr"]
        by_step: dict[int, list[torch.Tensor]] = {}
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                state["exp_avg"], state["exp_avg_sq"], state["step"] = torch.zeros_like(p), torch.zeros_like(p), 0
            state["step"] += 1
            by_step.setdefault(state["step"], []).append(p)
        for step, params in by_step.items():
            grads = [p.grad for p in params]
            m = [self.state[p]["exp_avg"] for p in params]
            v = [self.state[p]["exp_avg_sq"] for p in params]
            torch._foreach_lerp_(m, grads, 1 - b1)
            torch._foreach_lerp_(v, torch._foreach_mul(grads, grads), 1 - b2)
            denom = torch._foreach_div(v, 1 - b2**step)
            torch._foreach_sqrt_(denom)
            torch._foreach_add_(denom, eps)
            update = torch._foreach_div(m, 1 - b1**step)
            torch._foreach_div_(update, denom)
            if group["weight_decay"]:
                torch._foreach_mul_(params, 1 - lr * group["weight_decay"])
            torch._foreach_add_(params, update, alpha=-lr)


@functools.cache
def _compiled_muon_bucket_update():
    """`muon_bucket_update` under torch.compile (`compile_muon` off the CPU), built on first use."""
    return torch.compile(muon_bucket_update)


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> FamilyOptimizer:
    return FamilyOptimizer(build_param_groups(model), cfg, getattr(model, "args", None))


def build_zero_optimizer(model: nn.Module, cfg: OptimConfig):
    """DeepSpeed's MuonWithAuxAdam for ZeRO 1/2: the Muon family tagged `use_muon` (with `muon_num_heads`
    per Q-style projection), Sinkhorn and AdamW families as one AdamW group. Raises for parameters
    with sparse gradients (Engram tables), which ZeRO cannot partition."""
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam

    if cfg.schedule != "constant":
        raise ValueError(
            f"trainer.optim.schedule={cfg.schedule!r} is applied by FamilyOptimizer (trainer."
            "zero_stage=0); DeepSpeed's MuonWithAuxAdam under ZeRO 1/2 runs a constant lr: set "
            "trainer.optim.schedule=constant or trainer.zero_stage=0"
        )
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
