"""Training-side simulation of CED decoder bounded replay (DESIGN §3 "Simulated decoder replay").

`simulated_forward(model, input_ids, turns, doc_ids)` computes, for trajectories the engine rolled
out with `prefill_mode="ced"`, exactly what the engine computed: the encoder runs once over the
whole (packed) rows, the decoder bank (layer E, ratio 1) is projected once for every position, and
the decoder runs per generation turn k on the segment [max(doc start, N_k - window), T_k) with local
attention confined to the segment and global attention to the shared bank (model/ced.py's replay).
Decoder work is then sum_k (T_k - R_k) tokens instead of the whole row. Gradients flow as in
`Transformer.forward`. Not here: the engine (model/engine.py), losses (rl/).

Turn k of a row is (N_k, T_k) in row coordinates: N_k = the prompt end (Generation.prompt_len, a
Trajectory's turn_starts[k] plus the document's row offset), T_k = N_k + tokens generated in the turn
(`turn_spans` derives them from a Trajectory's turn_starts and loss_mask). `replay_forward` takes a
packed learner batch's per-document turn starts (rl/learner.py's `trainer.simulate_replay`).

Routing replay (`routing=` [B,S,n_layers,K], as an engine with record_routing=True recorded it, -1 rows
routed afresh): the encoder layers are forced over the whole rows, the decoder layers per segment. The
engine records a token's decoder experts once, in the turn that fed it, so turn k's segment forces only
the positions turn k fed (from the previous turn's last generated token, T_{k-1} - 1, or the document
start); the earlier positions it replays were routed afresh by the engine and are here too.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from model.attention import LayerCache, build_packed_layout
from model.ced import check_ced, project_decoder_bank, replay_decoder, replay_start
from model.config import ModelArgs
from model.moe import RouterStats, routing_replay
from model.transformer import Streams, Transformer, TransformerOutput

Turn = tuple[int, int]


@dataclass
class SimulatedOutput(TransformerOutput):
    """TransformerOutput of the simulated plan. logits/hidden/main_hidden are valid where `covered`
    [B,S] bool is True (inside some turn's replay segment) and 0 elsewhere; a position inside several
    segments carries the values of the turn that generated the token it predicts (position p of turn
    k's predictions N_k-1 <= p < T_k-1), else of the earliest segment holding it. router_stats:
    encoder layers as `forward`; decoder layers count the replayed tokens (counts summed over
    segments), with scores 1 (uniform) and topk_idx 0..K-1 outside `covered`: mask balance losses
    with `covered` for them. decoder_tokens: tokens the decoder layers ran over (per layer)."""

    covered: torch.Tensor | None = None
    decoder_tokens: int = 0


def turn_spans(turn_starts: Sequence[int], loss_mask: Sequence[bool]) -> list[Turn]:
    """(N_k, T_k) per generation turn of one trajectory: T_k ends the run of generated tokens at N_k."""
    spans = []
    for n in turn_starts:
        t = n
        while t < len(loss_mask) and loss_mask[t]:
            t += 1
        spans.append((n, t))
    return spans


def simulated_forward(
    model: Transformer,
    input_ids: torch.Tensor,
    turns: Sequence[Sequence[Turn]],
    doc_ids: torch.Tensor | None = None,
    *,
    image_mask: torch.Tensor | None = None,
    compute_indexer_loss: bool | None = None,
    engram_inputs: dict[str, Any] | None = None,
    routing: torch.Tensor | None = None,
) -> SimulatedOutput:
    """The CED rollout plan as a teacher-forced forward. input_ids [B,S]; turns[b]: row b's turns
    (N_k, T_k), row coordinates, each inside one document (doc_ids as in `Transformer.forward`).
    Positions are document-relative, as in the engine's session of that document. routing: the
    rollout's recorded experts [B,S,n_layers,K] to replay (module docstring), or None."""
    a = model.args
    check_ced(a)
    E, W = a.n_encoder_layers, a.window_size
    B, S = input_ids.shape
    if len(turns) != B:
        raise ValueError(f"{len(turns)} turn lists for {B} rows")
    if routing is not None and routing.shape[:3] != (B, S, a.n_layers):
        raise ValueError(f"routing {tuple(routing.shape)} must be [{B}, {S}, {a.n_layers}, K] for input_ids {(B, S)}")
    if compute_indexer_loss is None:
        compute_indexer_loss = torch.is_grad_enabled()
    engram_inputs = model._engram_inputs(input_ids, image_mask, doc_ids, engram_inputs)
    if doc_ids is None:
        doc_ids = torch.zeros_like(input_ids)
    # encoder: once over the whole rows, then the decoder bank of every position
    layout = build_packed_layout(doc_ids, W, model.ratios, a.candidate_block_size)
    ctx = model._context(layout, compute_indexer_loss)
    enc = model.start_streams(model._embed(input_ids, None, None, 0))
    with _forced(None if routing is None else routing[:, :, :E], range(E)):
        model.run_layers(enc, range(E), ctx, None, image_mask, engram_inputs)
    bank_kv, bank_k = project_decoder_bank(model, enc, ctx, None)
    losses = list(ctx.state.indexer_losses)
    doc_start = _doc_starts(doc_ids)

    segments = []  # (row, lo, hi, own_lo, own_hi, x, main_hidden, stats)
    for b, row_turns in enumerate(turns):
        prev_doc, prev_end = -1, 0
        for n_k, t_k in row_turns:
            d = int(doc_start[b, n_k - 1])
            if not (0 < n_k <= t_k <= S) or n_k - 1 < d or int(doc_start[b, t_k - 1]) != d:
                raise ValueError(f"row {b}: turn {(n_k, t_k)} is not inside one document of {S} tokens")
            lo = d + replay_start(n_k - d, W)
            fed = d if d != prev_doc else max(d, prev_end - 1)  # the first position this turn fed
            prev_doc, prev_end = d, t_k
            seg_routing = None
            if routing is not None:
                seg_routing = routing[b : b + 1, lo:t_k, E:].clone()
                seg_routing[:, : max(0, fed - lo)] = -1
            caches = [LayerCache() for _ in range(a.n_layers)]
            caches[E] = LayerCache(ratio=1, compress_kv=bank_kv[b : b + 1, d:t_k], index_k=bank_k[b : b + 1, d:t_k])
            seg = Streams(enc.h[b : b + 1, lo:t_k], enc.pre_mix[b : b + 1, lo:t_k])
            mask = None if image_mask is None else image_mask[b : b + 1, lo:t_k]
            with _forced(seg_routing, range(E, a.n_layers)):
                seg_ctx = replay_decoder(model, seg, lo - d, caches, image_mask=mask, indexer_loss=compute_indexer_loss)
            losses += seg_ctx.state.indexer_losses
            x, main_hidden = model.collapse(seg)
            segments.append((b, lo, t_k, n_k - 1, t_k - 1, x[0], main_hidden, seg.stats))
    return _assemble(model, enc, segments, losses, B, S)


def replay_forward(
    model: Transformer,
    input_ids: torch.Tensor,
    doc_ids: torch.Tensor | None,
    turn_starts: Sequence[Sequence[Sequence[int]]],
    *,
    loss_mask: torch.Tensor | None = None,
    compute_indexer_loss: bool | None = None,
    routing: torch.Tensor | None = None,
) -> SimulatedOutput:
    """`simulated_forward` for packed learner batches (rl.payloads.TrainBatch): turn_starts[b][d] are
    document d's turn starts relative to its start (documents d = 0, 1, .. of row b as doc_ids number
    them, padding -1). Turn k ends where its run of generated tokens in `loss_mask` [B,S] ends; without
    a mask at the next turn's start (or the document's end), which leaves the log-probs of generated
    tokens unchanged (the decoder is causal) and only adds the tool tokens to the decoder work; routing
    replay (`routing`, TrainBatch.routing) needs the mask, for each turn's first fed position.
    `model` may be wrapped (a DeepSpeed engine: its `.module` is used, ZeRO stage 0)."""
    model = getattr(model, "module", model)
    if turn_starts is None:
        raise ValueError("replay_forward needs the batch's turn_starts (rl.payloads.pack records them)")
    if routing is not None and loss_mask is None:
        raise ValueError("replay_forward with routing needs the batch's loss_mask (where each turn's tokens end)")
    B, S = input_ids.shape
    if doc_ids is None:
        doc_ids = torch.zeros_like(input_ids)
    turns: list[list[Turn]] = []
    for b in range(B):
        row, ids_b = [], doc_ids[b].tolist()
        for d, starts in enumerate(turn_starts[b]):
            lo = ids_b.index(d)
            hi = lo + ids_b.count(d)
            mask = None if loss_mask is None else loss_mask[b, lo:hi].tolist()
            for k, n in enumerate(starts):
                end = hi - lo if k + 1 == len(starts) else starts[k + 1]
                if mask is not None:
                    end = turn_spans([n], mask)[0][1]
                row.append((lo + n, lo + end))
        turns.append(row)
    return simulated_forward(
        model, input_ids, turns, doc_ids, compute_indexer_loss=compute_indexer_loss, routing=routing
    )


def _forced(routing: torch.Tensor | None, layers: range) -> AbstractContextManager:
    """routing_replay of `layers` (routing [..., len(layers), K]), or nothing without a routing."""
    return nullcontext() if routing is None else routing_replay(routing, layers)


def _doc_starts(doc_ids: torch.Tensor) -> torch.Tensor:
    B, S = doc_ids.shape
    ar = torch.arange(S, device=doc_ids.device).expand(B, S)
    is_start = torch.ones_like(doc_ids, dtype=torch.bool)
    is_start[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    return torch.cummax(torch.where(is_start, ar, 0), dim=1).values


def _assemble(model: Transformer, enc: Streams, segments: list, losses: list, B: int, S: int) -> SimulatedOutput:
    """Write the segments' results into [B,S] tensors: every segment in reverse order (earliest
    wins), then each turn's own prediction range, so the generating turn wins there."""
    a = model.args
    E = a.n_encoder_layers
    ref = enc.h
    x_BSD = ref.new_zeros(B, S, a.dim)
    covered = torch.zeros(B, S, dtype=torch.bool, device=ref.device)
    mh = None
    if segments and segments[0][6] is not None:
        mh = ref.new_zeros(B, S, segments[0][6].size(-1))
    owner = torch.full((B, S), -1, dtype=torch.long, device=ref.device)
    for j in reversed(range(len(segments))):
        b, lo, hi = segments[j][:3]
        owner[b, lo:hi] = j
    for j, (b, lo, _, own_lo, own_hi, *_) in enumerate(segments):
        owner[b, max(lo, own_lo) : own_hi] = j
    # index_put with the owner map keeps autograd to every segment
    for j, (b, lo, hi, _, _, x, main_hidden, _) in enumerate(segments):
        sel = (owner[b, lo:hi] == j).nonzero().squeeze(-1)
        x_BSD = x_BSD.index_put((torch.full_like(sel, b), sel + lo), x[sel])
        if mh is not None:
            mh = mh.index_put((torch.full_like(sel, b), sel + lo), main_hidden[0, sel])
        covered[b, lo:hi] |= owner[b, lo:hi] == j
    # the head over covered positions only (about a third of a long-prompt row): elsewhere x is 0 and
    # the bias-free head gives exactly the 0 logits SimulatedOutput documents
    b_idx, s_idx = covered.nonzero(as_tuple=True)
    logits = torch.zeros(B, S, model.head.out_features, dtype=torch.float32, device=ref.device)
    logits = logits.index_put((b_idx, s_idx), model.head(x_BSD[b_idx, s_idx].float()))
    stats = enc.stats + [_merge_stats([seg[7][i] for seg in segments], [seg[:3] for seg in segments], owner, a, B, S)
                         for i in range(a.n_layers - E)]  # fmt: skip
    indexer_loss = torch.stack(losses).mean() if losses else logits.new_zeros(())
    decoder_tokens = sum(hi - lo for _, lo, hi, *_ in segments)
    return SimulatedOutput(logits, stats, indexer_loss, x_BSD, mh, covered=covered, decoder_tokens=decoder_tokens)


def _merge_stats(
    stats: list[RouterStats], spans: list[tuple[int, int, int]], owner: torch.Tensor, ref: ModelArgs, B: int, S: int
) -> RouterStats:
    """One decoder layer's RouterStats over all segments, scores/topk laid out on [B,S] (see SimulatedOutput)."""
    if not stats:  # no turn at all: nothing went through the decoder
        E_, K = ref.n_routed_experts, ref.n_activated_experts
        zeros = torch.zeros(E_, device=owner.device)
        ones = torch.ones(B, S, E_, device=owner.device)
        return RouterStats(zeros.long(), zeros, torch.arange(K, device=owner.device).expand(B, S, K).clone(), ones)
    n_tok = sum(hi - lo for _, lo, hi in spans)
    counts = torch.stack([s.counts for s in stats]).sum(0)
    mean_prob = sum(s.mean_prob * (hi - lo) for s, (_, lo, hi) in zip(stats, spans)) / n_tok
    E_, K = stats[0].scores.size(-1), stats[0].topk_idx.size(-1)
    scores = stats[0].scores.new_ones(B, S, E_)
    topk = torch.arange(K, device=scores.device).expand(B, S, K).clone()
    for j, (s, (b, lo, hi)) in enumerate(zip(stats, spans)):
        sel = (owner[b, lo:hi] == j).nonzero().squeeze(-1)
        idx = (torch.full_like(sel, b), sel + lo)
        scores = scores.index_put(idx, s.scores.reshape(hi - lo, E_)[sel])
        topk = topk.index_put(idx, s.topk_idx.reshape(hi - lo, K)[sel])
    return RouterStats(counts, mean_prob, topk, scores)


__all__ = ["SimulatedOutput", "Turn", "replay_forward", "simulated_forward", "turn_spans"]
