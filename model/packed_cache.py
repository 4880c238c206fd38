"""The byte format of V4.1's inference caches as the report stores them, and their sizes.

Every entry is one uint8 vector, payload first, then its block scales:
  main compressed KV  FP4 E2M1 codes, two per byte (low nibble = even element), then one E4M3 scale
                      byte per 16 elements: head_dim/2 + head_dim/16 bytes (288 for 512);
  indexer key         MXFP4: E2M1 codes packed the same way, then one UE8M0 byte per 32 elements:
                      index_head_dim/2 + index_head_dim/32 bytes (68 for 128);
  window (SWA) KV     FP8 e4m3 bytes, then one UE8M0 byte per 32: head_dim + head_dim/32 bytes.
UE8M0 is the biased exponent of a power-of-two scale (2^(e-127)). Unpacking reproduces the training
fake quant bit for bit (`fp4_e4m3_fake_quant`, `mxfp4_fake_quant`, `fp8_fake_quant` of model/quant.py).
Not here: storing these bytes inside a session's cache (attention.py's LayerCache with packed=True).
"""

from __future__ import annotations

import torch

from model.config import ModelArgs
from model.quant import (
    dequantize_fp8,
    dequantize_packed_fp4,
    pack_e2m1,
    quantize_fp4_e4m3,
    quantize_fp8,
    quantize_mxfp4,
)

MAIN_KV_BLOCK = 16  # E4M3 scale per 16 elements (NVFP4 without the tensor scale)
MX_BLOCK = 32  # UE8M0 scale per 32 elements (MXFP4 index keys, FP8 window KV)


# ---------------------------------------------------------------------------- entry sizes
def main_kv_entry_bytes(head_dim: int) -> int:
    return head_dim // 2 + head_dim // MAIN_KV_BLOCK


def index_key_entry_bytes(index_head_dim: int) -> int:
    return index_head_dim // 2 + index_head_dim // MX_BLOCK


def window_entry_bytes(head_dim: int) -> int:
    return head_dim + head_dim // MX_BLOCK


def bytes_per_token(args: ModelArgs) -> float:
    """Global (persistent, prefix-cacheable) bytes per token: each kv-source layer of ratio r adds one
    main-KV entry and one index key every r tokens (every kv source is an index source). 890 for
    the released config: (288 + 68) × (3/2 + 1)."""
    per_entry = main_kv_entry_bytes(args.head_dim) + index_key_entry_bytes(args.index_head_dim)
    return sum(per_entry / args.compress_ratio(s) for s in args.kv_source_layers)


# ---------------------------------------------------------------------------- scale bytes
def _ue8m0_bytes(scale: torch.Tensor) -> torch.Tensor:
    """Power-of-two fp32 scales -> their biased exponents as uint8 (the fp32 exponent field)."""
    bits = scale.float().contiguous().view(torch.int32)
    # No check of the scales here: the quantisers make each one a power of two by construction (the
    # pack/unpack round-trip tests would see a lost mantissa bit), and reading them back to the host would
    # stall the stream on every cache write and break the CUDA graph capture of a packed decode step.
    return ((bits >> 23) & 0xFF).to(torch.uint8)


def _ue8m0_scales(exponents: torch.Tensor) -> torch.Tensor:
    return (exponents.to(torch.int32) << 23).view(torch.float32)


def _split(packed: torch.Tensor, n_payload: int) -> tuple[torch.Tensor, torch.Tensor]:
    packed = packed.view(torch.uint8)
    return packed[..., :n_payload], packed[..., n_payload:]


# ---------------------------------------------------------------------------- main compressed KV
def pack_main_kv(x: torch.Tensor) -> torch.Tensor:
    """[..., Dh] -> uint8 [..., Dh/2 + Dh/16]: E2M1 payload, then E4M3 scale bytes (one per 16)."""
    codes, scale = quantize_fp4_e4m3(x, MAIN_KV_BLOCK)
    scale_bytes = scale.to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.cat([pack_e2m1(codes), scale_bytes], dim=-1)


def unpack_main_kv(packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 [..., E] -> [..., Dh] in `dtype`, with Dh = 16·E/9 (E = Dh/2 + Dh/16)."""
    head_dim = packed.size(-1) * 16 // 9
    assert main_kv_entry_bytes(head_dim) == packed.size(-1), f"{packed.size(-1)} bytes is no main-KV entry"
    payload, scale_bytes = _split(packed, head_dim // 2)
    scale = scale_bytes.contiguous().view(torch.float8_e4m3fn).float()
    return dequantize_packed_fp4(payload, scale, dtype)


# ---------------------------------------------------------------------------- indexer keys
def pack_index_k(x: torch.Tensor) -> torch.Tensor:
    """[..., Di] -> uint8 [..., Di/2 + Di/32]: E2M1 payload, then UE8M0 scale bytes (one per 32)."""
    codes, scale = quantize_mxfp4(x, MX_BLOCK)
    return torch.cat([pack_e2m1(codes), _ue8m0_bytes(scale)], dim=-1)


def unpack_index_k(packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 [..., E] -> [..., Di] in `dtype`, with Di = 32·E/17 (E = Di/2 + Di/32)."""
    index_head_dim = packed.size(-1) * 32 // 17
    assert index_key_entry_bytes(index_head_dim) == packed.size(-1), f"{packed.size(-1)} bytes is no index key"
    payload, scale_bytes = _split(packed, index_head_dim // 2)
    return dequantize_packed_fp4(payload, _ue8m0_scales(scale_bytes), dtype)


# ---------------------------------------------------------------------------- window KV
def pack_window_kv(x: torch.Tensor) -> torch.Tensor:
    """[..., Dh] -> uint8 [..., Dh + Dh/32]: e4m3 bytes, then UE8M0 scale bytes (one per 32)."""
    codes, scale = quantize_fp8(x, MX_BLOCK)
    return torch.cat([codes.view(torch.uint8), _ue8m0_bytes(scale)], dim=-1)


def unpack_window_kv(packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 [..., E] -> [..., Dh] in `dtype`, with Dh = 32·E/33 (E = Dh + Dh/32)."""
    head_dim = packed.size(-1) * 32 // 33
    assert window_entry_bytes(head_dim) == packed.size(-1), f"{packed.size(-1)} bytes is no window-KV entry"
    payload, scale_bytes = _split(packed, head_dim)
    codes = payload.contiguous().view(torch.float8_e4m3fn)
    return dequantize_fp8(codes, _ue8m0_scales(scale_bytes), dtype)


# ---------------------------------------------------------------------------- a session's caches
def model_cache_bytes(cache, args: ModelArgs) -> dict[str, int]:
    """Bytes a `ModelCache` (model/transformer.py) would occupy stored in the packed format, per row.

    Counted from the tensors the cache holds now: global = compressed-KV entries × main-KV bytes
    + index keys × index-key bytes (the persistent banks); window = window-KV rows × window bytes
    (the bounded SWA rings, window_size-1 + max_rollback rows per layer at most); pending = the
    compressors' fp32 per-token state of incomplete groups (raw kv and score, 8·Dh bytes a token,
    kept in fp32 as the reference's kv_state/score_state).
    """
    out = {"global": 0, "window": 0, "pending": 0}
    main_b, index_b = main_kv_entry_bytes(args.head_dim), index_key_entry_bytes(args.index_head_dim)
    win_b = window_entry_bytes(args.head_dim)
    for layer in cache.layers:
        if layer.window_kv is not None:
            out["window"] += layer.window_kv.size(1) * win_b
        if layer.compress_kv is not None:
            out["global"] += layer.compress_kv.size(1) * main_b + layer.index_k.size(1) * index_b
        if layer.raw_kv is not None:
            out["pending"] += (layer.raw_kv.size(1) + layer.raw_score.size(1)) * layer.raw_kv.size(-1) * 4
    out["total"] = sum(out.values())
    return out


__all__ = [
    "bytes_per_token", "index_key_entry_bytes", "main_kv_entry_bytes", "model_cache_bytes", "pack_index_k",
    "pack_main_kv", "pack_window_kv", "unpack_index_k", "unpack_main_kv", "unpack_window_kv", "window_entry_bytes",
]  # fmt: skip
