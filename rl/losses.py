"""Pure loss functions of the trainers (DESIGN.md §3.1): SFT cross-entropy, the decoupled PPO policy
loss with truncated/masked importance weights, full-vocabulary OPD reverse KL with a chunked
closed-form gradient, and the indexer / MoE balance terms.

Every loss is a token-sum divided by an explicit `denominator` (the GLOBAL count of valid tokens
across ranks and micro-batches, computed by the learner); None means the local count.
Not here: optimisers, distributed reductions, DSpark losses (model/dspark.py owns those).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from model.moe import RouterStats, sequence_balance_loss
from rl.config import PolicyLossConfig


def _denominator(mask: torch.Tensor, denominator: float | torch.Tensor | None) -> torch.Tensor | float:
    if denominator is None:
        return mask.sum().clamp_min(1).to(torch.float32)
    return denominator


def at_temperature(logits: torch.Tensor, temperature: float | None) -> torch.Tensor:
    """Logits of the distribution the rollout sampled from (temperature T; None or 1: unchanged), so
    the learner's log-probs and the rollout's log-probs μ describe the same distribution."""
    return logits if temperature is None or temperature == 1.0 else logits / temperature


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """log p(input_ids[t] | <t) [B,S] fp32 from logits [B,S,V] (logits at t-1 predict token t);
    position 0 has no prediction and gets 0. Rows are independent documents per doc_ids only if the
    caller masks the first token of each document (TrainBatch.loss_mask never marks it)."""
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    tok = logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return F.pad(tok, (1, 0))


def sft_loss(
    logits: torch.Tensor,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    denominator: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Next-token cross-entropy on assistant tokens: Σ_{t: mask[t]} −log p(x_t | x_<t) / denominator.
    loss_mask [B,S] is token-aligned (True on the predicted token, as in TrainBatch)."""
    mask = loss_mask.bool()
    nll = -token_logprobs(logits, input_ids)
    return (nll * mask).sum() / _denominator(mask, denominator)


# ---------------------------------------------------------------------- decoupled PPO
def _tis_weight(w: torch.Tensor, cfg: PolicyLossConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Truncated IS: min(w, C); keeps every token. -> (weight, kept mask)."""
    return w.clamp(max=cfg.is_cap), torch.ones_like(w, dtype=torch.bool)


def _mask_weight(w: torch.Tensor, cfg: PolicyLossConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked IS: tokens whose w lies outside the band contribute nothing (the denominator keeps them)."""
    keep = (w >= cfg.is_band_low) & (w <= cfg.is_band_high)
    return torch.where(keep, w, torch.zeros_like(w)), keep


IS_WEIGHT_FNS: dict[str, Callable[[torch.Tensor, PolicyLossConfig], tuple[torch.Tensor, torch.Tensor]]] = {
    "token_tis": _tis_weight,
    "mask": _mask_weight,
}


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    n = int(mask.sum())
    return float((x * mask).sum() / n) if n else 0.0


def policy_loss(
    logp_new: torch.Tensor,
    logp_prox: torch.Tensor,
    logp_behaviour: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: PolicyLossConfig,
    denominator: float | torch.Tensor | None = None,
    logp_ref: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Decoupled PPO loss, token-sum / denominator. All inputs [B,S] (or any equal shape), log-probs of
    the sampled tokens: π_θ (grad), π_prox (recomputed by the learner before the update), μ (rollout).

    per token: w = sg(min(π_prox/μ, C)) (or band-masked), r = π_θ/π_prox,
               obj = min(r·A, clip(r, 1−ε_low, 1+ε_high)·A), with dual clip obj = max(obj, c·A) if A<0,
               loss_t = −w·obj + kl_coef·k3(π_ref‖π_θ).
    With μ = π_prox every w is 1 and the loss is plain PPO. Metrics are over valid tokens.
    """
    mask = mask.bool()
    logp_prox, logp_behaviour = logp_prox.detach(), logp_behaviour.detach()
    log_w = torch.where(mask, logp_prox - logp_behaviour, torch.zeros_like(logp_prox))
    w_raw = log_w.exp()
    w, kept = IS_WEIGHT_FNS[cfg.is_mode](w_raw, cfg)
    ratio = torch.exp(torch.where(mask, logp_new - logp_prox, torch.zeros_like(logp_new)))
    clipped_ratio = ratio.clamp(1.0 - cfg.eps_low, 1.0 + cfg.eps_high)
    surr1, surr2 = ratio * advantages, clipped_ratio * advantages
    obj = torch.minimum(surr1, surr2)
    dual = torch.zeros_like(mask)
    if cfg.dual_clip is not None:
        floor = cfg.dual_clip * advantages
        dual = (advantages < 0) & (obj < floor)
        obj = torch.where(advantages < 0, torch.maximum(obj, floor), obj)
    per_token = -w * obj
    kl = torch.zeros_like(per_token)
    if cfg.kl_coef and logp_ref is not None:
        d = torch.where(mask, logp_ref.detach() - logp_new, torch.zeros_like(logp_new))
        kl = d.exp() - d - 1.0
        per_token = per_token + cfg.kl_coef * kl
    valid = mask & kept
    loss = (per_token * valid).sum() / _denominator(mask, denominator)
    with torch.no_grad():
        clipped = (surr2 < surr1) & mask
        k1 = -log_w  # log μ − log π_prox: k1 estimator of KL(μ‖π_prox) on μ's samples
        k3 = w_raw - 1.0 - log_w
        metrics = {
            "clip_frac": _masked_mean(clipped.float(), mask),
            "dual_clip_frac": _masked_mean(dual.float(), mask),
            "is_weight_mean": _masked_mean(w_raw, mask),
            "is_weight_max": float(w_raw[mask].max()) if mask.any() else 0.0,
            "is_weight_min": float(w_raw[mask].min()) if mask.any() else 0.0,
            "is_truncated_frac": _masked_mean((w_raw > cfg.is_cap).float(), mask) * (cfg.is_mode == "token_tis"),
            "is_masked_frac": _masked_mean((~kept).float(), mask),
            "mismatch_k1": _masked_mean(k1, mask),
            "mismatch_k3": _masked_mean(k3, mask),
            "ratio_mean": _masked_mean(ratio, mask),
            "kl_ref_k3": _masked_mean(kl, mask),
            "n_tokens": float(mask.sum()),
        }
    return loss, metrics


# ---------------------------------------------------------------------- full-vocabulary OPD
def same_version_mismatch(logp_learner: torch.Tensor, logp_rollout: torch.Tensor, versions: torch.Tensor,
                          mask: torch.Tensor, version: int) -> dict[str, float]:  # fmt: skip
    """Train/rollout mismatch at equal weights: over the generated tokens that were sampled at policy
    `version` (the learner's current one), Σ|log π_learner − log μ|, Σ k3 (estimator of KL(μ‖π_learner)
    on μ's samples) and their count. Sums, so micro-batches add up; `mismatch_means` turns them into means.
    Nonzero only through what differs between the engine's and the learner's forward (execution plan,
    kernels, rounding): the reference number for trainer.simulate_replay."""
    sel = mask.bool() & (versions == version)
    d = (logp_learner.detach() - logp_rollout.detach())[sel].double()
    return {"n": float(sel.sum()), "abs": float(d.abs().sum()), "k3": float((d.exp() - 1.0 - d).sum())}


def mismatch_means(sums: list[dict[str, float]]) -> dict[str, float]:
    """`same_version_mismatch` sums -> {same_version_abs_dlogp, same_version_k3, same_version_tokens}
    (the means only when some token was sampled at the learner's version)."""
    n = sum(x["n"] for x in sums)
    out = {"same_version_tokens": n}
    if n:
        out |= {"same_version_abs_dlogp": sum(x["abs"] for x in sums) / n,
                "same_version_k3": sum(x["k3"] for x in sums) / n}  # fmt: skip
    return out


def _chunk_logits(x: torch.Tensor, head: torch.Tensor | None, lo: int, hi: int) -> torch.Tensor:
    """Logits of vocabulary slice [lo, hi): from logits x [N,V], or hidden x [N,D] @ head[lo:hi].T."""
    if head is None:
        return x[:, lo:hi].float() if x.dtype != torch.float64 else x[:, lo:hi]
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    return x.to(dtype) @ head[lo:hi].to(dtype).T


def _logsumexp_chunked(x: torch.Tensor, head: torch.Tensor | None, V: int, chunk: int) -> torch.Tensor:
    lse = None
    for lo in range(0, V, chunk):
        c = torch.logsumexp(_chunk_logits(x, head, lo, min(lo + chunk, V)), dim=-1)
        lse = c if lse is None else torch.logaddexp(lse, c)
    return lse


class _ReverseKL(torch.autograd.Function):
    """D_t = Σ_v p(v)(log p(v) − log q(v)) per row, p = student, q = teacher (stop-gradient).
    Two passes over vocab chunks (logsumexps, then the KL); backward recomputes each chunk and applies
    ∂D/∂z_k = p_k(log p_k − log q_k − D), so extra memory is O(N·chunk) beyond the inputs."""

    @staticmethod
    def forward(ctx, s_x, s_head, t_x, t_head, V: int, chunk: int):
        t_h = t_head if t_head.numel() else None
        with torch.no_grad():
            lse_s = _logsumexp_chunked(s_x, s_head, V, chunk)
            lse_t = _logsumexp_chunked(t_x, t_h, V, chunk)
            D = torch.zeros_like(lse_s)
            for lo in range(0, V, chunk):
                hi = min(lo + chunk, V)
                logp = _chunk_logits(s_x, s_head, lo, hi) - lse_s[:, None]
                logq = _chunk_logits(t_x, t_h, lo, hi) - lse_t[:, None]
                D += (logp.exp() * (logp - logq)).sum(-1)
        ctx.save_for_backward(s_x, s_head, t_x, t_head, lse_s, lse_t, D)
        ctx.V, ctx.chunk, ctx.has_head = V, chunk, s_head is not None
        return D

    @staticmethod
    def backward(ctx, grad_D):
        s_x, s_head, t_x, t_head, lse_s, lse_t, D = ctx.saved_tensors
        s_head = s_head if ctx.has_head else None
        grad_x = torch.zeros_like(s_x) if ctx.needs_input_grad[0] else None
        grad_head = torch.zeros_like(s_head) if ctx.has_head and ctx.needs_input_grad[1] else None
        for lo in range(0, ctx.V, ctx.chunk):
            hi = min(lo + ctx.chunk, ctx.V)
            logp = _chunk_logits(s_x, s_head, lo, hi) - lse_s[:, None]
            logq = _chunk_logits(t_x, t_head if t_head.numel() else None, lo, hi) - lse_t[:, None]
            g = logp.exp() * (logp - logq - D[:, None]) * grad_D[:, None]
            if s_head is None:
                if grad_x is not None:
                    grad_x[:, lo:hi] = g.to(grad_x.dtype)
                continue
            if grad_x is not None:
                grad_x += (g @ s_head[lo:hi].to(g.dtype)).to(grad_x.dtype)
            if grad_head is not None:
                grad_head[lo:hi] += (g.T @ s_x.to(g.dtype)).to(grad_head.dtype)
        return grad_x, grad_head, None, None, None, None


def opd_reverse_kl(
    student: torch.Tensor,
    teacher: torch.Tensor,
    mask: torch.Tensor,
    chunk_size: int = 4096,
    student_head: torch.Tensor | None = None,
    teacher_head: torch.Tensor | None = None,
    denominator: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Full-vocabulary per-token reverse KL(student ‖ teacher), masked token-mean.

    student: logits [...,V] or, with `student_head` [V,D], hidden [...,D] (gradients reach both);
    teacher: logits [...,V] or hidden [...,D] with `teacher_head` [V,D] (teacher logits are rebuilt
    chunk by chunk and never materialised whole); teacher gets no gradient. mask [...] bool selects
    student-visited positions (tool/observation tokens False). -> (loss, D [M] of the selected tokens).
    """
    mask = mask.bool()
    s_x = student[mask]
    t_x = teacher[mask].detach()
    V = student_head.size(0) if student_head is not None else s_x.size(-1)
    t_V = teacher_head.size(0) if teacher_head is not None else t_x.size(-1)
    if V != t_V:
        raise ValueError(f"teacher vocabulary {t_V} != student vocabulary {V}")
    t_head = teacher_head.detach() if teacher_head is not None else t_x.new_empty(0)
    D = _ReverseKL.apply(s_x, student_head, t_x, t_head, V, chunk_size)
    return D.sum() / _denominator(mask, denominator), D


# ---------------------------------------------------------------------- auxiliary terms
def indexer_term(indexer_loss: torch.Tensor, weight: float) -> torch.Tensor:
    """The model's indexer alignment loss (already a mean over index-source layers), weighted."""
    return indexer_loss * weight


def balance_terms(
    router_stats: list[RouterStats],
    alpha: float,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Σ over MoE layers of model.moe.sequence_balance_loss (alpha = 0 skips it) and the per-layer
    expert counts [E] for model.moe.update_expert_bias (aux-loss-free balancing)."""
    counts = [s.counts.detach() for s in router_stats]
    if alpha == 0 or not router_stats:
        ref = router_stats[0].scores if router_stats else torch.zeros(())
        return ref.new_zeros(()), counts
    total = 0.0
    for s in router_stats:
        E, K = s.scores.size(-1), s.topk_idx.size(-1)
        total = total + sequence_balance_loss(s.scores, s.topk_idx, E, K, alpha, mask)
    return total, counts
