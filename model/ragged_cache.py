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
Decode steps (`decode`: one token per row) see every bank slot (`max_tokens // r` groups, masked
where not complete), so their shapes stay fixed from step to step; with a `GraphPool` (CUDA) they
replay CUDA graphs: the batch's tensors then live in the pool's storage of `capacity` rows (the
smallest bucket >= the rows; the rest padding rows at position 0), each step's cache updates are
copied back into that storage inside the graph, one graph per bucket of live rows, reused by later
batches of the same shapes. `compile_decode` gives the decode forward with its layers compiled by
inductor (fused kernels, static shapes per bucket, one compile per kind of layer, which later
engines of the process reuse), which a pool
captures as it would the eager one.
CED prefill (model/ced.py `ced_prefill_ragged`) runs its encoder steps through `step(encoder_only=True)`
and its decoder replay on the batch's caches (`clear_rings`, `realign`).
Not here: rollback (`truncate` works on per-session caches only, so speculative verification runs
on those).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch

from model.attention import LayerCache, build_ragged_layout
from model.engram import EngramHasher
from model.transformer import ModelCache, Transformer, make_engram_inputs, ragged_head, run_layer

# Decode batches on graphs or compiled layers size their banks from a short ladder of sizes (bank_tokens),
# so that generate calls of nearby lengths share one storage, its graphs (GraphPool) and the compiled
# layers (whose shapes include the banks'): GRAPH_TOKENS is its first rung
GRAPH_TOKENS = 1024


def bank_tokens(longest: int, max_seq_len: int) -> int:
    """Tokens a graph or compiled decode batch's banks hold when its longest row may reach `longest`: the
    smallest rung >= longest of GRAPH_TOKENS x 1, 1.5, 2, 3, 4, 6, 8, 12, ... (powers of two and one and a
    half times them), at most max_seq_len. Each new size costs a compile of every kind of layer (~140 s for
    `small` on an H100): a rollout growing to 16,384 tokens meets 9 sizes where steps of GRAPH_TOKENS met
    16, and a batch's banks hold at most 1.5 x its longest row beyond the first rung."""
    rung = GRAPH_TOKENS
    while True:
        for size in (rung, rung * 3 // 2):
            if size >= longest:
                return min(max_seq_len, size)
        rung *= 2


def engram_rows(hasher, token_lists, pos: list[int], ids: list[list[int]], n_ctx: int, device) -> dict:
    """Engram inputs of a ragged step: row b's tokens ids[b] (padded to the longest) at pos[b], its
    context the n_ctx tokens before; rows are hashed in groups of equal context length (rows near
    their start have fewer). Padding positions hash too; the caller drops what they produce."""
    S = max(map(len, ids))
    x = torch.tensor([row + [0] * (S - len(row)) for row in ids], dtype=torch.long)
    by_c: dict[int, list[int]] = {}
    for b, p in enumerate(pos):
        by_c.setdefault(min(p, n_ctx), []).append(b)
    hashes = None
    for c, rows in by_c.items():
        ctx = torch.tensor([token_lists[b][pos[b] - c : pos[b]] for b in rows]) if c else None
        h = make_engram_inputs(hasher, x[rows], context_ids=ctx)["hashes"]
        if hashes is None:
            hashes = h.new_zeros(len(pos), *h.shape[1:])
        hashes[rows] = h
    return {"hashes": hashes.to(device), "engram_mask": None}


# the LayerCache and ModelCache fields a RaggedBatch keeps as rings, and the global banks (module docstring)
_LAYER_RINGS = ("window_kv", "raw_kv", "raw_score")
_LAYER_BANKS = ("compress_kv", "index_k")
_MODEL_RINGS = ("recent_ids", "encoder_h", "encoder_pre")


class RaggedBatch:
    """`caches` (one ModelCache per row, fed up to their seq_len; empty ones too) as one batch;
    `max_tokens`: the most tokens any row will hold (sizes the banks); `slack`: the most padding a
    row gets in one step (the longest step minus the row's tokens: 0 for decode steps, where every
    row feeds one token; a prefill chunk where a row may be fed nothing). `pool` (CUDA, decode
    batches): the batch's tensors live in the pool's storage and `decode` replays its graphs.
    `forward`: what decode steps call in place of model.forward_ragged (`compile_decode`). `hasher`:
    the EngramHasher of decode steps (default: the model's own; prefill steps get their hashes from
    the caller); `step_hashes`: its decode-step hash compiled (`compile_step_hashes`)."""

    def __init__(
        self,
        model: Transformer,
        caches: list[ModelCache],
        max_tokens: int,
        slack: int = 0,
        pool: GraphPool | None = None,
        forward: Callable | None = None,
        hasher: EngramHasher | None = None,
        step_hashes: Callable | None = None,
    ):
        a, c0 = model.args, caches[0]
        self.model = model
        # decode steps hash their Engram n-grams on the device, from the batch's own id ring
        self.hasher = hasher or model.engram_hasher
        self.step_hashes = step_hashes  # `compile_step_hashes`'s, or None: the hasher's own
        # the decode steps' forward: model.forward_ragged, or `compile_decode`'s (prefill steps run eager)
        self.forward = forward or model.forward_ragged
        self.max_tokens = max_tokens
        n_live = len(caches)
        if pool is not None:  # padding rows up to the capacity: empty caches, position 0
            pad = pool.capacity(n_live) - n_live
            caches = [*caches, *(ModelCache(max_rollback=c0.max_rollback, encoder_out_len=c0.encoder_out_len)
                                 for _ in range(pad))]  # fmt: skip
        self.pos = [c.seq_len for c in caches]
        self.rb = rb = c0.max_rollback
        self.slack = slack
        self.dspark = [c.dspark for c in caches]  # feeding does not touch the drafter's context
        self.slots = {r: max_tokens // r + 1 for r in model.ratios}  # bank slots; the last is the trash slot
        self._fill_index: dict = {}  # _fill's scatter indices, shared by the fields whose rows have equal lengths
        # the batch keeps `slack` more ring entries: attention and the model size rings by max_rollback
        self.cache = ModelCache(max_rollback=rb + self.slack, encoder_out_len=c0.encoder_out_len, seq_len=0)
        # (owner index, field) -> (keep, per-row lengths); owner -1 = the ModelCache itself
        self.rings = {}
        packed = {c.layers[0].packed for c in caches if c.layers}
        if len(packed) > 1:  # stacking uint8 entries with dense rows would promote the bytes to values
            raise ValueError("a RaggedBatch takes caches of one storage format: packed and dense rows are mixed")
        empty = _empty_entries(model, packed == {True})
        keeps = {"recent_ids": a.engram_max_ngram_size - 1 + rb, "encoder_h": c0.encoder_out_len + rb,
                 "encoder_pre": c0.encoder_out_len + rb}  # fmt: skip
        for name in _MODEL_RINGS:
            rows = [getattr(c, name) for c in caches]
            needed = a.engram_layer_ids if name == "recent_ids" else c0.encoder_out_len  # rows may all be empty
            if any(x is not None for x in rows) or needed:
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
                    rows = [empty[name] if x is None else x for x in rows]
                    setattr(lc, name, _bank(rows, self.slots[r], self._fill_index))
            self.cache.layers.append(lc)
        self.pos, self.dspark = self.pos[:n_live], self.dspark[:n_live]
        self.rings = {k: (keep, lens[:n_live]) for k, (keep, lens) in self.rings.items()}
        self._graphs = None if pool is None else pool.attach(self)

    def _ring(self, owner: int, name: str, rows: list, keep: int, empty: torch.Tensor | None) -> torch.Tensor:
        like = next((x for x in rows if x is not None), empty)
        # one entry more, unused, in front: a decode step appends one entry and keeps the newest, a
        # view that starts one entry into the concatenation; allocated alike, the rings of the first
        # step have the strides of every later step's (a compiled step guards on strides)
        out = like.new_zeros(len(rows), keep + self.slack + 1, *like.shape[2:])[:, 1:]
        lens = [0 if x is None else x.size(1) for x in rows]
        if max(lens) > keep:
            raise ValueError(f"{name} holds {max(lens)} entries, more than the {keep} a step keeps")
        _fill(out, rows, lens, right=True, index=self._fill_index)
        self.rings[(owner, name)] = (keep, lens)
        return out

    @property
    def size(self) -> int:
        return len(self.pos)

    @torch.inference_mode()
    def step(
        self,
        ids: list[list[int]],
        engram_inputs: dict | None = None,
        return_main_hidden: bool = False,
        encoder_only: bool = False,
    ):
        """Feed row b its tokens ids[b] (none allowed; at most `slack` fewer than the longest row's);
        returns forward_ragged's logits [B,V] after each row's last fed token (undefined for a row fed
        none), and the DSpark context [B,S,X] with `return_main_hidden` (row b's first len(ids[b])).
        `encoder_only` (CED prefill, model/ced.py): the encoder layers only (`encode_ragged`'s
        EncoderPass is returned); the decoder layers' rings are left as they were."""
        if self._graphs is not None:
            raise ValueError("a batch on CUDA-graph storage feeds decode steps only: prefill without a pool")
        dev = self.model.embed.weight.device
        n = [len(x) for x in ids]
        S = max(n)
        if S - min(n) > self.slack:
            raise ValueError(f"rows of one step differ by at most slack={self.slack} tokens here, got {S - min(n)}")
        end = max(p + k for p, k in zip(self.pos, n))
        if not self._banks_hold(end):
            raise ValueError("a row outgrew the batch's banks: size max_tokens for the longest row")
        x = torch.tensor([row + [0] * (S - len(row)) for row in ids], device=dev)
        fed = self.model.encode_ragged if encoder_only else self.model.forward_ragged
        extra = {} if encoder_only else {"return_main_hidden": return_main_hidden}
        out = fed(
            x, torch.tensor(self.pos, device=dev), torch.tensor(n, device=dev), self.cache, max_end=end,
            bank_slots=self.bank_slots, engram_inputs=engram_inputs, **extra,
        )  # fmt: skip
        fed_layers = range(self.model.args.n_encoder_layers if encoder_only else len(self.cache.layers))
        self.realign(n, S, fed_layers, model_rings=True)
        self.pos = [p + k for p, k in zip(self.pos, n)]
        return out

    def realign(self, n: list[int], S: int, layer_ids: range, model_rings: bool) -> None:
        """After a call appended S entries (row b's first n[b] real) to the rings of `layer_ids` (and
        the ModelCache's own with `model_rings`): shift every row right past its padding, so each
        ring again ends at the row's newest real entry, and count the real entries."""
        owners = [(i, self.cache.layers[i]) for i in layer_ids] + ([(-1, self.cache)] if model_rings else [])
        pad = torch.tensor([S - k for k in n], device=self.model.embed.weight.device)
        for i, owner in owners:
            for name in _MODEL_RINGS + _LAYER_RINGS:
                t = getattr(owner, name, None)
                if not isinstance(t, torch.Tensor) or (i, name) not in self.rings:
                    continue
                if S > min(n):
                    setattr(owner, name, _shift_right(t, pad))
                keep, lens = self.rings[(i, name)]
                self.rings[(i, name)] = (keep, [min(m + k, keep) for m, k in zip(lens, n)])

    def clear_rings(self, layer_ids: range) -> None:
        """Empty the rings of `layer_ids` (all rows): zero entries, none counted (CED replay)."""
        for i in layer_ids:
            for name in _LAYER_RINGS:
                if (i, name) in self.rings:
                    getattr(self.cache.layers[i], name).zero_()
                    keep, lens = self.rings[(i, name)]
                    self.rings[(i, name)] = (keep, [0] * len(lens))

    def ring_lens(self, layer: int, name: str) -> list[int]:
        """How many real entries each row's ring `name` of layer `layer` (-1: the ModelCache's) holds."""
        return list(self.rings[(layer, name)][1])

    def set_ring_lens(self, layer: int, name: str, lens: list[int]) -> None:
        keep, _ = self.rings[(layer, name)]
        self.rings[(layer, name)] = (keep, [min(m, keep) for m in lens])

    @torch.inference_mode()
    def decode(self, ids: list[int] | torch.Tensor, return_main_hidden: bool = False):
        """Feed row b its one token ids[b] (a list, or a tensor [B] on the model's device: the
        sampled tokens of the last step, never brought to the host): `step` with every bank slot
        visible (fixed shapes), the Engram hashes made on the device from the batch's id ring, on the
        pool's CUDA graphs when the batch has one. Returns the logits [B,V] (and the DSpark context
        [B,1,X] with `return_main_hidden`), owned by the caller."""
        if len(ids) != self.size:
            raise ValueError(f"{len(ids)} tokens for {self.size} rows")
        if not self._banks_hold(max(self.pos, default=-1) + 1):
            raise ValueError("a row outgrew the batch's banks: size max_tokens for the longest row")
        if self._graphs is not None:
            out = self._graphs.decode(ids, return_main_hidden)
        else:
            dev = self.model.embed.weight.device
            ids_B = ids if isinstance(ids, torch.Tensor) else torch.tensor(ids, device=dev)
            pos_B = torch.tensor(self.pos, device=dev)
            out = self.forward(
                ids_B[:, None], pos_B, torch.ones(len(ids), dtype=torch.long, device=dev), self.cache,
                max_end=self.max_tokens, bank_slots=self.bank_slots, engram_inputs=self.step_engram(ids_B, pos_B),
                return_main_hidden=return_main_hidden,
            )  # fmt: skip
        self.pos = [p + 1 for p in self.pos]
        self._pending += 1  # every ring of every row gained one entry: counted when next read
        return out

    def step_engram(self, ids_B: torch.Tensor, pos_B: torch.Tensor) -> dict | None:
        """Engram inputs of a decode step (None without Engram layers): each row's new token hashed
        with the max_ngram-1 tokens before it, read from the batch's `recent_ids` ring on the device."""
        a = self.model.args
        if not a.engram_layer_ids:
            return None
        if self.hasher is None:
            raise ValueError("this model has Engram layers: pass the batch an EngramHasher (hasher=)")
        ring = self.cache.recent_ids
        hashes = (self.step_hashes or self.hasher.step_hashes)(
            ids_B, ring[: ids_B.size(0), ring.size(1) - (a.engram_max_ngram_size - 1) :], pos_B
        )
        return {"hashes": hashes, "engram_mask": None}

    @property
    def rings(self) -> dict[tuple[int, str], tuple[int, list[int]]]:
        """(owner index, field) -> (keep, per-row real entries). Decode steps only count themselves
        (`_pending`); the lengths are brought up to date here, when read (a batch of 256 rows has
        ~60 rings: 15k list updates per step otherwise)."""
        if self._pending:
            p, self._pending = self._pending, 0
            self._rings = {k: (keep, [min(m + p, keep) for m in lens]) for k, (keep, lens) in self._rings.items()}
        return self._rings

    @rings.setter
    def rings(self, value: dict[tuple[int, str], tuple[int, list[int]]]) -> None:
        self._rings, self._pending = value, 0

    @property
    def bank_slots(self) -> dict[int, int]:
        """The trash slot per ratio (the last one)."""
        return {r: s - 1 for r, s in self.slots.items()}

    def fields(self) -> list[tuple[object, str]]:
        """(owner, name) of every cache tensor of the batch (rings and banks), in a fixed order."""
        return [(owner, name) for owner in [self.cache, *self.cache.layers] for name in _MODEL_RINGS + _LAYER_RINGS
                + _LAYER_BANKS if isinstance(getattr(owner, name, None), torch.Tensor)]  # fmt: skip

    def _rows(self, rows: list[int]) -> list[ModelCache]:
        """Rows as the per-session ModelCaches a per-session decode would have left. Each field's entries
        of the rows are copied out of the batch once (one gather of every row's live entries, `_gather`);
        a row's tensor is a view of that copy, so the batch's own storage is never shared."""
        a = self.model.args
        mfields = {f.name: getattr(self.cache, f.name) for f in dataclasses.fields(ModelCache)}
        lfields = [{f.name: getattr(lc, f.name) for f in dataclasses.fields(LayerCache)} for lc in self.cache.layers]
        out = [ModelCache(**{**mfields, "layers": [], "seq_len": self.pos[b], "dspark": self.dspark[b],
                             "max_rollback": self.rb}) for b in rows]  # fmt: skip
        for mc in out:
            mc.layers = [LayerCache(**{**f, "max_rollback": self.rb}) for f in lfields]
        layer_of = {id(lc): i for i, lc in enumerate(self.cache.layers)}
        index: dict = {}  # _gather's indices, shared by the fields whose rows have equal lengths
        for owner, name in self.fields():
            i = layer_of.get(id(owner), -1)
            targets = out if i < 0 else [mc.layers[i] for mc in out]
            if name in _LAYER_BANKS:  # a bank holds the row's complete groups from slot 0
                r = a.compress_ratio(i)
                lens = [self.pos[b] // r for b in rows]
                for target, x in zip(targets, _gather(getattr(owner, name), rows, lens, False, index)):
                    setattr(target, name, x)
            else:  # a ring ends at the row's newest entry (a row without entries has none: None)
                ring = self.rings[(i, name)][1]
                lens = [ring[b] for b in rows]
                for target, n, x in zip(targets, lens, _gather(getattr(owner, name), rows, lens, True, index)):
                    setattr(target, name, x if n else None)
        return out

    def take(self, rows: list[int]) -> list[ModelCache]:
        """Remove rows (indices into the current batch): their caches, in order; the rest stay, compacted."""
        out = self._rows(rows) if rows else []
        gone = set(rows)
        kept = [b for b in range(self.size) if b not in gone]
        idx = torch.tensor(kept, dtype=torch.long, device=self.model.embed.weight.device)
        if self._graphs is not None:  # compacted in place: the graphs' storage keeps its addresses
            self._graphs.compact(idx)
            if not kept:
                self._graphs.release()
        else:
            for owner, name in self.fields():
                setattr(owner, name, getattr(owner, name).index_select(0, idx))
        self.rings = {k: (keep, [lens[b] for b in kept]) for k, (keep, lens) in self.rings.items()}
        self.pos = [self.pos[b] for b in kept]
        self.dspark = [self.dspark[b] for b in kept]
        return out

    def _banks_hold(self, end: int) -> bool:
        """Whether every ratio's bank has a slot (besides the trash slot) for a row of `end` tokens."""
        return all(end // r <= s - 1 for r, s in self.slots.items())

    def extend(self, caches: list[ModelCache]) -> bool:
        """Add rows (caches fed up to their seq_len) after the live ones, in place: the new rows are laid
        out by a batch of their own with this one's bank size, then copied into the rows after the live
        ones (on graph storage, into its padding rows, whose addresses the graphs read; else each field
        grows by them). Returns False, changing nothing, where they do not fit: a decode batch only,
        more rows than the storage holds, other cache fields, or a row the banks cannot hold (the caller
        then rebuilds the batch with every row). A join then costs one copy of the new rows instead of
        a split and a rebuild of all of them."""
        n, k = self.size, len(caches)
        room = self._graphs.capacity if self._graphs is not None else None
        if self.slack or not n or not caches or (room is not None and n + k > room):
            return False
        if not self._banks_hold(max(c.seq_len for c in caches) + 1):
            return False
        mine = self.fields()
        # the new rows' tensors are made as this batch's were (inference tensors or not: a compiled step
        # guards on it)
        inference = getattr(*mine[0]).is_inference()
        with torch.inference_mode(inference):
            new = RaggedBatch(self.model, caches, self.max_tokens, hasher=self.hasher)
        theirs = new.fields()
        if [name for _, name in mine] != [name for _, name in theirs] or any(
            getattr(o, a).shape[1:] != getattr(q, b).shape[1:] or getattr(o, a).dtype != getattr(q, b).dtype
            for (o, a), (q, b) in zip(mine, theirs)
        ) or new.rb != self.rb or set(self.rings) != set(new.rings):
            return False
        if self._graphs is not None:
            self._graphs.put(n, [getattr(q, b) for q, b in theirs])
        else:
            with torch.inference_mode(inference):
                for (o, a), (q, b) in zip(mine, theirs):
                    cur = getattr(o, a)
                    # rings keep their spare entry in front (the strides a decode step leaves them)
                    spare = 0 if a in _LAYER_BANKS else 1
                    out = cur.new_zeros(n + k, cur.size(1) + spare, *cur.shape[2:])[:, spare:]
                    out[:n], out[n:] = cur, getattr(q, b)
                    setattr(o, a, out)
        rings, added = self.rings, new.rings
        self.rings = {key: (keep, lens + added[key][1]) for key, (keep, lens) in rings.items()}
        self.pos = self.pos + new.pos
        self.dspark = self.dspark + new.dspark
        return True

    def split(self) -> list[ModelCache]:
        """Every row's cache, in order (the batch is empty afterwards)."""
        return self.take(list(range(self.size)))


# live-row counts decode graphs are captured for: n live rows run in the smallest bucket >= n
GRAPH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
# with a compiled forward each bucket costs compiles (one per kind of layer, and again for every bank
# size it meets: the banks' shapes are the graphs' too; for `small` on an H100 ~100 s at 1 row,
# ~150-240 s at 64): fewer buckets, more padding (a step's time grows far slower than its rows below 256)
COMPILED_BUCKETS = (1, 4, 16, 64, 128, 256)
# dynamo backend of compile_decode ("aot_eager" traces the same graphs without inductor's kernels:
# an ablation of the fusion itself)
COMPILE_BACKEND = "inductor"


def compile_decode(model: Transformer) -> Callable:
    """model.forward_ragged for decode steps with each layer compiled: `run_layer` (Engram + block)
    goes through torch.compile, and layers of one kind (attention role, ratio, Engram or not) and
    shapes share one compiled graph, their parameters and caches being its inputs (dynamo's
    inline_inbuilt_nn_modules), so a bucket costs a compile per kind of layer, not one of the whole
    model; the attention layout and the head (`ragged_head`) are compiled on their own (the decode
    step's n-gram hash too: `compile_step_hashes`), the embedding and the cache copies around the
    layers stay eager. Static shapes (one
    compile per kind and batch shape, so per bucket; dynamo's automatic dynamic shapes would make one
    graph serve every bucket, but on an H100 that graph of `small` did not finish compiling in the
    ~6 minutes a run left it, where the static 64-row one took 4), inductor's own CUDA graphs off (a GraphPool
    captures the compiled step with the cache copy-backs around it), bf16 rounding of fused
    intermediates kept as eager rounds them (emulate_precision_casts), so compiled steps stay within
    rounding of eager ones. Triton kernels of impl=triton compile in as user kernels; a layer's MoE
    reads expert offset tables refreshed eagerly before each compiled call (kernels/moe.py
    expert_offsets: a traced region cannot read data pointers). Dynamo keeps the compiled graphs on
    `run_layer`'s code object, so a later engine's compile_decode replays them without compiling."""
    # each (kind of layer, bucket, bank size) is a cache entry of run_layer's code object: dynamo's
    # default of 8 would silently leave later ones eager. Room for every one a process can meet (at most
    # a kind per layer, a bank size per rung of bank_tokens up to max_seq_len)
    rungs, size = 0, 0
    while size < model.args.max_seq_len:
        size, rungs = bank_tokens(size + 1, model.args.max_seq_len), rungs + 1
    entries = model.args.n_layers * len(GRAPH_BUCKETS) * rungs
    cfg = torch._dynamo.config
    cfg.recompile_limit = max(cfg.recompile_limit, entries)
    cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, 4 * entries)
    compiled = _compile(run_layer)

    def layer_fn(layer, *args):
        layer.ffn.refresh_expert_offsets()  # eager: weights that moved get new offset tables
        return compiled(layer, *args)

    # the glue around the layers compiled too: eager, the layout and the head were ~80 small kernels of
    # a `small` step (one per op: the layout's index arithmetic, the final collapse and norm)
    return functools.partial(model.forward_ragged, layer_fn=layer_fn, layout_fn=_compile(build_ragged_layout),
                             head_fn=_compile(ragged_head))  # fmt: skip


def compile_step_hashes(hasher: EngramHasher) -> Callable:
    """`hasher.step_hashes` compiled for the decode steps of compile_decode: eager, a step's n-gram hash
    is ~34 small integer ops (one kernel each on CUDA). Its constant tables are made eagerly first."""
    compiled = _compile(EngramHasher.step_hashes)

    def step_hashes(ids_B: torch.Tensor, context_BC: torch.Tensor, pos_B: torch.Tensor) -> torch.Tensor:
        hasher.tables(ids_B.device)
        return compiled(hasher, ids_B, context_BC, pos_B)

    return step_hashes


def _compile(fn: Callable) -> Callable:
    """torch.compile as compile_decode compiles: static shapes, COMPILE_BACKEND, the options below."""
    import torch._inductor.config as inductor_config

    # Python floats passed to the Triton kernels typed fp32, as Triton's own launcher types them
    # (inductor's default, fp64, breaks kernels that feed them to fp32-only math such as sqrt_rn)
    wanted = {"emulate_precision_casts": True, "_use_fp64_for_unbacked_floats": False}
    options = (
        {k: v for k, v in wanted.items() if hasattr(inductor_config, k)} if COMPILE_BACKEND == "inductor" else None
    )
    return torch.compile(fn, dynamic=False, backend=COMPILE_BACKEND, options=options)


_MAX_STORAGES = 4  # batch layouts a pool keeps storage and graphs for (the oldest idle one goes first)


class GraphPool:
    """CUDA graphs of `RaggedBatch.decode` steps and the storage they run on, kept across batches
    (an engine owns one). A batch's layout (rows, every cache tensor's shape and dtype, the model
    and where its weights are) keys one storage; a later batch of the same layout is copied into it
    and replays its graphs. All graphs share one memory pool: they never run concurrently, and a
    step's outputs are copied out before the next replay. `captures` counts the graphs captured
    (each costs one eager step)."""

    def __init__(self, buckets: tuple[int, ...] = GRAPH_BUCKETS):
        self.buckets = tuple(sorted(buckets))
        self.captures = 0
        self._storages: dict[tuple, _Storage] = {}
        self._mempool = None
        self._weight_slots: dict[int, list[tuple[torch.nn.Module, str]]] = {}

    def _weights(self, model: torch.nn.Module) -> tuple[int, ...]:
        """Where the model's weights are now. The graphs read the weights where they were at capture:
        a model whose tensors moved (loaded with assign, moved between devices) keys new storage and
        graphs. The (module, name) slots are listed once per model (walking the module tree every batch
        cost ~10 ms a batch build for `small` under cProfile); reading each slot's tensor again sees a
        parameter replaced in place."""
        slots = self._weight_slots.get(id(model))
        if slots is None:
            slots = self._weight_slots[id(model)] = [
                (m, name) for m in model.modules() for name, p in m._parameters.items() if p is not None
            ]
        return tuple(m._parameters[name].data_ptr() for m, name in slots)

    def capacity(self, n: int) -> int:
        """Rows a batch of n live rows is padded to."""
        return next((b for b in self.buckets if b >= n), n)

    def attach(self, batch: RaggedBatch) -> _BatchGraphs | None:
        """Move the batch's tensors into the storage of its layout (None: that storage is in use by
        another batch, which then stays eager)."""
        fields = batch.fields()
        tensors = [getattr(o, name) for o, name in fields]
        key = (id(batch.model), self._weights(batch.model), batch.max_tokens,
               tuple((name, type(o).__name__, getattr(o, "packed", None), t.dtype, tuple(t.shape))
                     for (o, name), t in zip(fields, tensors)))  # fmt: skip
        st = self._storages.get(key)
        if st is None:
            idle = [k for k, v in self._storages.items() if not v.busy]
            if len(self._storages) >= _MAX_STORAGES and idle:
                del self._storages[idle[0]]
            st = self._storages[key] = _Storage(tensors)
        elif st.busy:
            return None
        else:
            for (o, name), dst, src in zip(fields, st.tensors, tensors):
                dst.copy_(src)
                setattr(o, name, dst)
        st.busy = True
        return _BatchGraphs(self, st, batch, fields)


class _Storage:
    """One layout's tensors (capacity rows), the decode inputs and the graphs captured on them."""

    def __init__(self, tensors: list[torch.Tensor]):
        dev, cap = tensors[0].device, tensors[0].size(0)
        self.tensors = tensors
        self.ids = torch.zeros(cap, 1, dtype=torch.long, device=dev)
        self.pos = torch.zeros(cap, dtype=torch.long, device=dev)
        self.ones = torch.ones(cap, dtype=torch.long, device=dev)
        self.graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, object]] = {}
        self.busy = False


class _BatchGraphs:
    """A batch's view of its storage: decode steps run on the first bucket(rows) rows of it (the
    rows past the live ones are padding at position 0: their cache entries are never read back)."""

    def __init__(self, pool: GraphPool, st: _Storage, batch: RaggedBatch, fields: list[tuple[object, str]]):
        self.pool, self.st, self.batch, self.fields = pool, st, batch, fields
        self.views: list[torch.Tensor] = []
        self.views_b = 0
        # st.pos holds the rows' positions of the last step: the next step adds one on the device,
        # unless rows moved (a new batch, a compaction) and the host's positions are copied in again
        self.pos_on_device = False

    def decode(self, ids: list[int] | torch.Tensor, hidden: bool):
        st, n = self.st, len(ids)
        b = self.pool.capacity(n)
        pad = [0] * (b - n)
        if isinstance(ids, torch.Tensor):  # the last step's sampled tokens, still on the device
            st.ids[:n, 0].copy_(ids)
        else:
            st.ids[:b, 0].copy_(torch.tensor(ids + pad), non_blocking=True)
        if self.pos_on_device:
            st.pos[:n].add_(1)
        else:
            st.pos[:b].copy_(torch.tensor(self.batch.pos + pad), non_blocking=True)
            self.pos_on_device = True
        if b != self.views_b:  # the cache fields as views of the bucket's rows (the same from step to step)
            self.views, self.views_b = [t[:b] for t in st.tensors], b
        for (o, name), v in zip(self.fields, self.views):
            setattr(o, name, v)
        key = (b, hidden)
        if key in st.graphs:
            graph, out = st.graphs[key]
            graph.replay()
        else:  # this step runs eagerly on a side stream (it compiles and warms up), then is captured
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                out = self._forward(b, hidden)
            torch.cuda.current_stream().wait_stream(side)
            if self.pool._mempool is None:
                self.pool._mempool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            # a compiled forward must not compile while capturing (its warm-up above compiled this shape)
            with torch.cuda.graph(graph, pool=self.pool._mempool), torch.compiler.set_stance("fail_on_recompile"):
                st.graphs[key] = (graph, self._forward(b, hidden))
            self.pool.captures += 1
        if hidden:
            return out[0][:n].clone(), None if out[1] is None else out[1][:n].clone()
        return out[:n].clone()

    def _forward(self, b: int, hidden: bool):
        """forward_ragged over the storage's first b rows, the updated rings copied back into it."""
        st, batch = self.st, self.batch
        eng = batch.step_engram(st.ids[:b, 0], st.pos[:b])
        out = batch.forward(
            st.ids[:b], st.pos[:b], st.ones[:b], batch.cache, max_end=batch.max_tokens, bank_slots=batch.bank_slots,
            engram_inputs=eng, return_main_hidden=hidden,
        )  # fmt: skip
        for (o, name), v in zip(self.fields, self.views):
            new = getattr(o, name)
            if new is not v:
                v.copy_(new)
                setattr(o, name, v)
        return out

    @property
    def capacity(self) -> int:
        """Rows the storage holds (the bucket it was built for)."""
        return self.st.tensors[0].size(0)

    def put(self, start: int, tensors: list[torch.Tensor]) -> None:
        """Write rows into the storage from row `start` on (the batch's fields in order, rows first), in
        place; the next step copies every row's position in again."""
        for (o, name), t, src in zip(self.fields, self.st.tensors, tensors):
            t[start : start + src.size(0)] = src
            setattr(o, name, t)
        self.pos_on_device, self.views_b = False, 0

    def compact(self, idx: torch.Tensor) -> None:
        """Keep rows idx (in order) as the first rows of the storage, in place."""
        for (o, name), t in zip(self.fields, self.st.tensors):
            t[: idx.numel()] = t.index_select(0, idx)
            setattr(o, name, t)
        self.pos_on_device, self.views_b = False, 0

    def release(self) -> None:
        self.st.busy = False


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
    hc = a.hc_mult
    return {**out, "raw_kv": f32, "raw_score": f32, "recent_ids": w.new_zeros(1, 0, dtype=torch.long),
            "encoder_h": w.new_zeros(1, 0, hc, a.dim), "encoder_pre": w.new_zeros(1, 0, hc, dtype=torch.float32),
            "packed": packed}  # fmt: skip


def _bank(rows: list[torch.Tensor], slots: int, index: dict) -> torch.Tensor:
    """Banks [1,G_b,E] stacked into [B, slots, E] at slot = group number, zeros elsewhere (`index`: _fill's)."""
    like = rows[0]
    out = like.new_zeros(len(rows), slots, like.size(-1))
    lens = [x.size(1) for x in rows]
    if max(lens) > slots - 1:
        raise ValueError(f"a bank of {max(lens)} groups does not fit {slots - 1} slots: raise max_tokens")
    _fill(out, rows, lens, right=False, index=index)
    return out


def _fill(out: torch.Tensor, rows: list, lens: list[int], right: bool, index: dict) -> None:
    """out[b] takes row b's entries rows[b][0] ([1,n_b,...] or None), right-aligned (rings) or from
    entry 0 (banks), in one copy for all rows (a `small` batch has ~35 such fields). `index`
    keeps the copy's indices by the rows' lengths (`_entries`). `out` is a fresh allocation (a ring: a
    view one entry into it), whose entries `_entry_rows` can address."""
    if not any(lens):
        return
    flat = torch.cat([x for x, n in zip(rows, lens) if n], dim=1)[0]
    pitch = _pitch(out)
    at = _entries(index, range(len(lens)), lens, out.size(1), pitch, right, out.device)
    _entry_rows(out, pitch).index_copy_(0, at, flat)


def _gather(x: torch.Tensor, rows: list[int], lens: list[int], right: bool, index: dict) -> tuple[torch.Tensor, ...]:
    """`_fill`'s inverse: row rows[k]'s lens[k] entries of x [B,K,...] (its newest if right, else its first),
    each [1,lens[k],...], views of one gathered copy (a row of none: an empty view). One gather and one
    split for all rows: a view per row and field is the most numerous host work of a call's set-up."""
    if not any(lens):  # no entries to copy (a field may then hold none at all: nothing to address)
        return (x.new_zeros(1, 0, *x.shape[2:]),) * len(lens)
    pitch = _pitch(x)
    if pitch is None:  # not rows of dense entries (the batch allocates none such)
        x, pitch = x.contiguous(), x.size(1)
    at = _entries(index, rows, lens, x.size(1), pitch, right, x.device)
    return _entry_rows(x, pitch).index_select(0, at)[None].split(lens, dim=1)


def _pitch(x: torch.Tensor) -> int | None:
    """How many entries apart the rows of x [B,K,...] (K > 0) start in its storage, where its entries x[b, k]
    are dense and evenly spaced, as the batch allocates them (a ring is a view one entry into its
    allocation); else None."""
    entry = x[0, 0]
    per = entry.numel()
    if not entry.is_contiguous() or x.stride(1) != per or x.stride(0) % per:
        return None
    return x.stride(0) // per


def _entry_rows(x: torch.Tensor, pitch: int) -> torch.Tensor:
    """x [B,K,...] of row pitch `pitch` (`_pitch`) as one [M,...] view of its entries in memory order: entry
    (b, k) is row b * pitch + k. Copies in and out of it are one index_select / index_copy_ of whole
    entries, which on a CPU runs ~2x the bytes a second of advanced indexing x[rows, cols]."""
    per = x.stride(1)
    return x.as_strided(((x.size(0) - 1) * pitch + x.size(1), *x.shape[2:]), (per, *x.stride()[2:]))


def _entries(index: dict, rows, lens: list[int], width: int, pitch: int, right: bool, device: torch.device):
    """Indices into `_entry_rows`' view of rows' entries in a [B, width, ...] tensor of row pitch `pitch`,
    row rows[k] holding lens[k] entries at its end (right) or from column 0, in row order; kept in `index`
    by the rows and their lengths: the fields of one batch share a few length patterns (every layer's
    window ring, each ratio's banks), so they are built and sent to the device once per pattern instead
    of once per field."""
    key = (tuple(rows), tuple(lens), width, pitch, right)
    at = index.get(key)
    if at is None:
        lens_t = torch.tensor(lens)
        starts = torch.tensor(list(rows), dtype=torch.long) * pitch + ((width - lens_t) if right else 0)
        j_N = torch.arange(int(lens_t.sum())) - torch.repeat_interleave(torch.cumsum(lens_t, 0) - lens_t, lens_t)
        at = index[key] = (torch.repeat_interleave(starts, lens_t) + j_N).to(device)
    return at


__all__ = ["COMPILED_BUCKETS", "GRAPH_BUCKETS", "GRAPH_TOKENS", "GraphPool", "RaggedBatch", "compile_decode",
           "engram_rows"]
