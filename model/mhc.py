"""Single-Pass manifold-constrained hyper-connections (mHC) as pure functions (spec §3.2).

The residual stream is `hc_mult` parallel copies [..., hc, D]. Each sub-block derives (pre, post,
comb) from the stream before it: `pre` collapses the copies into the sub-layer input, `post`
spreads the sub-layer output back, and `comb` (doubly stochastic via Sinkhorn) mixes the residual
copies, applied transposed. The Block owns the fp32 parameters `hc_{attn,ffn}_{fn,base,scale}` and
the single-pass bookkeeping (which sub-block's `pre` feeds which input); this file holds only math.
"""

import math

import torch


def hc_mixes(x: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """Raw mixing logits: [..., hc, D] stream, fn [(2+hc)·hc, hc·D] -> fp32 [..., (2+hc)·hc].

    One RMS statistic over all hc·D values of a token (eps = norm_eps, not hc_eps) and no norm
    weight: the report folds it into `fn`.
    """
    flat = x.flatten(-2).float()
    rsqrt = torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    return torch.nn.functional.linear(flat, fn.float()) * rsqrt


def hc_split_sinkhorn(
    mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc_mult: int, iters: int, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split mixes [..., (2+hc)·hc] into pre [..., hc], post [..., hc], comb [..., hc, hc], all fp32.

    * pre  = sigmoid(m[0:hc]·scale[0] + base[0:hc]) + eps   (not normalised to 1)
    * post = 2·sigmoid(m[hc:2hc]·scale[1] + base[hc:2hc])
    * comb = m[2hc:]·scale[2] + base[2hc:] viewed row-major as [hc, hc] (comb[j, k] = element
      2hc + hc·j + k); softmax over k plus eps; one column normalisation; then iters-1 passes of
      (row, column) normalisation, eps in every denominator. The op order is the official kernel's.
    """
    hc = hc_mult
    m, scale, base = mixes.float(), scale.float(), base.float()
    pre = torch.sigmoid(m[..., :hc] * scale[0] + base[:hc]) + eps
    post = 2 * torch.sigmoid(m[..., hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
    comb = (m[..., 2 * hc :] * scale[2] + base[2 * hc :]).unflatten(-1, (hc, hc))
    comb = torch.exp(comb - comb.amax(dim=-1, keepdim=True))
    comb = comb / comb.sum(dim=-1, keepdim=True) + eps
    return pre, post, sinkhorn_normalize(comb, iters, eps)


def sinkhorn_normalize(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """One column normalisation, then iters-1 (row, column) passes: c / (Σ c + eps) each, [..., hc, hc].

    Values are exactly the plain torch composition's. The gradient is hand-written (`_SinkhornNorm`):
    autograd of the composition records ~6 nodes per pass over tiny [.., hc, hc] tensors, and at the
    default 20 iterations those node costs, not arithmetic, made it a large share of a CPU training step.
    """
    return _SinkhornNorm.apply(comb, iters, eps)


class _SinkhornNorm(torch.autograd.Function):
    """y = c / d, d = Σ_dim c + eps per pass; backward per pass: g_c = (g_y - Σ_dim g_y·y) / d."""

    @staticmethod
    def forward(ctx, comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
        dims = (-2,) + (-1, -2) * (iters - 1)
        ys, ds = [], []
        for dim in dims:
            d = _sum_keep(comb, dim) + eps
            comb = comb / d
            ys.append(comb)
            ds.append(d)
        ctx.dims = dims
        ctx.save_for_backward(*ys, *ds)
        return comb

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        n = len(ctx.dims)
        saved = ctx.saved_tensors
        for i in reversed(range(n)):
            y, d, dim = saved[i], saved[n + i], ctx.dims[i]
            g = (g - _sum_keep(g * y, dim)) / d
        return g, None, None


def _sum_keep(x: torch.Tensor, dim: int) -> torch.Tensor:
    """`x.sum(dim, keepdim=True)` over a dim of hc entries as hc-1 slice additions in index order: the
    same values as torch's sum of so few entries (sequential), without its reduction setup per call,
    which dominates on [..., hc, hc] (a tested equality, tests/model/test_mhc.py)."""
    s = x.narrow(dim, 0, 1)
    for i in range(1, x.size(dim)):
        s = s + x.narrow(dim, i, 1)
    return s


def hc_coefficients(
    x: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    *,
    norm_eps: float,
    hc_mult: int,
    iters: int,
    hc_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`hc_split_sinkhorn(hc_mixes(x, fn, norm_eps), ...)`: the reference's `Block.hc_mixes`."""
    return hc_split_sinkhorn(hc_mixes(x, fn, norm_eps), scale, base, hc_mult, iters, hc_eps)


def hc_pre(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """Collapse the copies: Σ_k pre[..., k]·x[..., k, :] in fp32, cast to x's dtype. -> [..., D].

    Written as an explicit accumulation rather than a matmul so TF32 settings cannot touch it and no
    fp32 copy of the whole stream is materialised.
    """
    pre = pre.float()
    y = pre[..., 0, None] * x[..., 0, :].float()
    for k in range(1, x.size(-2)):
        y = y + pre[..., k, None] * x[..., k, :].float()
    return y.to(x.dtype)


def hc_post(f: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """Expand back: out[..., k, :] = post[k]·f + Σ_j comb[j, k]·residual[j] (sum over the FIRST
    index of comb), in fp32, cast to f's dtype.

    f [..., D], residual [..., hc, D], post [..., hc], comb [..., hc, hc] -> [..., hc, D].
    """
    comb = comb.float()
    mixed = comb[..., 0, :, None] * residual[..., 0:1, :].float()
    for j in range(1, residual.size(-2)):
        mixed = mixed + comb[..., j, :, None] * residual[..., j : j + 1, :].float()
    return (post.float()[..., None] * f.float()[..., None, :] + mixed).to(f.dtype)


def identity_pre_mix(
    batch: int, seqlen: int, hc_mult: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """fp32 [B, S, hc] one-hot on copy 0: the first block's attention input reads stream 0 only."""
    pre = torch.zeros(batch, seqlen, hc_mult, dtype=torch.float32, device=device)
    pre[..., 0] = 1.0
    return pre


# Initial values (the reference has none: it loads trained weights). At init we want the stream
# to behave like a plain residual: pre ≈ 1/hc (the sub-layer reads the mean of the copies),
# post ≈ 1 (its output is added once to every copy) and comb ≈ identity (each copy keeps itself).
# fn is random with unit-variance mixes so every parameter receives gradient from the start, and a
# small `scale` keeps those random mixes a perturbation (±0.1 in logit space) around that point.
HC_INIT_SCALE = 0.1
HC_INIT_COMB_DIAG_LOGIT = 4.0  # softmax row [e^4, 1, 1, 1]/(e^4 + 3): 0.95 on the diagonal for hc 4


def init_hc_params(
    dim: int, hc_mult: int, generator: torch.Generator | None = None, device: torch.device | str | None = None
) -> dict[str, torch.Tensor]:
    """Initial fp32 values for one sub-block's mHC parameters:
    {"fn": [(2+hc)·hc, hc·dim], "base": [(2+hc)·hc], "scale": [3]}.

    The Block copies them into `hc_attn_*` / `hc_ffn_*`.
    """
    hc = hc_mult
    n_mix = (2 + hc) * hc
    fn = torch.randn(n_mix, hc * dim, generator=generator, dtype=torch.float32, device=device)
    fn /= math.sqrt(hc * dim)  # the normalised stream has norm sqrt(hc·dim): mixes ~ N(0, 1)
    base = torch.zeros(n_mix, dtype=torch.float32, device=device)
    base[:hc] = math.log(1 / (hc - 1)) if hc > 1 else 0.0  # sigmoid(b) = 1/hc
    # post: base 0 -> 2·sigmoid(0) = 1
    base[2 * hc :] = torch.eye(hc, dtype=torch.float32, device=device).flatten() * HC_INIT_COMB_DIAG_LOGIT
    scale = torch.full((3,), HC_INIT_SCALE, dtype=torch.float32, device=device)
    return {"fn": fn, "base": base, "scale": scale}
