"""Prefix-cache tiers of CED sessions (DESIGN §2): persistent global banks and an ephemeral window pool.

An entry is the state of a session after consuming a token prefix, keyed by the prefix's hash
(sha256 of its int64 ids). Two tiers:
  global  every layer's compressed KV and index keys (packed: FP4 E2M1 + E4M3/16 and MXFP4, exactly
          the training fake quant, model/packed_cache.py; dense when QAT is off), the compressors'
          pending half groups (fp32) and the Engram context ids; in memory and, given `root`, on disk
          as one safetensors file per prefix. Persistent. A packed live cache's banks are these bytes
          already: they are copied, not unpacked and packed again.
  window  every layer's window (SWA) KV as the live cache holds it (FP8 entries or dense) and the
          remembered encoder output; in memory only, dropped `window_ttl_s` seconds after it was stored.
`lookup` restores the longest stored prefix of a prompt (leaving at least one token to feed) into
LayerCaches of the caller's live format (dense, or packed with `packed_cache`). On a
global hit with a window miss, encoder bounded replay rebuilds the encoder windows and encoder
output from the last window_size cached tokens, with local attention confined to them and global
attention to the restored banks, which it does not rewrite; the decoder windows are rebuilt by the
CED prefill of the tokens that follow (its decoder replay), so a restored cache must continue with a
CED prefill. Only CED sessions (model/ced.py) are cached. Not here: eviction of the global tier.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from model.attention import LayerCache, build_incremental_layout
from model.ced import EngramFn, check_ced
from model.packed_cache import pack_index_k, pack_main_kv, unpack_index_k, unpack_main_kv
from model.transformer import ModelCache, Transformer

COUNTERS = ("global_hit", "global_miss", "window_hit", "window_miss", "stores")


def prefix_key(token_ids: Sequence[int]) -> str:
    return hashlib.sha256(torch.tensor(list(token_ids), dtype=torch.int64).numpy().tobytes()).hexdigest()


class PrefixCache:
    """The two tiers for one model config (`packed`: store banks in the packed byte format, which is
    exact only for QAT caches). `clock` gives seconds (time.monotonic by default)."""

    def __init__(
        self,
        root: str | Path | None = None,
        *,
        packed: bool = True,
        window_ttl_s: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.root = None if root is None else Path(root)
        self.packed, self.window_ttl_s, self.clock = packed, window_ttl_s, clock
        self.counters = dict.fromkeys(COUNTERS, 0)
        self._global: dict[str, dict[str, torch.Tensor]] = {}
        self._window: dict[str, tuple[float, dict[str, torch.Tensor | None]]] = {}
        self._lengths: set[int] = set()
        if self.root is not None:
            self.root.mkdir(parents=True, exist_ok=True)
            for path in self.root.glob("*.safetensors"):  # what earlier processes stored
                with safe_open(path, "pt") as f:
                    self._lengths.add(int(f.metadata()["seq_len"]))

    # ------------------------------------------------------------------ store
    def store(self, token_ids: Sequence[int], cache: ModelCache) -> str:
        """Record a one-row cache that has consumed exactly `token_ids`; returns the key."""
        if cache.seq_len != len(token_ids) or cache.encoder_h is None or cache.encoder_h.size(0) != 1:
            raise ValueError("store takes a one-row CED cache (encoder_out_len > 0) that consumed exactly token_ids")
        key = prefix_key(token_ids)
        if key not in self._global and not self._on_disk(key):
            tensors = self._global_tensors(cache)
            self._global[key] = tensors
            if self.root is not None:
                save_file({k: v.contiguous() for k, v in tensors.items()}, self._path(key),
                          metadata={"seq_len": str(cache.seq_len)})  # fmt: skip
        window = {f"{i}.window_kv": layer.window_kv for i, layer in enumerate(cache.layers)}
        window |= {"encoder_h": cache.encoder_h, "encoder_pre": cache.encoder_pre}
        self._window[key] = (self.clock(), {k: None if t is None else t.clone() for k, t in window.items()})  # owned
        self._lengths.add(len(token_ids))
        self.counters["stores"] += 1
        return key

    def _global_tensors(self, cache: ModelCache) -> dict[str, torch.Tensor]:
        out = {}
        for i, layer in enumerate(cache.layers):
            if layer.compress_kv is not None:
                dtype = getattr(torch, layer.dtype) if layer.packed else layer.compress_kv.dtype
                kv, k = _bank_as(layer.compress_kv, layer.index_k, layer.packed, self.packed, dtype)
                out[f"{i}.compress_kv"], out[f"{i}.index_k"] = kv, k
                out[f"{i}.ratio"] = torch.tensor([layer.ratio])
            if layer.raw_kv is not None:
                out[f"{i}.raw_kv"], out[f"{i}.raw_score"] = layer.raw_kv, layer.raw_score
        if cache.recent_ids is not None:
            out["recent_ids"] = cache.recent_ids
        # copies (here and in the window tier): a live row is a view of its batch's gathered tensors
        # (model/ragged_cache.py), which a stored view would keep alive for as long as the entry
        return {name: t.detach().to("cpu", copy=True) for name, t in out.items()}

    def _path(self, key: str) -> Path:
        assert self.root is not None
        return self.root / f"{key}.safetensors"

    def _on_disk(self, key: str) -> bool:
        return self.root is not None and self._path(key).exists()

    # ------------------------------------------------------------------ lookup
    def lookup(
        self,
        model: Transformer,
        token_ids: Sequence[int],
        *,
        max_rollback: int = 0,
        engram_inputs: EngramFn | None = None,
        device: torch.device | str = "cpu",
        packed_cache: bool = False,
    ) -> tuple[ModelCache | None, str]:
        """The cache of the longest stored proper prefix of `token_ids` (None: global miss) and how it
        was restored: "warm" (both tiers), "replayed" (encoder bounded replay) or "miss".
        `engram_inputs(pos, ids)` as in model.ced.ced_prefill (None: the model's own hasher).
        `packed_cache`: the restored LayerCaches hold packed entries (the engine's live format)."""
        check_ced(model.args)
        if self.packed and not model.args.qat:
            raise ValueError("packed banks are exact only for QAT caches: use PrefixCache(packed=False) with qat off")
        for n in sorted((x for x in self._lengths if x < len(token_ids)), reverse=True):
            key = prefix_key(token_ids[:n])
            tensors = self._global.get(key)
            if tensors is None and self._on_disk(key):
                with safe_open(self._path(key), "pt") as f:
                    tensors = self._global[key] = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
            if tensors is None:
                continue
            self.counters["global_hit"] += 1
            cache = self._restore_global(model, tensors, n, max_rollback, packed_cache, torch.device(device))
            stamp, window = self._window.get(key, (None, None))
            if window is not None and self.clock() - stamp <= self.window_ttl_s:
                if (window["0.window_kv"].dtype == torch.uint8) != packed_cache:
                    raise ValueError("the window tier holds the live format of the engine that stored it: "
                                     "one PrefixCache serves engines of one packed_cache setting")
                self.counters["window_hit"] += 1
                for i, layer in enumerate(cache.layers):
                    layer.window_kv = window[f"{i}.window_kv"]
                cache.encoder_h, cache.encoder_pre = window["encoder_h"], window["encoder_pre"]
                return cache, "warm"
            self._window.pop(key, None)
            self.counters["window_miss"] += 1
            encoder_replay(model, token_ids[:n], cache, engram_inputs)
            return cache, "replayed"
        self.counters["global_miss"] += 1
        return None, "miss"

    def _restore_global(
        self, model: Transformer, tensors: dict, n: int, max_rollback: int, packed_cache: bool, device
    ) -> ModelCache:
        a = model.args
        dtype = model.embed.weight.dtype
        cache = ModelCache(max_rollback=max_rollback, encoder_out_len=a.window_size, seq_len=n)
        # a packed layer names its dense dtype up front (the live ones learn it from their first write):
        # encoder replay reads the bank before it writes, and batching compares the field
        name = str(dtype).removeprefix("torch.") if packed_cache else ""
        cache.layers = [LayerCache(max_rollback=max_rollback, packed=packed_cache, dtype=name)
                        for _ in range(a.n_layers)]  # fmt: skip
        for i, layer in enumerate(cache.layers):
            if f"{i}.compress_kv" in tensors:
                kv, k = _bank_as(tensors[f"{i}.compress_kv"], tensors[f"{i}.index_k"], self.packed, packed_cache, dtype)
                layer.compress_kv, layer.index_k = kv.to(device), k.to(device)
                layer.ratio = int(tensors[f"{i}.ratio"][0])
            if f"{i}.raw_kv" in tensors:
                layer.raw_kv, layer.raw_score = tensors[f"{i}.raw_kv"].to(device), tensors[f"{i}.raw_score"].to(device)
        if "recent_ids" in tensors:
            cache.recent_ids = tensors["recent_ids"].to(device)
        return cache


def _bank_as(kv: torch.Tensor, k: torch.Tensor, packed: bool, to_packed: bool, dtype: torch.dtype):
    """A bank (compressed KV, index keys) from one storage format to the other: packed entries or dense
    tensors of `dtype`. Exact both ways for values on the QAT grid; a format kept is returned as is."""
    if packed == to_packed:
        return kv, k
    if to_packed:
        return pack_main_kv(kv.float()), pack_index_k(k.float())
    return unpack_main_kv(kv, dtype), unpack_index_k(k, dtype)


@torch.no_grad()
def encoder_replay(model: Transformer, token_ids: Sequence[int], cache: ModelCache, engram_inputs: EngramFn | None):
    """Rebuild the encoder windows and the remembered encoder output of a cache whose banks, pending
    half groups and seq_len (= len(token_ids)) are restored: the encoder layers run over the last
    window_size tokens [R, n) with local attention confined to them and global attention to the
    restored banks (bank_ready: no entry is rewritten). Exact when n <= window_size."""
    a = model.args
    n, W, E = len(token_ids), a.window_size, a.n_encoder_layers
    R = max(0, n - W)
    device = model.embed.weight.device
    ids = torch.tensor([list(token_ids[R:])], dtype=torch.long, device=device)
    if engram_inputs is not None:
        eng = engram_inputs(R, ids)
    else:  # the model's hasher, with the tokens before R as n-gram context
        c = min(R, a.engram_max_ngram_size - 1)
        context = ModelCache(recent_ids=torch.tensor([list(token_ids[R - c : R])], device=device) if c else None)
        eng = model._engram_inputs(ids, None, None, None, context)
    layout = build_incremental_layout(
        1, R, n - R, W, R, model.ratios, a.candidate_block_size, device, window_start=R
    )  # fmt: skip
    ctx = model._context(layout, indexer_loss=False)
    ctx.bank_ready = True
    streams = model.start_streams(model._embed(ids, None, None, R))
    model.run_layers(streams, range(E), ctx, cache.layers, None, eng)
    cache.remember_encoder_out(streams.h, streams.pre_mix)


__all__ = ["COUNTERS", "PrefixCache", "encoder_replay", "prefix_key"]
