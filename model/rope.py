"""Rotary position embedding of the language model: YaRN-blended tables and interleaved rotation.

Follows spec §3.3: frequencies `base^(-2i/R)` with the YaRN ramp between `beta_fast` and
`beta_slow` when `original_seq_len > 0`, and no attention-temperature (mscale) correction.
Rotation takes adjacent pairs (x[2i], x[2i+1]) as complex numbers (not rotate-half) and is
out of place, so autograd sees an ordinary function. The ViT's 2D rotate-half RoPE lives elsewhere.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from model.config import ModelArgs


def yarn_low_high(rope_dim: int, original_seq_len: int, base: float, beta_fast: float, beta_slow: float):
    """The YaRN ramp's pair range (low, high): pairs <= low keep their frequency, pairs >= high are
    divided by the factor. Released compressed layers (R 64, base 160000, orig 65536): (15, 25)."""

    def corrected_dim(rotations: float) -> float:
        # the dim whose wavelength completes `rotations` turns over the original context
        return rope_dim * math.log(original_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(corrected_dim(beta_fast)), 0)
    high = min(math.ceil(corrected_dim(beta_slow)), rope_dim - 1)
    return low, high


def rope_inv_freq(
    rope_dim: int, original_seq_len: int, base: float, factor: float, beta_fast: float, beta_slow: float
) -> torch.Tensor:
    """fp32 [rope_dim/2] angular frequencies, YaRN-blended when original_seq_len > 0.

    The arithmetic (and its order) is the reference's, so tables match it bit for bit.
    """
    freqs = 1.0 / (base ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
    if original_seq_len > 0:
        low, high = yarn_low_high(rope_dim, original_seq_len, base, beta_fast, beta_slow)
        ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
        smooth = 1 - ramp
        freqs = freqs / factor * (1 - smooth) + freqs * smooth
    return freqs


@lru_cache(maxsize=8)
def _freqs_cis_cached(
    rope_dim: int, max_seq_len: int, original_seq_len: int, base: float, factor: float, beta_fast, beta_slow
) -> torch.Tensor:
    freqs = rope_inv_freq(rope_dim, original_seq_len, base, factor, beta_fast, beta_slow)
    angles = torch.outer(torch.arange(max_seq_len), freqs)
    return torch.polar(torch.ones_like(angles), angles)


def precompute_freqs_cis(
    rope_dim: int,
    max_seq_len: int,
    original_seq_len: int,
    base: float,
    factor: float,
    beta_fast: float,
    beta_slow: float,
) -> torch.Tensor:
    """complex64 [max_seq_len, rope_dim/2] unit phasors exp(i·pos·inv_freq) on the CPU.

    Cached per argument tuple (the model builds one table per distinct layer kind); the returned
    tensor is a fresh clone so callers may move or modify it.
    """
    assert rope_dim % 2 == 0, f"rope_dim {rope_dim} must be even"
    table = _freqs_cis_cached(rope_dim, max_seq_len, original_seq_len, base, factor, beta_fast, beta_slow)
    return table.clone()


def rope_tables_for_layer(args: ModelArgs, layer_id: int) -> torch.Tensor:
    """The table layer `layer_id` rotates everything with (q, window K, compressed latents, indexer q/k).

    Layers with compress ratio > 0 use `compress_rope_theta` with YaRN; ratio-0 layers (SWA-only
    layers and the DSpark stages) use `rope_theta` with YaRN off (spec §3.3, trap 2).
    """
    if args.compress_ratio(layer_id) > 0:
        base, original_seq_len = args.compress_rope_theta, args.original_seq_len
    else:
        base, original_seq_len = args.rope_theta, 0
    return precompute_freqs_cis(
        args.rope_head_dim, args.max_seq_len, original_seq_len, base, args.rope_factor, args.beta_fast,
        args.beta_slow,
    )  # fmt: skip


def apply_rotary_emb(x: torch.Tensor, freqs_cis: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the last R dims of `x`; any dims before them pass through.

    `freqs_cis`: the table's rows, as complex64 phasors [..., R/2] (`precompute_freqs_cis`) or as their
    real view [..., R/2, 2] of (cos, sin) (`torch.view_as_real`, what the Transformer keeps: inductor does
    not generate code for complex ops, so a compiled step would run every complex op as a kernel of its own).
    Broadcasting contract (batch first, sequence second), shapes of the complex form:
    * x is [B, S, ..., D] with D >= R: dim 1 is the sequence, every dim between it and the last
      is a head dim (e.g. [B, S, D] for a shared KV head, [B, S, H, D] for query heads).
    * freqs_cis is [S, R/2] (the same positions for every row) or [B or 1, S, R/2] (per-row
      positions, e.g. batched decode at different lengths); it is broadcast over the head dims.
    Pairs (x[2i], x[2i+1]) of the rotated slice are one complex number, multiplied by freqs_cis
    (its conjugate when `inverse`), written out in real arithmetic. Computed in fp32, returned in x's
    dtype as a new tensor.
    """
    f = torch.view_as_real(freqs_cis) if freqs_cis.is_complex() else freqs_cis
    assert f.size(-1) == 2, f"a real rope table ends in (cos, sin) pairs, got shape {tuple(f.shape)}"
    half = f.size(-2)
    rope_dim = 2 * half
    assert x.size(-1) >= rope_dim, f"x last dim {x.size(-1)} < rope dim {rope_dim}"
    assert x.ndim >= 3, f"x must be [B, S, ..., D], got shape {tuple(x.shape)}"
    seqlen, heads = x.size(1), [1] * (x.ndim - 3)
    if f.ndim == 3:
        assert f.size(0) == seqlen, f"freqs_cis has {f.size(0)} positions, x has {seqlen}"
        f = f.reshape(1, seqlen, *heads, half, 2)
    else:
        ok = f.ndim == 4 and f.size(0) in (1, x.size(0)) and f.size(1) == seqlen
        assert ok, f"freqs_cis {tuple(f.shape[:-1])} does not fit x {tuple(x.shape)}"
        f = f.reshape(f.size(0), seqlen, *heads, half, 2)
    cos, sin = f[..., 0], f[..., 1]
    if inverse:
        sin = -sin
    xr = x[..., -rope_dim:].float().unflatten(-1, (-1, 2))
    x0, x1 = xr[..., 0], xr[..., 1]
    y = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).flatten(-2).to(x.dtype)
    if rope_dim == x.size(-1):
        return y
    return torch.cat([x[..., :-rope_dim], y], dim=-1)
