"""DeepSeek-ViT, the 3×3 pixel-unshuffle aligner, and the merge of image features into the text
embeddings (model_reference §3.15), with the official parameter names (`vision.*`, `aligner.*`,
`image_start` / `image_newline` / `image_end` live on the Transformer).

Not here: pixel preprocessing and span construction (`model/image_processor.py`), the language
model itself, and any batching of images across sequences (each image runs through the ViT alone,
as in the reference, because images differ in size and attention is over the whole image).

Shape legend: N patches of one image (n_h·n_w), C vision dim, H vision heads, Dh = C/H,
L aligner rows (n_llm_h·n_llm_w), D model dim, B batch, S sequence.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from model.config import ModelArgs
from model.image_processor import ProcessedImage, span_token_types
from model.norm import RMSNorm
from model.tokenizer import IMAGE, IMAGE_END, IMAGE_NEW_LINE, IMAGE_START

VISION_NORM_EPS = 1e-6
# Transformer attribute names of the learned delimiter vectors [D], by the token type they fill.
DELIMITER_NAMES: dict[int, str] = {
    IMAGE_START: "image_start",
    IMAGE_NEW_LINE: "image_newline",
    IMAGE_END: "image_end",
}


# ------------------------------------------------------------------ 2D RoPE
def vision_rope_angles(n_h: int, n_w: int, rope_dim: int, theta: float) -> torch.Tensor:
    """fp32 [n_h·n_w, rope_dim] angles; patch (r, c) in row-major order gets
    `[r·inv_freq, c·inv_freq]` with inv_freq = theta^(-2i/rope_dim), i < rope_dim/2."""
    # 1/theta^x rather than theta^-x: the reference's form, so the fp32 table matches to the bit
    inv_freq = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
    rows = torch.arange(n_h, dtype=torch.float32).repeat_interleave(n_w)
    cols = torch.arange(n_w, dtype=torch.float32).repeat(n_h)
    return torch.cat([rows[:, None] * inv_freq, cols[:, None] * inv_freq], dim=-1)


def apply_rope_2d(x_NHK: torch.Tensor, angles_NR: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE over the whole head (K = Dh = 2R): x1 = first half, x2 = second half,
    `[x1·cos − x2·sin, x2·cos + x1·sin]`, computed in fp32 and cast back. Unlike the LM's
    interleaved pairs on the last rope dims (§3.3), this is the ViT's own convention."""
    cos, sin = angles_NR.cos().unsqueeze(1), angles_NR.sin().unsqueeze(1)
    x1, x2 = x_NHK.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x_NHK.dtype)


# ------------------------------------------------------------------ ViT
class VisionRMSNorm(RMSNorm):
    """The LM's RMSNorm with the ViT's eps (1e-6) and an fp32 weight, as the reference holds it."""

    def __init__(self, dim: int, eps: float = VISION_NORM_EPS):
        super().__init__(dim, eps)
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))


class PatchEmbed(nn.Module):
    """`proj`: Linear(3·p² → C, bias) on channel-major flattened patches. No CLS, no absolute PE."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.proj = nn.Linear(3 * args.vision_patch_size**2, args.vision_dim)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        # preprocessing yields bf16; a model held in another dtype (fp32 CPU training) takes its own
        return self.proj(patches.flatten(1).to(self.proj.weight.dtype))


class VisionAttention(nn.Module):
    """Bidirectional multi-head attention over one image: `wqkv` (bias) → 2D RoPE on q, k →
    SDPA with the default 1/sqrt(Dh) scale → `wo` (bias)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads = args.vision_n_heads
        self.head_dim = args.vision_dim // args.vision_n_heads
        self.wqkv = nn.Linear(args.vision_dim, 3 * args.vision_dim)
        self.wo = nn.Linear(args.vision_dim, args.vision_dim)

    def forward(self, x_NC: torch.Tensor, angles_NR: torch.Tensor) -> torch.Tensor:
        N = x_NC.size(0)
        # the projection's output is [q of all heads | k | v], each head-major
        q_NHK, k_NHK, v_NHK = (t.view(N, self.n_heads, self.head_dim) for t in self.wqkv(x_NC).chunk(3, dim=-1))
        q_NHK, k_NHK = apply_rope_2d(q_NHK, angles_NR), apply_rope_2d(k_NHK, angles_NR)
        o_HNK = F.scaled_dot_product_attention(q_NHK.transpose(0, 1), k_NHK.transpose(0, 1), v_NHK.transpose(0, 1))
        return self.wo(o_HNK.transpose(0, 1).reshape(N, -1))


class VisionMLP(nn.Module):
    """SwiGLU without bias or clamps: `w1` → [gate | up] (2·inter), silu(gate)·up, `w2`."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.w1 = nn.Linear(args.vision_dim, 2 * args.vision_inter_dim, bias=False)
        self.w2 = nn.Linear(args.vision_inter_dim, args.vision_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w1(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class VisionBlock(nn.Module):
    """Pre-norm block: `x += attn(norm1(x)); x += mlp(norm2(x))`."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.norm1 = VisionRMSNorm(args.vision_dim)
        self.attn = VisionAttention(args)
        self.norm2 = VisionRMSNorm(args.vision_dim)
        self.mlp = VisionMLP(args)

    def forward(self, x_NC: torch.Tensor, angles_NR: torch.Tensor) -> torch.Tensor:
        x_NC = x_NC + self.attn(self.norm1(x_NC), angles_NR)
        return x_NC + self.mlp(self.norm2(x_NC))


class ViT(nn.Module):
    """DeepSeek-ViT: `patch_embed`, `blocks.{b}`, final `norm`; one image per call."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        C, H = args.vision_dim, args.vision_n_heads
        # rotate-half needs an even head; each half holds a row part and a column part of R/2 freqs
        if C % H or (C // H) % 4:
            raise ValueError(f"vision_dim={C} / vision_n_heads={H} must give a head dim divisible by 4")
        self.rope_dim = C // H // 2
        self.rope_theta = args.vision_rope_theta
        self.patch_embed = PatchEmbed(args)
        self.blocks = nn.ModuleList(VisionBlock(args) for _ in range(args.vision_n_layers))
        self.norm = VisionRMSNorm(C)

    def forward(self, patches: torch.Tensor, n_h: int, n_w: int) -> torch.Tensor:
        """patches [n_h·n_w, 3·p²] (or [N, 3, p, p]) in row-major grid order -> features [N, C]."""
        if patches.size(0) != n_h * n_w:
            raise ValueError(f"{patches.size(0)} patches for a {n_h}x{n_w} grid")
        x_NC = self.patch_embed(patches)
        angles_NR = vision_rope_angles(n_h, n_w, self.rope_dim, self.rope_theta).to(x_NC.device)
        for block in self.blocks:
            x_NC = block(x_NC, angles_NR)
        return self.norm(x_NC)

    def reset_parameters(self) -> None:
        """Biases 0 and norms 1; Linear weights are drawn by the caller's init (Transformer.init_weights
        visits every nn.Linear after this module)."""
        _zero_biases_and_reset_norms(self)


# ------------------------------------------------------------------ aligner
def pixel_unshuffle(x_NC: torch.Tensor, n_h: int, n_w: int, r: int) -> torch.Tensor:
    """[n_h·n_w, C] -> [ceil(n_h/r)·ceil(n_w/r), C·r²]: zero-pad bottom/right to multiples of r,
    then every r×r block becomes one row (row-major block order) whose features are channel-major,
    index `c·r² + r·ki + kj` (F.unfold's layout)."""
    x_CHW = x_NC.reshape(n_h, n_w, -1).permute(2, 0, 1)
    x_CHW = F.pad(x_CHW, (0, -n_w % r, 0, -n_h % r))
    return F.unfold(x_CHW.unsqueeze(0), kernel_size=r, stride=r).squeeze(0).transpose(0, 1)


class Aligner(nn.Module):
    """Projector ViT → LM: pixel-unshuffle r×r, `w1` (C·r² → D, bias), exact GELU, `w2` (D → D, bias)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.downsample_ratio = args.vision_downsample_ratio
        self.w1 = nn.Linear(args.vision_dim * self.downsample_ratio**2, args.dim)
        self.w2 = nn.Linear(args.dim, args.dim)

    def forward(self, x_NC: torch.Tensor, n_h: int, n_w: int) -> torch.Tensor:
        """ViT features [n_h·n_w, C] -> LM rows [L, D] in reading order of the token grid."""
        return self.w2(F.gelu(self.w1(pixel_unshuffle(x_NC, n_h, n_w, self.downsample_ratio))))

    def reset_parameters(self) -> None:
        _zero_biases_and_reset_norms(self)


def _zero_biases_and_reset_norms(module: nn.Module) -> None:
    if any(p.is_meta for p in module.parameters()):  # shape-only model: nothing to initialise
        return
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, nn.Linear) and m.bias is not None:
                m.bias.zero_()
            elif isinstance(m, VisionRMSNorm):
                m.reset_parameters()


# ------------------------------------------------------------------ merge into the text embeddings
def encode_image(image: ProcessedImage, vision: ViT, aligner: Aligner) -> torch.Tensor:
    """LM rows [n_llm_h·n_llm_w, D] of one preprocessed image (with autograd)."""
    r = aligner.downsample_ratio
    if (-(-image.n_vit_h // r), -(-image.n_vit_w // r)) != (image.n_llm_h, image.n_llm_w):
        raise ValueError(
            f"image grid {image.n_vit_h}x{image.n_vit_w} patches does not give {image.n_llm_h}x{image.n_llm_w} "
            f"tokens with downsample ratio {r}"
        )
    device = aligner.w1.weight.device
    return aligner(vision(image.patches.to(device), image.n_vit_h, image.n_vit_w), image.n_vit_h, image.n_vit_w)


def embed_images(
    h_BSD: torch.Tensor,
    images: Sequence[ProcessedImage],
    token_types_BS: torch.Tensor,
    vision: ViT,
    aligner: Aligner,
    delimiters: Mapping[str, torch.Tensor],
    start_pos: int = 0,
) -> torch.Tensor:
    """Text embeddings with every image span overwritten (a new tensor; autograd reaches the ViT,
    the aligner and the delimiters).

    Spans are found in `token_types_BS` (TEXT -1 / IMAGE_START 0 / IMAGE 1 / IMAGE_NEW_LINE 2 /
    IMAGE_END 3) at each IMAGE_START, in row-major order, and matched to `images` in that order;
    each must be exactly `span_token_types(n_llm_h, n_llm_w)` of its image. Delimiters get
    `delimiters[name]` (names in DELIMITER_NAMES), IMAGE slots the aligner rows in reading order.
    Images exist only in the start_pos-0 chunk (spec §3.1): the whole span must be prefilled at once.
    """
    has_image_tokens = bool((token_types_BS >= 0).any())
    if not images and not has_image_tokens:
        return h_BSD
    if start_pos != 0:
        raise ValueError(f"images must be in the first (start_pos 0) chunk, got start_pos={start_pos}")
    starts = (token_types_BS == IMAGE_START).nonzero().tolist()  # row-major order
    if len(starts) != len(images):
        raise ValueError(f"token_types hold {len(starts)} image spans but {len(images)} images were given")
    S = token_types_BS.size(1)
    rows, cols, values = [], [], []
    n_span_tokens = 0
    for (b, s), image in zip(starts, images, strict=True):
        expected = torch.tensor(span_token_types(image.n_llm_h, image.n_llm_w), device=token_types_BS.device)
        n = expected.numel()
        if s + n > S or not torch.equal(token_types_BS[b, s : s + n], expected):
            raise ValueError(
                f"image span at row {b}, position {s} is not the {image.n_llm_h}x{image.n_llm_w} layout "
                f"of its image ({n} positions, must lie wholly inside this chunk)"
            )
        n_span_tokens += n
        types = expected.tolist()
        for t, name in DELIMITER_NAMES.items():
            pos = [s + i for i, ti in enumerate(types) if ti == t]
            rows += [b] * len(pos)
            cols += pos
            values.append(delimiters[name].to(h_BSD.dtype).expand(len(pos), -1))
        pos = [s + i for i, ti in enumerate(types) if ti == IMAGE]
        rows += [b] * len(pos)
        cols += pos
        values.append(encode_image(image, vision, aligner).to(h_BSD.dtype))
    if n_span_tokens != int((token_types_BS >= 0).sum()):
        raise ValueError("token_types mark image positions outside any complete image span")
    index = torch.tensor(rows, device=h_BSD.device), torch.tensor(cols, device=h_BSD.device)
    return h_BSD.index_put(index, torch.cat(values).to(h_BSD.device))
