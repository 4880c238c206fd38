"""CED prefill with decoder bounded replay (DESIGN §2), the plan the engine and the training simulation share.

Layers 0..E-1 (E = n_encoder_layers = n_layers // 2) are the encoder, E..n_layers-1 the decoder.
The decoder's one global bank is owned by its first layer E (ratio 1, the only decoder kv source),
whose attention input is a function of the encoder output alone, so the bank of every position can
be projected without running the decoder. CED prefill of a prompt ending at N therefore:
  1. runs the encoder over every new prompt position (chunked, with its caches as usual);
  2. projects the decoder bank (layer E's compressed KV and index keys) for every new position;
  3. replays the decoder layers over the segment [R, N), R = max(0, N - window_size), from the
     remembered encoder output, with decoder local (window) attention confined to the segment and
     global attention to the whole bank at absolute positions ("decoder bounded replay").
Decode steps after it are ordinary `forward_incremental` calls. For N <= window_size the replay
covers the whole prompt, so CED equals full-stack prefill exactly (same ops, same order).

Rule for small layer counts: the split follows the config, E = n_layers // 2 (derive_layer_schedule
puts ratio 2 below it and ratio 1 from it on; debug/tiny: encoder 0-3, decoder 4-7 with bank layer 4).
`check_ced` refuses configs where the plan is not exact (another decoder kv source, Engram or a
DSpark target on the wrong side). `ced_prefill` consumes one start position for every row of a
cache; `ced_prefill_ragged` runs the same plan over the rows of a model/ragged_cache.py RaggedBatch,
each at its own position with its own count (the engine's path). Not here: sessions (model/engine.py), the training
forward over whole trajectories (model/replay.py), prefix-cache tiers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from model.attention import AttnContext, LayerCache, build_incremental_layout, build_ragged_layout
from model.config import ModelArgs
from model.ragged_cache import RaggedBatch
from model.transformer import ModelCache, Streams, Transformer

EngramFn = Callable[[int, torch.Tensor], dict[str, Any] | None]
# Engram inputs of a ragged step: (per-row positions, per-row token ids) -> forward_ragged's engram_inputs
EngramRowsFn = Callable[[list[int], list[list[int]]], dict[str, Any] | None]


def check_ced(args: ModelArgs) -> None:
    """Raise ValueError unless CED with decoder bounded replay is exact for this layer schedule."""
    E, L = args.n_encoder_layers, args.n_layers
    problems = []
    if args.compress_ratio(E) != 1 or not args.is_kv_source(E):
        problems.append(f"layer {E} (first decoder layer) must be a ratio-1 kv source (the decoder bank)")
    if [i for i in range(E + 1, L) if args.is_kv_source(i)]:
        problems.append("no decoder layer after the first may own a global bank (it would need the decoder stream)")
    if [i for i in range(E, L) if args.compress_ratio(i) not in (0, 1)]:
        problems.append("decoder layers must have ratio 1 (or 0)")
    if [i for i in args.engram_layer_ids if i >= E]:
        problems.append(f"Engram layers {args.engram_layer_ids} must be encoder layers (< {E})")
    if [i for i in args.dspark_target_layer_ids if i < E]:
        problems.append(f"DSpark targets {args.dspark_target_layer_ids} must be decoder layers (>= {E})")
    if problems:
        raise ValueError("CED prefill is not exact for this config: " + "; ".join(problems))


def replay_start(prompt_end: int, window: int) -> int:
    """First position of the decoder replay segment of a prompt ending at `prompt_end`."""
    return max(0, prompt_end - window)


def project_decoder_bank(model: Transformer, streams: Streams, ctx: AttnContext, cache: LayerCache | None):
    """Layer E's bank (compressed KV [B,G,Dh], index keys [B,G,Di]) for the positions of `streams`
    (the encoder output of one call whose layout is ctx's), appended to `cache` when given."""
    E = model.args.n_encoder_layers
    block = model.layers[E]
    x_BSD = block.attn_input(streams.h, streams.pre_mix)
    return block.attn.project_groups(x_BSD, ctx.layout.groups[1], ctx.freqs_anchor[1], ctx.qat, cache)


def replay_decoder(
    model: Transformer,
    streams: Streams,
    start: int,
    caches: list[LayerCache],
    *,
    image_mask: torch.Tensor | None = None,
    indexer_loss: bool = False,
) -> AttnContext:
    """Run the decoder layers over the segment [start, start+S) given its encoder output `streams`
    (advanced in place). caches[E] must hold the bank of positions [0, start+S) and no window rows;
    the other decoder caches no window rows either: local attention then sees only the segment,
    global attention the bank at absolute positions. Returns the call's context (indexer losses)."""
    a = model.args
    B, S = streams.h.shape[:2]
    dev = streams.h.device
    layout = build_incremental_layout(
        B, start, S, a.window_size, start, model.ratios, a.candidate_block_size, dev, window_start=start
    )
    ctx = model._context(layout, indexer_loss)
    ctx.bank_ready = True
    model.run_layers(streams, range(a.n_encoder_layers, a.n_layers), ctx, caches, image_mask, None)
    return ctx


@torch.no_grad()
def ced_prefill(
    model: Transformer,
    input_ids: torch.Tensor,
    start_pos: int,
    cache: ModelCache,
    *,
    chunk: int = 512,
    engram_inputs: EngramFn | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """Consume prompt tokens input_ids [B,S] at start_pos (= cache.seq_len) with CED prefill.

    `cache` must remember the encoder output (encoder_out_len >= window_size, set when the session's
    cache is created, so the replay can reach back before start_pos). `engram_inputs(pos, ids)`
    supplies the Engram inputs of the chunk at pos (None: the model's own hasher). Returns
    (next-token logits [B,V] fp32 at the last position, DSpark context [B,n,X] of the replayed
    positions [R, N) or None, n = N - R: the number of positions the decoder ran over).
    """
    a = model.args
    check_ced(a)
    W, E = a.window_size, a.n_encoder_layers
    if cache.encoder_out_len < W:
        raise ValueError(f"the cache keeps {cache.encoder_out_len} encoder outputs; CED replay needs {W}")
    B, S = input_ids.shape
    for p in range(0, S, chunk):
        ids = input_ids[:, p : p + chunk]
        pos = start_pos + p
        enc = model.encode_incremental(ids, pos, cache, engram_inputs=None if engram_inputs is None else
                                       engram_inputs(pos, ids))  # fmt: skip
        project_decoder_bank(model, enc.streams, enc.ctx, cache.layers[E])
    N = cache.seq_len
    R = replay_start(N, W)
    n = N - R
    for i in range(E, a.n_layers):  # the replay rebuilds the decoder windows from the segment only
        cache.layers[i].window_kv = None
    streams = Streams(cache.encoder_h[:, -n:], cache.encoder_pre[:, -n:])
    replay_decoder(model, streams, R, cache.layers)
    _pad_decoder_windows(cache, E, a.n_layers)
    x_BSD, main_hidden = model.collapse(streams)
    return model.head(x_BSD[:, -1].float()), main_hidden, n


@torch.inference_mode()
def ced_prefill_ragged(
    model: Transformer,
    batch: RaggedBatch,
    token_lists: Sequence[Sequence[int]],
    *,
    chunk: int,
    engram_rows: EngramRowsFn | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, list[int]]:
    """`ced_prefill` of every row of `batch` at once, each at its own position with its own count:
    row b consumes token_lists[b][batch.pos[b]:] (at least one token). The encoder runs in ragged
    steps of up to `chunk` tokens per row (one forward per step for all rows, the decoder bank
    projected from each), then ONE decoder replay covers every row's segment [R_b, N_b), padded to
    the longest, its window confined to the row's segment. The batch needs slack >= max(chunk,
    window_size) and caches that remember the encoder output. `engram_rows(pos, ids)`: the Engram
    inputs of a ragged step (None without Engram layers). Returns (next-token logits [B,V] fp32,
    DSpark context [B,S,X] of the replayed positions (row b's first n_b) or None, n_b per row)."""
    a = model.args
    check_ced(a)
    W, E, L = a.window_size, a.n_encoder_layers, a.n_layers
    if batch.cache.encoder_out_len < W:
        raise ValueError(f"the cache keeps {batch.cache.encoder_out_len} encoder outputs; CED replay needs {W}")
    if batch.slack < max(chunk, W):
        raise ValueError(f"a ragged CED prefill needs slack >= max(chunk, window) = {max(chunk, W)}")
    if any(len(t) <= p for t, p in zip(token_lists, batch.pos)):
        raise ValueError("every row of a ragged CED prefill needs at least one token to consume")
    while True:
        ids = [list(t[p : min(len(t), p + chunk)]) for t, p in zip(token_lists, batch.pos)]
        if not any(ids):
            break
        enc = batch.step(ids, None if engram_rows is None else engram_rows(batch.pos, ids), encoder_only=True)
        project_decoder_bank(model, enc.streams, enc.ctx, batch.cache.layers[E])
    dev = model.embed.weight.device
    N = batch.pos
    n = [p - replay_start(p, W) for p in N]
    S, max_end = max(n), max(N)
    # the replay's input: each row's newest n_b encoder outputs (the ring ends at them), left-aligned
    h_ring, pre_ring = batch.cache.encoder_h, batch.cache.encoder_pre
    K = h_ring.size(1)
    n_B = torch.tensor(n, device=dev)
    idx_BS = K - n_B[:, None] + torch.minimum(torch.arange(S, device=dev)[None, :], n_B[:, None] - 1)
    h = h_ring.gather(1, idx_BS[..., None, None].expand(-1, -1, *h_ring.shape[2:]))
    pre = pre_ring.gather(1, idx_BS[..., None].expand(-1, -1, pre_ring.size(2)))
    streams = Streams(h, pre)
    batch.clear_rings(range(E, L))  # the replay rebuilds the decoder windows from the segment only
    R_B = torch.tensor([p - k for p, k in zip(N, n)], device=dev)
    layout = build_ragged_layout(
        R_B, n_B, S, W, batch.cache.layers[E].window_kv.size(1), model.ratios, a.candidate_block_size,
        {r: max_end // r for r in model.ratios}, batch.bank_slots,
    )  # fmt: skip
    # local attention confined to the row's segment (as replay_decoder's window_start)
    t_BSW = layout.q_pos[..., None] - (W - 1) + torch.arange(W, device=dev)
    layout.win_idxs = torch.where(t_BSW >= R_B[:, None, None], layout.win_idxs, -1)
    ctx = model._context(layout, indexer_loss=False, n_pos=max_end + S)
    ctx.bank_ready = True
    bank = batch.cache.layers[E]
    full = bank.compress_kv, bank.index_k
    bank.compress_kv, bank.index_k = full[0][:, :max_end], full[1][:, :max_end]  # the visible slots
    try:
        model.run_layers(streams, range(E, L), ctx, batch.cache.layers, None, None)
    finally:
        bank.compress_kv, bank.index_k = full
    batch.realign(n, S, range(E, L), model_rings=False)
    # as _pad_decoder_windows: the decoder windows count as many rows as the encoder's (zeros before
    # the segment, never read by a later query)
    for i in range(E, L):
        batch.set_ring_lens(i, "window_kv", batch.ring_lens(0, "window_kv"))
    x_BSD, main_hidden = model.collapse(streams)
    logits = model.head(x_BSD[torch.arange(len(n), device=dev), n_B - 1].float())
    return logits, main_hidden, n


@torch.no_grad()
def full_prefill(
    model: Transformer,
    input_ids: torch.Tensor,
    start_pos: int,
    cache: ModelCache,
    *,
    chunk: int = 512,
    engram_inputs: EngramFn | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """The full-stack baseline of `ced_prefill` (same arguments and returns): every layer over every
    prompt position, chunk by chunk, the head only at the last position (main_hidden: last chunk's)."""
    a = model.args
    B, S = input_ids.shape
    for p in range(0, S, chunk):
        ids = input_ids[:, p : p + chunk]
        pos = start_pos + p
        enc = model.encode_incremental(ids, pos, cache, engram_inputs=None if engram_inputs is None else
                                       engram_inputs(pos, ids))  # fmt: skip
        model.run_layers(enc.streams, range(a.n_encoder_layers, a.n_layers), enc.ctx, cache.layers, None,
                         enc.engram_inputs)  # fmt: skip
        x_BSD, main_hidden = model.collapse(enc.streams)
    return model.head(x_BSD[:, -1].float()), main_hidden, S


def _pad_decoder_windows(cache: ModelCache, lo: int, hi: int) -> None:
    """Left-pad the replayed decoder window rows to the encoder's row count, so that one window base
    fits every layer of the next call. The padded rows lie before the segment: no later query's
    window reaches them (a query at p >= N sees p-W+1 > R), so their zero values are never read."""
    ref = cache.layers[0].window_kv
    for i in range(lo, hi):
        kv = cache.layers[i].window_kv
        if ref is not None and kv is not None and kv.size(1) < ref.size(1):
            cache.layers[i].window_kv = F.pad(kv, (0, 0, ref.size(1) - kv.size(1), 0))


def decoder_work(prompt_len: int, window: int, n_encoder_layers: int, n_decoder_layers: int) -> dict[str, float]:
    """The work proxy of one prefill of `prompt_len` tokens in token-layers: full stack n_layers*N,
    CED n_enc*N + n_dec*min(N, window) (released 40 layers: (20N + 20 min(N,128)) / 40N)."""
    full = (n_encoder_layers + n_decoder_layers) * prompt_len
    ced = n_encoder_layers * prompt_len + n_decoder_layers * min(prompt_len, window)
    return {"full": full, "ced": ced, "ratio": ced / full}


__all__ = [
    "check_ced", "ced_prefill", "ced_prefill_ragged", "decoder_work", "full_prefill", "project_decoder_bank",
    "replay_decoder", "replay_start",
]  # fmt: skip
