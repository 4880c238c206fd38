"""Sessions' caches as the rows of one batch, each row fed at its own position in one forward.

`RaggedBatch` takes the per-session `ModelCache`s of the sessions the engine feeds and holds them as
one batched ModelCache while they are fed: each `step` feeds every row its own next tokens (a
prompt chunk, or one generated token) in ONE `Transformer.forward_ragged` call, whatever the rows'
lengths; rows with fewer tokens than the longest are padded. Storage, per layer:
  rings (window KV, the compressor's raw tail, the Engram id tail, the CED encoder output): fixed
  [B, keep + slack, ...] right-aligned (a row's newest entry last, zeros before its first); a step
  appends its tokens, padding included, and then shifts each row right past its padding, so the
  ring again ends at the row's newest real token (`slack` = the most padding a row gets in a step,
  so the shift never loses an entry a later token needs); the layout (attention.build_ragged_layout)
  masks what a short row lacks;
  global banks (compressed KV, index keys): preallocated [B, slots + 1, ...] indexed by group
  number, written in place where a row completes a group of real tokens (the extra slot takes the
  rest); a step reads the first max-groups slots as a view, visibility masks the rest.
Packed caches (uint8 entries) are stored the same way, their padding zero bytes (finite values).
Rows leave between steps (`take`: their caches go back to their sessions exactly as a per-session
feed would have left them) and the rest are compacted; `split` returns all of them.
Not here: CED prefill (model/ced.py runs per group), rollback (`truncate` works on per-session
caches only, so speculative verification runs on those).
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
    """`caches` (one ModelCache per row, fed up to their seq_len; empty ones too) as one batch;
    `max_tokens`: the most tokens any row will hold (sizes the banks); `slack`: the most padding a
    row gets in one step (the longest step minus the row's tokens: 0 for decode steps, where every
    row feeds one token; a prefill chunk where a row may be fed nothing)."""

    def __init__(self, model: Transformer, caches: list[ModelCache], max_tokens: int, slack: int = 0):
        a, c0 = model.args, caches[0]
        self.model = model
        self.pos = [c.seq_len for c in caches]
        self.rb = rb = c0.max_rollback
        self.slack = slack
        self.dspark = [c.dspark for c in caches]  # feeding does not touch the drafter's context
        self.slots = {r: max_tokens // r + 1 for r in model.ratios}  # bank slots; the last is the trash slot
        # the batch keeps `slack` more ring entries: attention and the model size rings by max_rollback
        self.cache = ModelCache(max_rollback=rb + self.slack, encoder_out_len=c0.encoder_out_len, seq_len=0)
        # (owner index, field) -> (keep, per-row lengths); owner -1 = the ModelCache itself
        self.rings: dict[tuple[int, str], tuple[int, list[int]]] = {}
        empty = _empty_entries(model, c0.layers[0].packed if c0.layers else False)
        keeps = {"recent_ids": a.engram_max_ngram_size - 1 + rb, "encoder_h": c0.encoder_out_len + rb,
                 "encoder_pre": c0.encoder_out_len + rb}  # fmt: skip
        for name in _MODEL_RINGS:
            rows = [getattr(c, name) for c in caches]
            if any(x is not None for x in rows) or (name == "recent_ids" and a.engram_layer_ids):
                setattr(self.cache, name, self._ring(-1, name, rows, keeps[name], empty.get(name)))
        for i in range(len(model.layers)):
            src = [c.layers[i] if c.layers else LayerCache(max_rollback=rb, packed=empty["packed"]) for c in caches]
            lc = LayerCache(**{f.name: getattr(src[0], f.name) for f in dataclasses.fields(LayerCache)
                               if f.name not in _LAYER_RINGS + _LAYER_BANKS})  # fmt: skip
            lc.max_rollback = rb + self.slack
            r, source = a.compress_ratio(i), a.is_kv_source(i)
            for name in _LAYER_RINGS:
                if name == "window_kv" or (source and r > 1):
                    keep = a.window_size - 1 + rb if name == "window_kv" else r - 1 + rb
                    rows = [getattr(x, name) for x in src]
                    setattr(lc, name, self._ring(i, name, rows, keep, empty[name]))
            if source:
                lc.ratio = r
                for name in _LAYER_BANKS:
                    rows = [getattr(x, name) for x in src]
                    setattr(lc, name, _bank([empty[name] if x is None else x for x in rows], self.slots[r]))
            self.cache.layers.append(lc)

    def _ring(self, owner: int, name: str, rows: list, keep: int, empty: torch.Tensor | None) -> torch.Tensor:
        like = next((x for x in rows if x is not None), empty)
        out = like.new_zeros(len(rows), keep + self.slack, *like.shape[2:])
        lens = []
        for b, x in enumerate(rows):
            n = 0 if x is None else x.size(1)
            if n > keep:
                raise ValueError(f"{name} holds {n} entries, more than the {keep} a step keeps")
            if n:
                out[b, out.size(1) - n :] = x[0]
            lens.append(n)
        self.rings[(owner, name)] = (keep, lens)
        return out

    @property
    def size(self) -> int:
        return len(self.pos)

    @torch.inference_mode()
    def step(self, ids: list[list[int]], engram_inputs: dict | None = None, return_main_hidden: bool = False):
        """Feed row b its tokens ids[b] (none allowed; at most `slack` fewer than the longest row's);
        returns forward_ragged's logits [B,V] after each row's last fed token (undefined for a row fed
        none), and the DSpark context [B,S,X] with `return_main_hidden` (row b's first len(ids[b]))."""
        dev = self.model.embed.weight.device
        n = [len(x) for x in ids]
        S = max(n)
        if S - min(n) > self.slack:
            raise ValueError(f"rows of one step differ by at most slack={self.slack} tokens here, got {S - min(n)}")
        end = max(p + k for p, k in zip(self.pos, n))
        if any(end // r > s - 1 for r, s in self.slots.items()):
            raise ValueError("a row outgrew the batch's banks: size max_tokens for the longest row")
        x = torch.tensor([row + [0] * (S - len(row)) for row in ids], device=dev)
        out = self.model.forward_ragged(
            x, torch.tensor(self.pos, device=dev), torch.tensor(n, device=dev), self.cache, max_end=end,
            bank_slots={r: s - 1 for r, s in self.slots.items()}, engram_inputs=engram_inputs,
            return_main_hidden=return_main_hidden,
        )  # fmt: skip
        if S > min(n):  # drop the padding: shift every ring row right past its pad tokens
            pad = torch.tensor([S - k for k in n], device=dev)
            for owner in [self.cache, *self.cache.layers]:
                for name in _MODEL_RINGS + _LAYER_RINGS:
                    t = getattr(owner, name, None)
                    if isinstance(t, torch.Tensor):
                        setattr(owner, name, _shift_right(t, pad))
        self.pos = [p + k for p, k in zip(self.pos, n)]
        for key, (keep, lens) in self.rings.items():
            self.rings[key] = (keep, [min(m + k, keep) for m, k in zip(lens, n)])
        return out

    def _row(self, b: int) -> ModelCache:
        """Row b as the per-session ModelCache a per-session decode would have left."""
        a = self.model.args
        fields = {f.name: getattr(self.cache, f.name) for f in dataclasses.fields(ModelCache)}
        mc = ModelCache(**{**fields, "layers": [], "seq_len": self.pos[b], "dspark": self.dspark[b],
                           "max_rollback": self.rb})  # fmt: skip
        for name in _MODEL_RINGS:
            if getattr(self.cache, name) is not None:
                setattr(mc, name, self._unring(-1, name, getattr(self.cache, name), b))
        for i, lc in enumerate(self.cache.layers):
            row = LayerCache(**{**{f.name: getattr(lc, f.name) for f in dataclasses.fields(LayerCache)},
                                "max_rollback": self.rb})  # fmt: skip
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
        return x[b : b + 1, x.size(1) - lens[b] :].clone() if lens[b] else None

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


def _shift_right(x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
    """Row b of x [B,K,...] moved pad[b] entries towards the end (its last pad[b] dropped, zeros in front)."""
    K = x.size(1)
    src = torch.arange(K, device=x.device)[None, :] - pad[:, None]
    idx = src.clamp(min=0).view(*src.shape, *([1] * (x.dim() - 2))).expand_as(x)
    keep = (src >= 0).view(*src.shape, *([1] * (x.dim() - 2)))
    return torch.where(keep, x.gather(1, idx), torch.zeros((), dtype=x.dtype, device=x.device))


def _empty_entries(model: Transformer, packed: bool) -> dict:
    """Zero-entry [1,0,E] stand-ins of every cache field, for rows whose cache is still empty."""
    a, w = model.args, model.embed.weight
    dense = {"window_kv": a.head_dim, "compress_kv": a.head_dim, "index_k": a.index_head_dim}
    if packed:
        from model.packed_cache import index_key_entry_bytes, main_kv_entry_bytes, window_entry_bytes

        entries = {"window_kv": window_entry_bytes(a.head_dim), "compress_kv": main_kv_entry_bytes(a.head_dim),
                   "index_k": index_key_entry_bytes(a.index_head_dim)}  # fmt: skip
        out = {k: w.new_zeros(1, 0, e, dtype=torch.uint8) for k, e in entries.items()}
    else:
        out = {k: w.new_zeros(1, 0, e) for k, e in dense.items()}
    f32 = w.new_zeros(1, 0, a.head_dim, dtype=torch.float32)
    return {**out, "raw_kv": f32, "raw_score": f32, "recent_ids": w.new_zeros(1, 0, dtype=torch.long),
            "packed": packed}  # fmt: skip


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
