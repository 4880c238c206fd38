"""RMSNorm of the language model (spec §3.0): fp32 statistics, weight applied, cast back.

Every LM norm uses `norm_eps` (1e-20 in the release); the ViT's eps-1e-6 norm is the same module
built with its own eps. No mean-centering, no bias.
"""

import torch
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`x * rsqrt(mean(x²) + eps) * weight` over the last dim in fp32, returned in x's dtype."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    # weight (bf16 in checkpoints) times an fp32 tensor promotes to fp32, as in the reference
    return (weight * x).to(dtype)


class RMSNorm(nn.Module):
    """Parameter `weight` [dim] (ones at init) in the default dtype, like the checkpoints' norms."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"
