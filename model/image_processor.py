"""Image preprocessing of model_reference §3.15: resize plan and LLM-token budget, pixels to ViT
patches, and the token span an image occupies in `input_ids` / `token_types`.

Input is a decoded uint8 RGB array [H, W, 3] (numpy or torch); reading files, URLs or base64 is
the caller's job. Resampling is bicubic: Pillow (`ImageOps.pad` / `Image.resize`, exactly the
reference) when installed, else torch's antialiased bicubic `F.interpolate`, which follows the
same kernel and geometry but may differ from Pillow by a level or two of 255 at some pixels. Both
are deterministic; `ImageProcessor.resampler` picks one explicitly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np
import torch
import torch.nn.functional as F

from model.tokenizer import IMAGE, IMAGE_END, IMAGE_NEW_LINE, IMAGE_START, TEXT

if TYPE_CHECKING:
    from model.config import ModelArgs
    from model.tokenizer import Tokenizer

PAD_GRAY = 127  # letterbox colour of ImageOps.pad in the reference


# ------------------------------------------------------------------ token budget
def num_image_tokens(n_llm_h: int, n_llm_w: int) -> int:
    """Span length: IMAGE_START + n_llm_h rows of (n_llm_w slots + IMAGE_NEW_LINE) + IMAGE_END."""
    return n_llm_h * (n_llm_w + 1) + 2


def span_token_types(n_llm_h: int, n_llm_w: int) -> list[int]:
    """token_types of one image span (equal to the types of `Tokenizer.image_span`)."""
    return [IMAGE_START] + ([IMAGE] * n_llm_w + [IMAGE_NEW_LINE]) * n_llm_h + [IMAGE_END]


def llm_grid(height: int, width: int, patch_size: int, downsample_ratio: int) -> tuple[int, int]:
    """(n_llm_h, n_llm_w) of an image resized to height×width pixels: ceil(patches / ratio)."""
    return math.ceil((height // patch_size) / downsample_ratio), math.ceil((width // patch_size) / downsample_ratio)


def solve_resize_ratio(
    height: float, width: float, patch_size: int, downsample_ratio: int, max_n_token: int
) -> tuple[int, int]:
    """Largest aspect-preserving pixel size (multiples of patch_size) whose span fits max_n_token.

    With r = h/w and a token grid of n_w columns and r·n_w rows, the cost r·n_w·(n_w+1)+2 ≤ max
    gives n_w ≤ sqrt((max−2)/r + 1/4) − 1/2. Extreme aspect ratios collapse to one column / row.
    """
    r = height / width
    max_w = math.sqrt((max_n_token - 2) / r + 0.25) - 0.5
    max_h = max_w * r
    cell = patch_size * downsample_ratio  # pixels per LLM token along each side
    if max_w < 1.0:  # very tall
        return (max_n_token - 2) // 2 * cell, cell
    if max_h < 1.0:  # very wide
        return cell, (max_n_token - 3) * cell
    beta = min(math.floor(max_w) * cell / width, math.floor(max_h) * cell / height)
    return math.floor(height * beta / patch_size) * patch_size, math.floor(width * beta / patch_size) * patch_size


@dataclass(frozen=True)
class ImagePlan:
    """Target pixel size (height, width; multiples of the patch size), the ViT patch grid and the
    LLM token grid; `plain_resize` when the wh-ratio cap applies (stretch instead of letterbox)."""

    height: int
    width: int
    n_vit_h: int
    n_vit_w: int
    n_llm_h: int
    n_llm_w: int
    plain_resize: bool

    @property
    def n_tokens(self) -> int:
        return num_image_tokens(self.n_llm_h, self.n_llm_w)


@dataclass
class ProcessedImage:
    """One image ready for the ViT: patches [n_vit_h·n_vit_w, 3·p²] bf16, row-major over the patch
    grid, each patch flattened channel-major (3, p, p); values (x/255 − 0.5)/0.5."""

    patches: torch.Tensor
    n_vit_h: int
    n_vit_w: int
    n_llm_h: int
    n_llm_w: int

    @property
    def n_tokens(self) -> int:
        return num_image_tokens(self.n_llm_h, self.n_llm_w)


# ------------------------------------------------------------------ the processor
@dataclass(frozen=True, kw_only=True)
class ImageProcessor:
    """Preprocessing constants (ModelArgs' vision_* fields) and the pipeline over them."""

    patch_size: int = 14
    downsample_ratio: int = 3
    max_n_token: int = 1024
    min_pixels: int = 544 * 544
    max_wh_ratio: float | None = None
    resampler: Literal["auto", "pil", "torch"] = "auto"

    @classmethod
    def from_args(cls, args: ModelArgs, **overrides) -> ImageProcessor:
        return cls(
            patch_size=args.vision_patch_size,
            downsample_ratio=args.vision_downsample_ratio,
            max_n_token=args.vision_max_n_token,
            min_pixels=args.vision_min_pixels,
            max_wh_ratio=args.vision_max_wh_ratio,
            **overrides,
        )

    def plan(self, height: int, width: int) -> ImagePlan:
        """Resize plan of an image of this original size (a pure function of the two)."""
        p, h, w = self.patch_size, height, width
        capped = self.max_wh_ratio is not None and w > h * self.max_wh_ratio
        if capped:
            w = h * self.max_wh_ratio
        if 0 < w * h < self.min_pixels:  # upscale small images, int() truncating as the reference
            scale = (self.min_pixels / (w * h)) ** 0.5
            w, h = int(w * scale), int(h * scale)
        best_h, best_w = math.ceil(h / p) * p, math.ceil(w / p) * p
        n_llm = llm_grid(best_h, best_w, p, self.downsample_ratio)
        if num_image_tokens(*n_llm) > self.max_n_token:
            best_h, best_w = solve_resize_ratio(h, w, p, self.downsample_ratio, self.max_n_token)
            n_llm = llm_grid(best_h, best_w, p, self.downsample_ratio)
            if num_image_tokens(*n_llm) > self.max_n_token:  # the solver's invariant
                raise RuntimeError(f"resize solver exceeded the budget for a {height}x{width} image")
        # the reference tests the cap with >= here (and > above); kept, it differs only at equality
        plain = self.max_wh_ratio is not None and width >= self.max_wh_ratio * height
        return ImagePlan(best_h, best_w, best_h // p, best_w // p, *n_llm, plain)

    def __call__(self, image: np.ndarray | torch.Tensor) -> ProcessedImage:
        """uint8 RGB [H, W, 3] -> ProcessedImage."""
        pixels = torch.as_tensor(np.asarray(image))
        if pixels.dtype != torch.uint8 or pixels.dim() != 3 or pixels.size(-1) != 3:
            raise ValueError(f"expected a uint8 RGB array [H, W, 3], got {tuple(pixels.shape)} {pixels.dtype}")
        plan = self.plan(pixels.size(0), pixels.size(1))
        fitted = fit_image(pixels, plan.height, plan.width, plan.plain_resize, self.resampler)
        p = self.patch_size
        x = fitted.permute(2, 0, 1).float() / 255
        x = ((x - 0.5) / 0.5).to(torch.bfloat16)
        patches = x.reshape(3, plan.n_vit_h, p, plan.n_vit_w, p).permute(1, 3, 0, 2, 4).reshape(-1, 3 * p * p)
        return ProcessedImage(patches, plan.n_vit_h, plan.n_vit_w, plan.n_llm_h, plan.n_llm_w)


# ------------------------------------------------------------------ resampling
def pil_available() -> bool:
    try:
        import PIL  # noqa: F401
    except ImportError:
        return False
    return True


def fit_image(
    pixels: torch.Tensor, height: int, width: int, plain_resize: bool, resampler: str = "auto"
) -> torch.Tensor:
    """uint8 [H, W, 3] -> uint8 [height, width, 3]: stretched when `plain_resize`, else resized to
    fit inside with the aspect kept and centred on PAD_GRAY (ImageOps.pad geometry)."""
    use_pil = resampler == "pil" or (resampler == "auto" and pil_available())
    if use_pil:
        from PIL import Image, ImageOps

        source = Image.fromarray(np.ascontiguousarray(pixels.numpy()))
        if plain_resize:
            out = source.resize((width, height), Image.Resampling.BICUBIC)
        else:
            out = ImageOps.pad(source, (width, height), Image.Resampling.BICUBIC, color=(PAD_GRAY,) * 3)
        return torch.from_numpy(np.array(out, dtype=np.uint8))
    if resampler not in ("auto", "torch"):
        raise ValueError(f"resampler={resampler!r}: 'auto', 'pil' or 'torch'")
    if plain_resize:
        return _resize_torch(pixels, height, width)
    H, W = pixels.shape[:2]
    out = torch.full((height, width, 3), PAD_GRAY, dtype=torch.uint8)
    # ImageOps.pad: scale the side that binds, round the other (Python round), centre with round()
    if W / H == width / height:
        return _resize_torch(pixels, height, width)
    if W / H > width / height:
        new_h = round(H / W * width)
        y = round((height - new_h) * 0.5)
        out[y : y + new_h] = _resize_torch(pixels, new_h, width)
    else:
        new_w = round(W / H * height)
        x = round((width - new_w) * 0.5)
        out[:, x : x + new_w] = _resize_torch(pixels, height, new_w)
    return out


def _resize_torch(pixels: torch.Tensor, height: int, width: int) -> torch.Tensor:
    H, W = pixels.shape[:2]
    if (H, W) == (height, width):
        return pixels.clone()
    if min(height, width) == 0:  # Pillow's contain() returns an empty image here too
        return pixels.new_empty(height, width, 3)
    x = pixels.permute(2, 0, 1).unsqueeze(0).float()
    # Pillow resamples horizontally, then vertically, rounding to uint8 between the passes; doing the
    # same (antialias=True is Pillow's a=-0.5 bicubic) keeps us within 1-2 levels of it instead of ~20
    # where the cubic overshoots.
    for size in ((H, width), (height, width)):
        if tuple(x.shape[-2:]) != size:
            x = F.interpolate(x, size=size, mode="bicubic", align_corners=False, antialias=True)
            x = x.round().clamp(0, 255)
    return x.to(torch.uint8).squeeze(0).permute(1, 2, 0).contiguous()


# ------------------------------------------------------------------ spans in input_ids
def expand_image_placeholders(
    ids: Sequence[int],
    images: Sequence[ProcessedImage],
    tokenizer: Tokenizer | None = None,
    *,
    image_token_id: int | None = None,
) -> tuple[list[int], list[int]]:
    """Replace each placeholder in `ids` by its image's span -> (ids, token_types).

    With `tokenizer`, the placeholder is `tokenizer.image_id` and spans use its distinct delimiter
    ids (`Tokenizer.image_span`). With `image_token_id` (the released tokenizer's convention) that id
    is the placeholder and fills every span position; only token_types tell the positions apart.
    """
    if (tokenizer is None) == (image_token_id is None):
        raise ValueError("give exactly one of tokenizer or image_token_id")
    placeholder = tokenizer.image_id if tokenizer is not None else image_token_id
    n_placeholders = sum(t == placeholder for t in ids)
    if n_placeholders != len(images):
        raise ValueError(f"{n_placeholders} image placeholders but {len(images)} images")
    out_ids: list[int] = []
    out_types: list[int] = []
    pending = iter(images)
    for t in ids:
        if t != placeholder:
            out_ids.append(t)
            out_types.append(TEXT)
            continue
        image = next(pending)
        if tokenizer is not None:
            span_ids, types = tokenizer.image_span(image.n_llm_h, image.n_llm_w)
        else:
            types = span_token_types(image.n_llm_h, image.n_llm_w)
            span_ids = [placeholder] * len(types)
        out_ids += span_ids
        out_types += types
    return out_ids, out_types
