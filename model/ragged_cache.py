"""Sessions' caches as the rows of one batch for decode steps at every row's own position.

`RaggedBatch` takes the per-session `ModelCache`s of the sessions a generate call decodes and holds
them as one batched ModelCache for as long as they decode: each step feeds one token per row at the
row's own position in ONE `Transformer.forward_ragged_decode` call, whatever the rows' lengths.
Storage, per layer:
  rings (window KV, the compressor's raw tail, the Engram id tail, the CED encoder output): fixed
  [B, keep, ...] right-aligned (a row's newest entry last, zeros before its first); a step appends
  one row per session and drops the oldest, the layout (attention.build_decode_layout) masks what
  a short row lacks;
  global banks (compressed KV, index keys): preallocated [B, slots + 1, ...] indexed by group
  number, written in place where a row completes a group (the extra slot takes the other rows'
  candidate groups); a step reads the first max-groups slots as a view, visibility masks the rest.
Packed caches (uint8 entries) are stored the same way, their padding zero bytes (finite values).
Rows leave between steps (`take`: their caches go back to their sessions exactly as a per-session
decode would have left them) and the rest are compacted; `split` returns all of them.
Not here: prefill (the engine feeds prompts through `forward_incremental`), rollback (`truncate`
works on per-session caches only, so speculative verification runs on those).
"""

from __future__ import annotations

import dataclasses

import torch

from model.attention import LayerCache
from model.transformer import ModelCache, Transformer

# ModelCache fields that are rings, and how many entries each keeps beyond max_rollback
_LAYER_RINGS = ("window_kv", "raw_kv", "raw_score")
_LAYER_BANKS = ("compress_kv", "index_k")
_MODEL_RINGS = ("recent_ids", "encoder_h", "encoder_pre")


class RaggedBatch:
    """`caches` (one ModelCache per row, fed up to their seq_len) as one batch; `max_tokens`: the
    most tokens any row will hold (sizes the banks)."""

    def __init__(self, model: Transformer, caches: list[ModelCache], max_tokens: int):
        a, c0 = model.args, caches[0]
        self.model = model
        self.pos = [c.seq_len for c in caches]
        rb = c0.max_rollback
        self.dspark = [c.dspark for c in caches]  # decode steps do not touch the drafter's context
        self.slots = {r: max_tokens // r + 1 for r in model.ratios}  # bank slots; the last is the trash slot
        self.cache = ModelCache(max_rollback=rb, encoder_out_len=c0.encoder_out_len, seq_len=0)
        # (owner index, field) -> (keep, per-row lengths); owner -1 = the ModelCache itself
        self.rings: dict[tuple[int, str], tuple[int, list[int]]] = {}
        keeps = {"recent_ids": a.engram_max_ngram_size - 1 + rb, "encoder_h": c0.encoder_out_len + rb,
                 "encoder_pre": c0.encoder_out_len + rb}  # fmt: skip
        for name in _MODEL_RINGS:
            rows = [getattr(c, name) for c in caches]
            if any(x is not None for x in rows):
                setattr(self.cache, name, self._ring(-1, name, rows, keeps[name]))
        for i in range(len(model.layers)):
            src = [c.layers[i] for c in caches]
            lc = LayerCache(**{f.name: getattr(src[0], f.name) for f in dataclasses.fields(LayerCache)
                               if f.name not in _LAYER_RINGS + _LAYER_BANKS})  # fmt: skip
            r = a.compress_ratio(i)
            for name in _LAYER_RINGS:
                rows = [getattr(x, name) for x in src]
                if any(x is not None for x in rows):
                    keep = a.window_size - 1 + rb if name == "window_kv" else r - 1 + rb
                    setattr(lc, name, self._ring(i, name, rows, keep))
            if src[0].compress_kv is not None:
                for name in _LAYER_BANKS:
                    setattr(lc, name, _bank([getattr(x, name) for x in src], self.slots[lc.ratio]))
            self.cache.layers.append(lc)

    def _ring(self, owner: int, name: str, rows: list[torch.Tensor | None], keep: int) -> torch.Tensor:
        like = next(x for x in rows if x is not None)
        out = like.new_zeros(len(rows), keep, *like.shape[2:])
        lens = []
        for b, x in enumerate(rows):
            n = 0 if x is None else x.size(1)
            if n > keep:
                raise ValueError(f"{name} holds {n} entries, more than the {keep} a decode step keeps")
            if n:
                out[b, keep - n :] = x[0]
            lens.append(n)
        self.rings[(owner, name)] = (keep, lens)
        return out

    @property
    def size(self) -> int:
        return len(self.pos)

    @torch.inference_mode()
    def step(self, ids: list[int], engram_inputs: dict | None = None, return_main_hidden: bool = False):
        """Feed token ids[b] at row b's position; returns forward_ragged_decode's logits [B,1,V]
        (and the DSpark context [B,1,X] with `return_main_hidden`)."""
        dev = self.model.embed.weight.device
        if any((max(self.pos) + 1) // r > s - 1 for r, s in self.slots.items()):
            raise ValueError("a row outgrew the batch's banks: size max_tokens for the longest row")
        out = self.model.forward_ragged_decode(
            torch.tensor(ids, device=dev)[:, None], torch.tensor(self.pos, device=dev), self.cache,
            max_pos=max(self.pos), bank_slots={r: s - 1 for r, s in self.slots.items()},
            engram_inputs=engram_inputs, return_main_hidden=return_main_hidden,
        )  # fmt: skip
        self.pos = [p + 1 for p in self.pos]
        for key, (keep, lens) in self.rings.items():
            self.rings[key] = (keep, [min(n + 1, keep) for n in lens])
        return out

    def _row(self, b: int) -> ModelCache:
        """Row b as the per-session ModelCache a per-session decode would have left."""
        a = self.model.args
        fields = {f.name: getattr(self.cache, f.name) for f in dataclasses.fields(ModelCache)}
        mc = ModelCache(**{**fields, "layers": [], "seq_len": self.pos[b], "dspark": self.dspark[b]})
        for name in _MODEL_RINGS:
            if getattr(self.cache, name) is not None:
                setattr(mc, name, self._unring(-1, name, getattr(self.cache, name), b))
        for i, lc in enumerate(self.cache.layers):
            row = LayerCache(**{f.name: getattr(lc, f.name) for f in dataclasses.fields(LayerCache)})
            for name in _LAYER_RINGS:
                if getattr(lc, name) is not None:
                    setattr(row, name, self._unring(i, name, getattr(lc, name), b))
            if lc.compress_kv is not None:
                g = self.pos[b] // a.compress_ratio(i)
                row.compress_kv, row.index_k = lc.compress_kv[b : b + 1, :g].clone(), lc.index_k[b : b + 1, :g].clone()
            mc.layers.append(row)
        return mc

    def _unring(self, owner: int, name: str, x: torch.Tensor, b: int) -> torch.Tensor | None:
        keep, lens = self.rings[(owner, name)]
        return x[b : b + 1, keep - lens[b] :].clone() if lens[b] else None

    def take(self, rows: list[int]) -> list[ModelCache]:
        """Remove rows (indices into the current batch): their caches, in order; the rest stay, compacted."""
        out = [self._row(b) for b in rows]
        gone = set(rows)
        kept = [b for b in range(self.size) if b not in gone]
        idx = torch.tensor(kept, dtype=torch.long, device=self.model.embed.weight.device)
        for owner in [self.cache, *self.cache.layers]:
            for name in _MODEL_RINGS + _LAYER_RINGS + _LAYER_BANKS:
                x = getattr(owner, name, None)
                if isinstance(x, torch.Tensor):
                    setattr(owner, name, x.index_select(0, idx))
        self.rings = {k: (keep, [lens[b] for b in kept]) for k, (keep, lens) in self.rings.items()}
        self.pos = [self.pos[b] for b in kept]
        self.dspark = [self.dspark[b] for b in kept]
        return out

    def split(self) -> list[ModelCache]:
        """Every row's cache, in order (the batch is empty afterwards)."""
        return self.take(list(range(self.size)))


def _bank(rows: list[torch.Tensor], slots: int) -> torch.Tensor:
    """Banks [1,G_b,E] stacked into [B, slots, E] at slot = group number, zeros elsewhere."""
    like = rows[0]
    out = like.new_zeros(len(rows), slots, like.size(-1))
    for b, x in enumerate(rows):
        if x.size(1) > slots - 1:
            raise ValueError(f"a bank of {x.size(1)} groups does not fit {slots - 1} slots: raise max_tokens")
        out[b, : x.size(1)] = x[0]
    return out


__all__ = ["RaggedBatch"]
