"""Engram (model_reference §3.12): n-gram hash ids from token ids, and the gated table lookup that
adds them into the mHC streams before a block.

`EngramHasher` (built once from a tokenizer and ModelArgs; the hash runs in torch on the ids' device,
so a decode step hashes on the GPU) turns token ids into hash ids for every Engram layer, bit-exactly
as the reference `NgramHashState`: compressed token map with the spec's normaliser sequence and
first-seen numbering, PCG64 multipliers seeded 10007·layer_id and
bounded by the compressed vocab, XOR rolling hash over orders 2..max_ngram, prime-sized buckets
handed out layer → order → head, cumulative blocking at sequence/document starts and image
positions. `Engram` is the module (`embed.weight`, `wkv`, `q_weight`, `k_weight`).

Choices the spec leaves open: the normaliser is the spec's sequence built from the same
`tokenizers` normalizers the reference uses, applied unchanged to any tokenizer (byte-level BPE
included: a lone byte of a multi-byte character decodes to U+FFFD and is keyed by its raw token
string). The table is held in the default dtype, not fp8 + UE8M0 scales (a checkpoint loader
dequantises official rows), and its gradient is sparse (`nn.Embedding(sparse=True)`): optimizers
of `embed.weight` must accept sparse gradients. Not here: row sharding across ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
import torch
from torch import nn

from model.config import ModelArgs, engram_primes

DEAD = -1  # compressed id of a position that takes part in no n-gram (image span)
GATE_CLAMP = 1e-6  # |dot| floor before the signed square root (reference `clamp_value`)


@lru_cache(maxsize=8)
def _primes(engram_vocab_size: int, n_layers: int, n_orders: int, n_heads: int) -> tuple:
    """primes[layer][order - 2][head]: the successive primes above engram_vocab_size - 1 handed out
    layer → order → head (model/config.py's engram_primes, the one generator of that sequence)."""
    flat = engram_primes(engram_vocab_size, n_heads, n_orders + 1, n_layers)
    return tuple(tuple(tuple(layer[o * n_heads : (o + 1) * n_heads]) for o in range(n_orders)) for layer in flat)


@dataclass(frozen=True)
class EngramLayout:
    """Bucket layout: `primes[layer][order - 2][head]`; `offsets[layer]` are the exclusive cumulative
    sums of that layer's primes in column order (order-2 heads, order-3 heads, ...), so the bucket
    ranges are disjoint and `num_embeddings[layer]` (table rows) is their sum."""

    layer_ids: tuple[int, ...]
    max_ngram_size: int
    n_heads: int
    primes: tuple[tuple[tuple[int, ...], ...], ...]
    offsets: tuple[tuple[int, ...], ...]
    num_embeddings: tuple[int, ...]

    @property
    def n_hash_cols(self) -> int:
        return (self.max_ngram_size - 1) * self.n_heads


def engram_layout(args: ModelArgs) -> EngramLayout:
    """The layout of `args`, checked against `engram_num_embeddings` (no table is allocated)."""
    if not args.engram_layer_ids or args.engram_max_ngram_size < 2 or args.engram_n_heads < 1:
        raise ValueError("Engram is off: needs engram_layer_ids, engram_max_ngram_size >= 2, engram_n_heads >= 1")
    primes = _primes(
        args.engram_vocab_size,
        len(args.engram_layer_ids),
        args.engram_max_ngram_size - 1,
        args.engram_n_heads,
    )
    flat = [[p for order in layer for p in order] for layer in primes]
    offsets = tuple(tuple(int(x) for x in np.cumsum([0, *f[:-1]])) for f in flat)
    sizes = tuple(sum(f) for f in flat)
    if tuple(args.engram_num_embeddings) != sizes:
        raise ValueError(
            f"engram_num_embeddings={tuple(args.engram_num_embeddings)} but the prime tables of "
            f"engram_vocab_size={args.engram_vocab_size} sum to {sizes}"
        )
    return EngramLayout(
        tuple(args.engram_layer_ids), args.engram_max_ngram_size, args.engram_n_heads, primes, offsets, sizes
    )


def compute_hash_multipliers(layer_ids: tuple[int, ...], max_ngram_size: int, compressed_vocab_size: int) -> np.ndarray:
    """[n_layers, max_ngram_size] int64, odd, one row per layer from PCG64 seeded 10007·layer_id;
    bounded so that compressed id × multiplier cannot overflow int64."""
    bound = max(1, (np.iinfo(np.int64).max // compressed_vocab_size) // 2)
    rows = [
        np.random.default_rng(10007 * layer_id).integers(0, bound, size=(max_ngram_size,), dtype=np.int64) * 2 + 1
        for layer_id in layer_ids
    ]
    return np.stack(rows)


def build_compressed_token_map(tokenizer: Any) -> tuple[np.ndarray, int]:
    """(lookup [n_tokens] int64, compressed vocab size). Tokens whose single-id decode normalises
    alike share an id, numbered in first-seen order of ascending token id.

    `tokenizer`: a `model.tokenizer.Tokenizer`, an HF fast tokenizer or a raw `tokenizers.Tokenizer`.
    """
    from tokenizers import Regex, normalizers

    sentinel = "\ue000"  # keeps a token that is exactly one space from stripping to ""
    normalizer = normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), sentinel),
            normalizers.Strip(),
            normalizers.Replace(sentinel, " "),
        ]
    )
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    key_to_id: dict[str, int] = {}
    lookup = np.zeros(backend.get_vocab_size(with_added_tokens=True), dtype=np.int64)
    for token_id in range(len(lookup)):
        text = backend.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:  # partial UTF-8: nothing to normalise, key by the raw token string
            key = backend.id_to_token(token_id)
        else:
            key = normalizer.normalize_str(text) or text
        lookup[token_id] = key_to_id.setdefault(key, len(key_to_id))
    return lookup, len(key_to_id)


def _to_numpy(x: Any, dtype: Any) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    return np.asarray(x, dtype=dtype)


class EngramHasher:
    """Token ids → hash ids of every Engram layer. Built once (tokenizer + args); the Transformer
    calls it once per forward. Deterministic across runs and processes (no torch RNG, no hash())."""

    def __init__(self, args: ModelArgs, tokenizer: Any):
        self.layout = engram_layout(args)
        self.token_map, size = build_compressed_token_map(tokenizer)
        if size != args.engram_compressed_vocab_size:
            # every multiplier derives from this size, so a mismatch would silently rehash the table
            raise ValueError(
                f"the tokenizer's compressed vocab has {size} entries but engram_compressed_vocab_size="
                f"{args.engram_compressed_vocab_size}"
            )
        self.pad_id = int(self.token_map[args.engram_pad_id])
        self.multipliers = compute_hash_multipliers(self.layout.layer_ids, self.layout.max_ngram_size, size)
        self.primes = np.array(self.layout.primes, dtype=np.int64)  # [L, orders, heads]
        self.offsets = np.array(self.layout.offsets, dtype=np.int64)  # [L, orders*heads]

    def __call__(
        self,
        input_ids: Any,
        image_mask: Any = None,
        *,
        doc_ids: Any = None,
        context_ids: Any = None,
        context_image_mask: Any = None,
    ) -> torch.Tensor:
        """Hash ids [B,S,n_engram_layers,(max_ngram-1)·n_heads] int64 (CPU), column order
        order-2 heads, order-3 heads, ...; already offset into the layer's table.

        input_ids [B,S] (numpy or torch); image_mask [B,S] bool, True on image-span positions
        (they take part in no n-gram). doc_ids [B,S]: a packed row, n-grams do not cross a change
        of doc id. context_ids [B,c], c <= max_ngram-1: the tokens just before input_ids in the same
        sequence (decode / chunked prefill); fewer than max_ngram-1 means the sequence starts there.
        """
        ids = _to_numpy(input_ids, np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= len(self.token_map)):
            raise ValueError(f"token ids must be in [0, {len(self.token_map)}) for this tokenizer's Engram map")
        comp = self.token_map[ids]
        if image_mask is not None:
            comp = np.where(_to_numpy(image_mask, bool), DEAD, comp)
        n_ctx = 0
        if context_ids is not None:
            ctx = self.token_map[_to_numpy(context_ids, np.int64)]
            if context_image_mask is not None:
                ctx = np.where(_to_numpy(context_image_mask, bool), DEAD, ctx)
            n_ctx = ctx.shape[1]
            if n_ctx > self.layout.max_ngram_size - 1:
                raise ValueError(f"context_ids has {n_ctx} columns; at most max_ngram_size-1 are used")
            comp = np.concatenate([ctx, comp], axis=1)
        docs = None if doc_ids is None else _to_numpy(doc_ids, np.int64)
        if docs is not None and n_ctx:
            docs = np.concatenate([np.repeat(docs[:, :1], n_ctx, axis=1), docs], axis=1)
        docs_t = None if docs is None else torch.from_numpy(docs)
        return self._hash(torch.from_numpy(np.ascontiguousarray(comp)), docs_t)[:, n_ctx:].contiguous()

    def step_hashes(self, ids_B: torch.Tensor, context_BC: torch.Tensor, pos_B: torch.Tensor) -> torch.Tensor:
        """Hash ids [B,1,n_engram_layers,C] of one new token per row, on the tokens' device and without
        a host sync (a decode step, CUDA-graph capturable): ids_B [B] the new tokens, context_BC the
        row's previous C = max_ngram-1 token ids, newest last (-1: an image position), pos_B [B] how
        many tokens the row had before this one (context entries before its start take part in no
        n-gram). The same hashes as `__call__(ids[:, None], context_ids=...)` with the row's real context."""
        tables = self.tables(ids_B.device)
        C = context_BC.size(1)
        start = torch.arange(C, device=ids_B.device) >= (C - pos_B)[:, None]  # [B,C]: entry inside the row
        ctx = torch.where((context_BC >= 0) & start, tables["token_map"][context_BC.clamp(min=0)], DEAD)
        comp = torch.cat([ctx, tables["token_map"][ids_B][:, None]], dim=1)
        return self._hash(comp, None)[:, C:]

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_device_tables"}  # numpy tables travel, not tensors

    def tables(self, device: torch.device) -> dict[str, torch.Tensor]:
        """The hash's constant tables as tensors on `device` (made once per device)."""
        key = str(device)
        # a plain attribute read, not __dict__.setdefault: compiled decode steps trace this (ragged_cache
        # compile_step_hashes) and dynamo of torch 2.11 breaks the graph on setdefault
        cache = getattr(self, "_device_tables", None)
        if cache is None:
            cache = self._device_tables = {}
        if key not in cache:
            cache[key] = {
                name: torch.from_numpy(np.ascontiguousarray(getattr(self, name))).to(device)
                for name in ("token_map", "multipliers", "primes", "offsets")
            }
        return cache[key]

    def _hash(self, comp: torch.Tensor, docs: torch.Tensor | None) -> torch.Tensor:
        """comp [B,T] compressed ids (DEAD: no n-gram), docs [B,T] or None -> [B,T,L,C] int64 on comp's device."""
        t = self.tables(comp.device)
        B, T = comp.shape
        blocked = torch.zeros(B, T, dtype=torch.bool, device=comp.device)
        tokens = []
        for shift in range(self.layout.max_ngram_size):
            source = torch.full((B, T), DEAD, dtype=torch.int64, device=comp.device)  # before the start
            source[:, shift:] = comp[:, : max(T - shift, 0)]
            blocked |= source == DEAD
            if docs is not None and shift:
                crossed = torch.ones(B, T, dtype=torch.bool, device=comp.device)
                crossed[:, shift:] = docs[:, shift:] != docs[:, : max(T - shift, 0)]
                blocked |= crossed
            tokens.append(torch.where(blocked, self.pad_id, source))
        # [B,T,L,max_ngram]; ids < compressed vocab and the multiplier bound keep this in int64 (no wrap)
        products = torch.stack(tokens, dim=-1)[:, :, None, :] * t["multipliers"]
        rolling, hashes = products[..., 0], []
        for n in range(1, self.layout.max_ngram_size):
            rolling = rolling ^ products[..., n]  # XOR so far = hash of the (n+1)-gram
            hashes.append(rolling[..., None] % t["primes"][:, n - 1])
        return torch.cat(hashes, dim=-1) + t["offsets"]


class Engram(nn.Module):
    """Gated n-gram memory added to every mHC stream before block `layer_id`.

    Rows of the hash ids go through `wkv` into one key per stream and one shared value; the gate per
    (token, stream) is sigmoid(signed sqrt of a per-stream-normalised dot of stream and key).
    """

    def __init__(self, args: ModelArgs, layer_id: int):
        super().__init__()
        layout = engram_layout(args)
        self.layer_id = layer_id
        self.layer_hash_index = layout.layer_ids.index(layer_id)
        self.dim, self.hc_mult, self.eps = args.dim, args.hc_mult, args.norm_eps
        self.n_hash_cols = layout.n_hash_cols
        # sparse: a step touches S·n_hash_cols rows of a table that may hold ~4e8 of them
        self.embed = nn.Embedding(layout.num_embeddings[self.layer_hash_index], args.engram_head_dim, sparse=True)
        self.wkv = nn.Linear(self.n_hash_cols * args.engram_head_dim, args.dim * (args.hc_mult + 1), bias=False)
        # only the product q_weight ⊙ k_weight is used; both exist to load official checkpoints
        self.q_weight = nn.Parameter(torch.ones(args.hc_mult, args.dim))
        self.k_weight = nn.Parameter(torch.ones(args.hc_mult, args.dim))

    def forward(self, h: torch.Tensor, hashes: torch.Tensor, engram_mask: torch.Tensor | None = None) -> torch.Tensor:
        """h [B,S,hc,D]; hashes [B,S,n_hash_cols] for this layer, or [B,S,n_engram_layers,
        n_hash_cols] from EngramHasher (this layer's slice is taken); engram_mask [B,S] bool,
        False (image spans) closes the gate. Returns h + gate·value in h's dtype."""
        if hashes.dim() == 4:
            hashes = hashes[:, :, self.layer_hash_index]
        rows = self.embed(hashes.to(h.device))  # [B,S,n_hash_cols,head_dim]
        kv = self.wkv(rows.flatten(-2).to(self.wkv.weight.dtype))
        key, value = kv.split([self.hc_mult * self.dim, self.dim], dim=-1)
        key = key.float().unflatten(-1, (self.hc_mult, self.dim))
        x = h.float()
        weight = self.q_weight.float() * self.k_weight.float()
        # normalised per (token, stream) over D, not jointly over the streams
        rstd = torch.rsqrt(x.square().mean(-1) + self.eps) * torch.rsqrt(key.square().mean(-1) + self.eps)
        dot = (x * weight * key).sum(-1) * rstd * self.dim**-0.5
        gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(GATE_CLAMP).sqrt(), dot))
        if engram_mask is not None:
            gate = gate.masked_fill(~engram_mask.to(gate.device).unsqueeze(-1), 0.0)
        return (x + gate.unsqueeze(-1) * value.float().unsqueeze(-2)).to(h.dtype)


__all__ = [
    "DEAD", "Engram", "EngramHasher", "EngramLayout", "build_compressed_token_map",
    "compute_hash_multipliers", "engram_layout",
]  # fmt: skip
