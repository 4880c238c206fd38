"""KV compressor of a V4.1 kv-source layer: one RMS-normed latent per group of `ratio` tokens.

Ratio 1 is a plain projection (`norm(wkv(x))`); ratio r > 1 is per-channel softmax-gated pooling
in fp32 over the r tokens of each group (model_reference §3.5), with fp32 `wkv`/`wgate`.
Which tokens form a group comes from the caller's layout (groups restart at every document and
continue across incremental calls through the carried pending tokens). The latent is returned
RoPE-free and unquantised: RoPE, FP4 QDQ and the cache live in attention.py.

Shape legend: B batch, S new tokens, P pending tokens carried in, L = P + S, N new groups,
r ratio, D model dim, Dh head_dim.
"""

from __future__ import annotations

import torch
from torch import nn

from model.config import ModelArgs
from model.norm import RMSNorm


class Compressor(nn.Module):
    """`forward(x, tok_idx, pending) -> (latent [B,N,Dh], raw)`.

    `tok_idx_BNr` indexes the concatenation [pending tokens ; this call's tokens] (length L); row j
    lists the r tokens of new group j in order. `pending` is the (kv, score) fp32 pair of the tokens
    of a group left incomplete by the previous call ([B,P,Dh] each), None if there are none.
    `raw` is that concatenation's (kv, score) pair ([B,L,Dh] fp32; None for ratio 1), from which
    the caller keeps the tokens a later call may need (the reference's kv_state/score_state).
    """

    def __init__(self, args: ModelArgs, layer_id: int):
        super().__init__()
        self.compress_ratio = ratio = args.compress_ratio(layer_id)
        assert ratio >= 1, f"layer {layer_id} has no compressor (ratio {ratio})"
        self.head_dim = args.head_dim
        self.norm = RMSNorm(args.head_dim, args.norm_eps)
        if ratio == 1:
            self.wkv = nn.Linear(args.dim, args.head_dim, bias=False)
        else:
            # The pooling runs in fp32, so its weights are fp32 like the reference's (§3.0).
            self.wkv = nn.Linear(args.dim, args.head_dim, bias=False, dtype=torch.float32)
            self.wgate = nn.Linear(args.dim, args.head_dim, bias=False, dtype=torch.float32)

    def forward(
        self,
        x_BSD: torch.Tensor,
        tok_idx_BNr: torch.Tensor,
        pending: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        ratio = self.compress_ratio
        if ratio == 1:  # every token is its own group, in order
            return self.norm(self.wkv(x_BSD)), None
        B, N, _ = tok_idx_BNr.shape
        xf = x_BSD.float()
        kv_BLD, score_BLD = self.wkv(xf), self.wgate(xf)
        if pending is not None:
            kv_BLD = torch.cat([pending[0], kv_BLD], dim=1)
            score_BLD = torch.cat([pending[1], score_BLD], dim=1)
        flat_idx = tok_idx_BNr.reshape(B, N * ratio, 1).expand(B, N * ratio, self.head_dim)
        kv_BNrD = kv_BLD.gather(1, flat_idx).view(B, N, ratio, self.head_dim)
        score_BNrD = score_BLD.gather(1, flat_idx).view(B, N, ratio, self.head_dim)
        # Per-channel softmax over the r tokens of the group, then the weighted sum (§3.5).
        pooled_BND = (kv_BNrD * score_BNrD.softmax(dim=2)).sum(dim=2)
        return self.norm(pooled_BND.to(x_BSD.dtype)), (kv_BLD, score_BLD)
