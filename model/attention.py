"""V4.1 sparse attention: a sliding window of raw KV plus top-k compressed KV, one shared KV head.

Holds the torch reference `sparse_attn_ref` (§3.9), the released kernel's blocked bf16-probability
arithmetic and index-list layout for numerics="reference" (`sparse_attn_blocked_ref`,
`reference_window_idxs`), the per-call layout of what each query may see
(window, compressed groups, document boundaries), the explicit per-call sharing state of
Full/Reindex/Reuse layers, the per-layer incremental cache and the `Attention` module (§3.4).
No module globals: everything a layer shares with later layers travels in `SharedAttnState`.
Not here: the compressor (compressor.py), the indexer (indexer.py), mHC/blocks (transformer.py).

Shape legend: B batch, S queries (new tokens) of this call, T window-KV rows (cache tail + new),
G compressed groups (cached + new), N new groups, W window, H heads, Dh head dim, D model dim,
K selected entries per query, r compress ratio, Q q_lora_rank, R/2 complex rope pairs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from model.compressor import Compressor
from model.config import ModelArgs
from model.indexer import Indexer, IndexerOutput
from model.norm import RMSNorm
from model.packed_cache import (
    pack_index_k,
    pack_main_kv,
    pack_window_kv,
    unpack_index_k,
    unpack_main_kv,
    unpack_window_kv,
)
from model.quant import fp4_e4m3_fake_quant, fp8_fake_quant
from model.rope import apply_rotary_emb


# ---------------------------------------------------------------------------- sparse attention
def _gathered_logits(q_BMHD, kv_BND, idxs_BMK, scale, dtype: torch.dtype | None = None):
    """Logits of each query's gathered rows [B,M,H,K] (-inf at -1 slots) and the rows [B,M,K,Dh] fp32.
    kv_BND uint8 (a packed cache's main-KV entries, model/packed_cache.py): only the gathered entries
    are decoded, to `dtype` first (the bank's dense dtype), as the Triton kernel decodes what it picks."""
    B, M, H, Dh = q_BMHD.shape
    K = idxs_BMK.size(-1)
    valid_BMK = idxs_BMK >= 0
    flat = idxs_BMK.clamp(min=0).reshape(B, M * K, 1).expand(B, M * K, kv_BND.size(-1))
    rows = kv_BND.gather(1, flat)  # gathered first: only the picked rows are converted (or decoded)
    kv_BMKD = (unpack_main_kv(rows, dtype) if kv_BND.dtype == torch.uint8 else rows).float().view(B, M, K, Dh)
    logits_BMHK = torch.einsum("bmhd,bmkd->bmhk", q_BMHD.float(), kv_BMKD) * scale
    return logits_BMHK.masked_fill(~valid_BMK[:, :, None, :], -torch.inf), kv_BMKD


def _probs_with_sink(logits_BMHK, attn_sink_H):
    # The sink joins the softmax denominator unscaled and carries no value (§3.9).
    sink_BMH1 = attn_sink_H.float().view(1, 1, -1, 1).expand(*logits_BMHK.shape[:3], 1)
    lse_BMH1 = torch.logsumexp(torch.cat([logits_BMHK, sink_BMH1], dim=-1), dim=-1, keepdim=True)
    return torch.exp(logits_BMHK - lse_BMH1)


def sparse_attn_ref(
    q: torch.Tensor, kv: torch.Tensor, attn_sink: torch.Tensor, idxs: torch.Tensor, scale: float
) -> torch.Tensor:
    """o[b,m,h] = sum_k p_k kv[b, idxs[b,m,k]], p = softmax over {scale*q.kv_k} U {attn_sink[h]}.

    q [B,M,H,Dh], kv [B,N,Dh] (K = V), attn_sink [H] fp32, idxs [B,M,K] int (-1 = invalid).
    The sink enters the denominator only, unscaled; a row with no valid index returns 0. Computed
    in fp32 (the official kernel casts probabilities to bf16 before P.V), returned in q's dtype.
    """
    logits_BMHK, kv_BMKD = _gathered_logits(q, kv, idxs, scale)
    p_BMHK = _probs_with_sink(logits_BMHK, attn_sink)
    return torch.einsum("bmhk,bmkd->bmhd", p_BMHK, kv_BMKD).to(q.dtype)


def sparse_attn_probs_ref(
    q: torch.Tensor, kv: torch.Tensor, attn_sink: torch.Tensor, idxs: torch.Tensor, scale: float
) -> torch.Tensor:
    """The attention probabilities [B,M,H,K] fp32 that `sparse_attn_ref` applies (0 at -1 slots)."""
    return _probs_with_sink(_gathered_logits(q, kv, idxs, scale)[0], attn_sink)


def windowed_sparse_attn(
    q: torch.Tensor,
    kv_win: torch.Tensor,
    win_lo: int,
    win_idxs: torch.Tensor,
    attn_sink: torch.Tensor,
    scale: float,
    ckv: torch.Tensor | None = None,
    cidx: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`sparse_attn_ref(q, cat[kv_win, ckv], attn_sink, cat[win_idxs, cidx + T], scale)`, faster in torch.
    ckv may be a packed cache's uint8 main-KV entries: the picked ones are decoded (to kv_win's dtype).

    The window part uses that query i's window rows are the contiguous range win_lo + i + (0..W-1)
    (masked where win_idxs is -1, as `window_topk_idxs` builds them): queries are cut into blocks
    of C = W and each block attends its C+W-1 rows with one dense GEMM, instead of gathering W
    rows per query. Only the top-k compressed entries (cidx, group indices into ckv) are gathered.
    Returns (o [B,S,H,Dh] in q's dtype, compressed-entry probabilities [B,S,H,Kc] fp32 or None).
    """
    B, S, H, Dh = q.shape
    T, W = kv_win.size(1), win_idxs.size(-1)
    C = max(1, min(W, S))
    n_blk = -(-S // C)
    Sp, L = n_blk * C, C + W - 1
    pad_lo = max(0, -win_lo)
    pad_hi = max(0, win_lo + (n_blk - 1) * C + L - T)
    kvp = F.pad(kv_win.float(), (0, 0, pad_lo, pad_hi))
    first = win_lo + pad_lo
    kv_BNDL = kvp[:, first : first + (n_blk - 1) * C + L].unfold(1, L, C)  # view: block n, row u
    q_BNCHD = F.pad(q.float(), (0, 0, 0, 0, 0, Sp - S)).view(B, n_blk, C, H, Dh)
    logits_BNCHL = torch.einsum("bnchd,bndl->bnchl", q_BNCHD, kv_BNDL) * scale
    # query i = n*C + c sees block row u = c + w for its valid window slots w
    u_SW = (torch.arange(Sp, device=q.device) % C)[:, None] + torch.arange(W, device=q.device)
    valid_BSW = F.pad(win_idxs >= 0, (0, 0, 0, Sp - S))
    allowed = torch.zeros(B, Sp, L, dtype=torch.bool, device=q.device).scatter(-1, u_SW.expand(B, Sp, W), valid_BSW)
    logits_BNCHL = logits_BNCHL.masked_fill(~allowed.view(B, n_blk, C, 1, L), -torch.inf)
    logits_BSHL = logits_BNCHL.view(B, Sp, H, L)
    parts = [logits_BSHL]
    if ckv is not None and cidx is not None and cidx.size(-1) > 0:
        cidx_p = F.pad(cidx, (0, 0, 0, Sp - S), value=-1)
        logits_c, kv_BSKD = _gathered_logits(F.pad(q, (0, 0, 0, 0, 0, Sp - S)), ckv, cidx_p, scale, kv_win.dtype)
        parts.append(logits_c)
    sink = attn_sink.float().view(1, 1, -1, 1).expand(B, Sp, H, 1)
    lse_BSH1 = torch.logsumexp(torch.cat([*parts, sink], dim=-1), dim=-1, keepdim=True)
    p_BNCHL = torch.exp(logits_BSHL - lse_BSH1).view(B, n_blk, C, H, L)
    o_BSHD = torch.einsum("bnchl,bndl->bnchd", p_BNCHL, kv_BNDL).reshape(B, Sp, H, Dh)
    p_comp = None
    if len(parts) == 2:
        p_comp = torch.exp(parts[1] - lse_BSH1)
        o_BSHD = o_BSHD + torch.einsum("bshk,bskd->bshd", p_comp, kv_BSKD)
        p_comp = p_comp[:, :S]
    return o_BSHD[:, :S].to(q.dtype), p_comp


# ---------------------------------------------------------------------------- reference numerics
# numerics="reference" (ModelArgs): the released inference code's arithmetic, for log-probs that
# match an engine serving it. Its kernel runs an online softmax over blocks of this many indices.
REFERENCE_ATTN_BLOCK = 64


def sparse_attn_blocked_ref(
    q: torch.Tensor, kv: torch.Tensor, attn_sink: torch.Tensor, idxs: torch.Tensor, scale: float
) -> torch.Tensor:
    """`sparse_attn_ref` computed as the released kernel computes it (numerics="reference").

    Online softmax over consecutive blocks of REFERENCE_ATTN_BLOCK indices in list order, running
    max initialised at -1e30; each block's probabilities (relative to the running max) are rounded
    to bf16 before P·V while the denominator sums them in fp32; the sink joins the denominator at
    the end; output in q's dtype. Unlike the fp32 reference the result depends on where each index
    sits in `idxs` (block boundaries, summation order): lay the list out as the released code does
    (`reference_window_idxs`, the indexer's reference picks). Autograd differentiates it as written.
    """
    B, M, H, Dh = q.shape
    qf, kvf = q.float(), kv.float()
    acc_BMHD = torch.zeros(B, M, H, Dh, dtype=torch.float32, device=q.device)
    sum_BMH = torch.zeros(B, M, H, dtype=torch.float32, device=q.device)
    max_BMH = torch.full((B, M, H), -1e30, dtype=torch.float32, device=q.device)
    scale_t = torch.tensor(scale, dtype=torch.float32, device=q.device)
    rows_B11 = torch.arange(B, device=q.device).view(B, 1, 1)
    for t in range(0, idxs.size(-1), REFERENCE_ATTN_BLOCK):
        blk_BMK = idxs[:, :, t : t + REFERENCE_ATTN_BLOCK].long()
        valid_BMK = blk_BMK != -1
        kv_BMKD = kvf[rows_B11, blk_BMK.clamp_min(0)] * valid_BMK.unsqueeze(-1)
        s_BMHK = torch.einsum("bmhd,bmkd->bmhk", qf, kv_BMKD)
        s_BMHK = torch.where(valid_BMK.unsqueeze(2), s_BMHK, -torch.inf) * scale_t
        prev_BMH = max_BMH
        max_BMH = torch.maximum(prev_BMH, s_BMHK.amax(dim=-1))
        rescale_BMH = torch.exp(prev_BMH - max_BMH)
        p_BMHK = torch.exp(s_BMHK - max_BMH.unsqueeze(-1))
        sum_BMH = sum_BMH * rescale_BMH + p_BMHK.sum(dim=-1)
        p_bf16 = p_BMHK.to(torch.bfloat16).float()
        acc_BMHD = acc_BMHD * rescale_BMH.unsqueeze(-1) + torch.einsum("bmhk,bmkd->bmhd", p_bf16, kv_BMKD)
    sum_BMH = sum_BMH + torch.exp(attn_sink.float() - max_BMH)
    return (acc_BMHD / sum_BMH.unsqueeze(-1)).to(q.dtype)


def reference_window_idxs(win_idxs: torch.Tensor, q_pos: torch.Tensor) -> torch.Tensor:
    """The window part of the released code's index list, from flashpost's `win_idxs` [B,S,W].

    Its decode step (S = 1 after the prompt) lists the ring oldest first with unfilled slots (-1)
    first: flashpost's order. Its prefill (queries from position 0) lists each query's valid rows
    first, then -1, min(S, W) wide. A call whose rows all start at position 0 (a prefill, a packed
    teacher-forced row) gets the prefill layout; any other call keeps `win_idxs` unchanged.
    """
    if q_pos.size(1) == 0 or not bool((q_pos[:, 0] == 0).all()):
        return win_idxs
    # the valid rows of a query are a contiguous suffix: a stable sort moves them to the front
    order = torch.argsort((win_idxs < 0).to(torch.int8), dim=-1, stable=True)
    return win_idxs.gather(-1, order)[..., : min(win_idxs.size(-1), win_idxs.size(1))]


def window_topk_idxs(q_abs_BS: torch.Tensor, doc_start_BS: torch.Tensor, window: int, base: int = 0) -> torch.Tensor:
    """[B,S,W] window KV rows per query, oldest first: absolute tokens q-W+1 .. q of the query's own
    document, shifted by `base` (absolute index of window-KV row 0); -1 before the document start."""
    t_BSW = q_abs_BS[..., None] - (window - 1) + torch.arange(window, device=q_abs_BS.device)
    return torch.where(t_BSW >= doc_start_BS[..., None], t_BSW - base, -1)


# ---------------------------------------------------------------------------- per-call layout
@dataclass
class GroupLayout:
    """Compressed groups of one ratio r for one call.

    tok_idx [B,N,r]: tokens of each new group, indexing [carried pending tokens ; new tokens].
    anchor_pos [B,N]: RoPE position of each new group = its first token's document position.
    visible [B,S,G]: group g is visible to query s iff same document and g's last token <= s.
    newest [B,S]: newest visible group (-1 none). block_id [B,G]: candidate block of each group
    (blocks restart per document). n_pending_before: tokens of an incomplete group carried in.
    contiguous_block_size: bs when block_id == g // bs for every group (one document per row), so
    block c holds groups c·bs .. c·bs+bs-1 (the Triton Reindex path relies on it); 0 = not so.
    write_idx [B,N] (ragged rows, `build_ragged_layout`): the bank slot each new group is written
    to in a preallocated bank (the trash slot past the visible groups where row b completes none);
    None = new groups are appended after the cached ones.
    """

    ratio: int
    tok_idx: torch.Tensor
    anchor_pos: torch.Tensor
    visible: torch.Tensor
    newest: torch.Tensor
    block_id: torch.Tensor
    n_blocks: int
    n_pending_before: int = 0
    contiguous_block_size: int = 0
    write_idx: torch.Tensor | None = None


@dataclass
class AttnLayout:
    """What every query of one call may see. q_pos [B,S]: RoPE positions (restart per document);
    win_idxs [B,S,W]: window KV rows, query i's being win_lo + i + (0..W-1) where not -1;
    groups: one GroupLayout per compress ratio in the model."""

    q_pos: torch.Tensor
    win_idxs: torch.Tensor
    win_lo: int
    groups: dict[int, GroupLayout]


def _newest(visible_BSG: torch.Tensor) -> torch.Tensor:
    G = visible_BSG.size(-1)
    if G == 0:
        return visible_BSG.new_full(visible_BSG.shape[:2], -1, dtype=torch.long)
    ar = torch.arange(G, device=visible_BSG.device)
    return torch.where(visible_BSG, ar, -1).amax(-1)


def _packed_groups(seg_BS: torch.Tensor, pos_BS: torch.Tensor, ratio: int, block_size: int) -> GroupLayout:
    B, S = seg_BS.shape
    dev = seg_BS.device
    ar = torch.arange(S, device=dev)
    last = (ar + ratio - 1).clamp(max=S - 1).expand(B, S)
    # A group starts at document positions 0, r, 2r, ... and exists only once complete (§3.5).
    anchor = (pos_BS % ratio == 0) & (ar + ratio - 1 < S) & (seg_BS.gather(1, last) == seg_BS)
    N = int(anchor.sum(1).max()) if S else 0
    slot = torch.where(anchor, anchor.cumsum(1) - 1, N)  # N = discard slot
    anchor_tok = torch.zeros(B, N + 1, dtype=torch.long, device=dev).scatter(1, slot, ar.expand(B, S))[:, :N]
    valid = torch.zeros(B, N + 1, dtype=torch.bool, device=dev).scatter(1, slot, anchor)[:, :N]
    anchor_pos = pos_BS.gather(1, anchor_tok)
    g_seg, g_last = seg_BS.gather(1, anchor_tok), anchor_tok + ratio - 1
    visible = valid[:, None, :] & (g_seg[:, None, :] == seg_BS[:, :, None]) & (g_last[:, None, :] <= ar[:, None])
    bs = max(block_size, 1)
    block_id = (((anchor_pos // ratio) % bs == 0).cumsum(1) - 1).clamp(min=0)
    # one host sync per call and ratio (the layout syncs for N already), not one per Reindex layer
    contiguous = torch.equal(block_id, (torch.arange(N, device=dev) // bs).expand(B, N))
    return GroupLayout(
        ratio=ratio,
        tok_idx=anchor_tok[..., None] + torch.arange(ratio, device=dev),
        anchor_pos=anchor_pos,
        visible=visible,
        newest=_newest(visible),
        block_id=block_id,
        n_blocks=int(block_id.max()) + 1 if N else 0,
        contiguous_block_size=bs if contiguous else 0,
    )


def build_packed_layout(doc_ids: torch.Tensor, window: int, ratios: tuple[int, ...], block_size: int) -> AttnLayout:
    """Layout of a teacher-forced call over packed rows (doc_ids [B,S]; a new document starts
    wherever the id changes). Every document behaves as if it ran alone from position 0."""
    B, S = doc_ids.shape
    dev = doc_ids.device
    ar = torch.arange(S, device=dev)
    is_start = torch.ones(B, S, dtype=torch.bool, device=dev)
    is_start[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    seg = is_start.cumsum(1) - 1
    start = torch.cummax(torch.where(is_start, ar, 0), dim=1).values
    pos = ar - start
    win = window_topk_idxs(ar.expand(B, S), start, window)
    groups = {r: _packed_groups(seg, pos, r, block_size) for r in ratios}
    return AttnLayout(q_pos=pos, win_idxs=win, win_lo=1 - window, groups=groups)


def build_incremental_layout(
    batch: int,
    start_pos: int,
    seqlen: int,
    window: int,
    window_base: int,
    ratios: tuple[int, ...],
    block_size: int,
    device: torch.device,
    window_start: int = 0,
) -> AttnLayout:
    """Layout of a call over tokens start_pos .. start_pos+seqlen-1 of one document per row, after
    `start_pos` cached tokens (window KV rows start at absolute token `window_base`).
    `window_start`: the window sees no token before it (CED decoder bounded replay confines local
    attention to its segment, model/ced.py); compressed groups and RoPE keep absolute positions."""
    q_abs = (start_pos + torch.arange(seqlen, device=device)).expand(batch, seqlen)
    win = window_topk_idxs(q_abs, torch.full_like(q_abs, window_start), window, base=window_base)
    bs = max(block_size, 1)
    groups = {}
    for r in ratios:
        g_past, n_new = start_pos // r, (start_pos % r + seqlen) // r
        G = g_past + n_new
        g = torch.arange(G, device=device)
        visible = (g * r + r - 1)[None, None, :] <= q_abs[..., None]
        j = torch.arange(n_new, device=device)
        groups[r] = GroupLayout(
            ratio=r,
            tok_idx=(j[:, None] * r + torch.arange(r, device=device)).expand(batch, n_new, r),
            anchor_pos=((g_past + j) * r).expand(batch, n_new),
            visible=visible,
            newest=(q_abs + 1) // r - 1,
            block_id=(g // bs).expand(batch, G),
            n_blocks=-(-G // bs),
            n_pending_before=start_pos % r,
            contiguous_block_size=bs,
        )
    return AttnLayout(q_pos=q_abs, win_idxs=win, win_lo=start_pos - window + 1 - window_base, groups=groups)


def build_ragged_layout(
    pos_B: torch.Tensor,
    n_B: torch.Tensor,
    seqlen: int,
    window: int,
    window_rows: int,
    ratios: tuple[int, ...],
    block_size: int,
    n_groups: dict[int, int],
    bank_slots: dict[int, int],
) -> AttnLayout:
    """Layout of `seqlen` new tokens per row, row b's first at its own position pos_B[b] and only its
    first n_B[b] real (the rest padding, whose outputs and cache entries the caller drops), for the
    batched caches of model/ragged_cache.py: each row's rings hold `window_rows` entries right-aligned
    (newest last, zeros before its first token), so with the new tokens appended query i's window is
    rows window_rows+i-W+1 .. window_rows+i in every row (-1 before the row's document). Per ratio r
    the bank is indexed by group number: `n_groups[r]` slots (the most any row fills) are visible
    where complete; a row's pending tokens are the last r-1 raw-ring rows (pos % r of them real), the
    (r-1+seqlen)//r candidate groups per row are compressed and written to their slot where all their
    tokens are real, else to the trash slot `bank_slots[r]`."""
    B, S, dev = pos_B.size(0), seqlen, pos_B.device
    ar_S = torch.arange(S, device=dev)
    q_abs = pos_B[:, None] + ar_S
    w = torch.arange(window, device=dev)
    t_BSW = q_abs[..., None] - (window - 1) + w
    win = torch.where(t_BSW >= 0, (window_rows - window + 1 + ar_S)[None, :, None] + w, -1)
    bs = max(block_size, 1)
    groups = {}
    for r in ratios:
        G, N = n_groups[r], (r - 1 + S) // r
        g, j = torch.arange(G, device=dev), torch.arange(N, device=dev)
        p_mod, g0 = (pos_B % r)[:, None], (pos_B // r)[:, None]
        first = (r - 1) - p_mod + j * r  # index of group j's first token in [pending r-1 ; new S]
        done = first < n_B[:, None]  # its last token, new token `first`, is real
        groups[r] = GroupLayout(
            ratio=r,
            tok_idx=(first[..., None] + torch.arange(r, device=dev)).clamp(max=r - 2 + S),
            anchor_pos=(g0 + j) * r,
            visible=(g * r + r - 1)[None, None, :] <= q_abs[..., None],
            newest=((q_abs + 1) // r - 1).clamp(max=G - 1),
            block_id=(g // bs).expand(B, G),
            n_blocks=-(-G // bs),
            n_pending_before=r - 1,
            contiguous_block_size=bs,
            write_idx=torch.where(done, g0 + j, bank_slots[r]),
        )
    return AttnLayout(q_pos=q_abs, win_idxs=win, win_lo=window_rows - window + 1, groups=groups)


# ---------------------------------------------------------------------------- state and caches
@dataclass
class SharedAttnState:
    """What layers publish to later layers within ONE forward call (the reference's module-global
    `shared_attn`, made explicit). compress_kv/index_k are keyed by ratio and hold all groups
    (cached + new): [B,G,Dh] post-RoPE QDQ'd latents, [B,G,Di] index keys. topk_idxs [B,S,K] group
    indices from the latest index source (-1 = none); candidates [B,S,G] from the candidate source,
    with its kept block ids candidate_blocks [B,S,C] (ascending, -1 = dropped)."""

    compress_kv: dict[int, torch.Tensor] = field(default_factory=dict)
    index_k: dict[int, torch.Tensor] = field(default_factory=dict)
    topk_idxs: torch.Tensor | None = None
    candidates: torch.Tensor | None = None
    candidate_blocks: torch.Tensor | None = None
    indexer_losses: list[torch.Tensor] = field(default_factory=list)


@dataclass
class LayerCache:
    """Incremental state of one layer. window_kv [B,T,Dh]: the last window_size-1 (+ max_rollback)
    tokens' KV as attended (post-RoPE, QDQ'd). kv sources also: compress_kv [B,G,Dh], index_k
    [B,G,Di], and for ratio r > 1 raw_kv/raw_score fp32 [B,<=r-1+max_rollback,Dh]: the
    compressor's per-token projections of the newest tokens, the tail of which is the incomplete
    group (the reference's kv_state/score_state). `max_rollback` tokens can be dropped again by
    `truncate` (speculative verification).

    `packed`: window_kv, compress_kv and index_k hold the byte entries of model/packed_cache.py
    (uint8 [B,T,Dh+Dh/32], [B,G,Dh/2+Dh/16], [B,G,Di/2+Di/32]) instead of dense tensors; rows stay
    tokens/groups, so truncation and batching slice and stack them alike. Lossless only for values
    already on the fake-quant grid (QAT on; Attention refuses a packed cache otherwise). `dtype`
    names the dense dtype the entries unpack to (set by the first write). raw_kv/raw_score stay
    fp32 in both modes. Read and extend through `append_window`, `append_bank` and `bank`."""

    ratio: int = 0
    max_rollback: int = 0
    window_kv: torch.Tensor | None = None
    compress_kv: torch.Tensor | None = None
    index_k: torch.Tensor | None = None
    raw_kv: torch.Tensor | None = None
    raw_score: torch.Tensor | None = None
    packed: bool = False
    dtype: str = ""  # a str, not a torch.dtype: engine batching compares plain fields

    def truncate(self, n_drop: int, new_len: int) -> None:
        """Forget the newest `n_drop` tokens (<= max_rollback), leaving `new_len` tokens."""
        if self.window_kv is not None:
            self.window_kv = self.window_kv[:, : self.window_kv.size(1) - n_drop]
        if self.compress_kv is not None:
            g = new_len // self.ratio
            self.compress_kv, self.index_k = self.compress_kv[:, :g], self.index_k[:, :g]
        if self.raw_kv is not None:
            keep = self.raw_kv.size(1) - n_drop
            self.raw_kv, self.raw_score = self.raw_kv[:, :keep], self.raw_score[:, :keep]

    def _dense_dtype(self, like: torch.Tensor) -> torch.dtype:
        name = str(like.dtype).removeprefix("torch.")
        if self.dtype and self.dtype != name:
            raise ValueError(f"packed LayerCache unpacks to {self.dtype}, got a {name} write")
        self.dtype = name
        return like.dtype

    def append_window(self, kv_BSD: torch.Tensor, keep: int) -> torch.Tensor:
        """The window rows attended this call, [cached ; new] [B,T,Dh] dense; stores the newest `keep`."""
        if not self.packed:
            kv_BTD = kv_BSD if self.window_kv is None else torch.cat([self.window_kv, kv_BSD], dim=1)
            self.window_kv = kv_BTD[:, max(0, kv_BTD.size(1) - keep) :]
            return kv_BTD
        dtype = self._dense_dtype(kv_BSD)
        new = pack_window_kv(kv_BSD)  # entries are per row: packing only the new rows is exact
        kv_BTD, rows = kv_BSD, new
        if self.window_kv is not None:
            kv_BTD = torch.cat([unpack_window_kv(self.window_kv, dtype), kv_BSD], dim=1)
            rows = torch.cat([self.window_kv, new], dim=1)
        self.window_kv = rows[:, max(0, rows.size(1) - keep) :]
        return kv_BTD

    def bank(
        self, dtype: torch.dtype | None = None, packed_kv: bool = False, n_groups: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored global bank (compressed KV [B,G,Dh], index keys [B,G,Di]) as dense tensors.
        `packed_kv` (packed caches): the compressed KV stays its uint8 entries, for the Triton
        attention that decodes the entries it gathers instead of the whole bank every call.
        `n_groups`: only the first n_groups slots (a preallocated bank's filled part)."""
        assert self.compress_kv is not None and self.index_k is not None, "no bank in this cache"
        ckv, k = self.compress_kv, self.index_k
        if n_groups is not None:
            ckv, k = ckv[:, :n_groups], k[:, :n_groups]
        if not self.packed:
            return ckv, k
        dtype = dtype or getattr(torch, self.dtype)
        kv = ckv if packed_kv else unpack_main_kv(ckv, dtype)
        return kv, unpack_index_k(k, dtype)

    def append_bank(
        self,
        ckv_BND: torch.Tensor,
        k_BND: torch.Tensor,
        ratio: int,
        packed_kv: bool = False,
        write_idx: torch.Tensor | None = None,
        n_groups: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append new groups to the bank; returns all groups (cached + new) dense (the compressed KV
        as its packed entries with `packed_kv`, see `bank`). `write_idx` [B,N] (a preallocated bank,
        model/ragged_cache.py): the new groups are written in place at those slots and the first
        `n_groups` slots are returned, views of the bank."""
        if write_idx is not None:
            if self.packed:
                self._dense_dtype(ckv_BND)
                ckv_BND, k_BND = pack_main_kv(ckv_BND), pack_index_k(k_BND)
            for bank, new in ((self.compress_kv, ckv_BND), (self.index_k, k_BND)):
                bank.scatter_(1, write_idx[..., None].expand(*write_idx.shape, bank.size(-1)), new.to(bank.dtype))
            return self.bank(packed_kv=packed_kv, n_groups=n_groups)
        if not self.packed:
            if self.compress_kv is not None:
                ckv_BND = torch.cat([self.compress_kv, ckv_BND], dim=1)
                k_BND = torch.cat([self.index_k, k_BND], dim=1)
            self.compress_kv, self.index_k, self.ratio = ckv_BND, k_BND, ratio
            return ckv_BND, k_BND
        dtype = self._dense_dtype(ckv_BND)
        if k_BND.dtype != dtype:
            raise ValueError(f"packed bank: index keys are {k_BND.dtype}, compressed KV {dtype}")
        new_kv, new_k = pack_main_kv(ckv_BND), pack_index_k(k_BND)
        if self.compress_kv is not None:
            old_kv, old_k = self.bank(dtype, packed_kv)
            k_BND = torch.cat([old_k, k_BND], dim=1)
            if not packed_kv:
                ckv_BND = torch.cat([old_kv, ckv_BND], dim=1)
            new_kv, new_k = torch.cat([self.compress_kv, new_kv], dim=1), torch.cat([self.index_k, new_k], dim=1)
        self.compress_kv, self.index_k, self.ratio = new_kv, new_k, ratio
        return (new_kv if packed_kv else ckv_BND), k_BND


@dataclass
class AttnContext:
    """Per-call inputs shared by all layers. freqs_q[c] [B,S,R/2]: query-position phasors of the
    table of layers with (c=True) or without compression; freqs_anchor[r] [B,N,R/2]: group anchors."""

    layout: AttnLayout
    state: SharedAttnState
    freqs_q: dict[bool, torch.Tensor]
    freqs_anchor: dict[int, torch.Tensor]
    qat: bool
    indexer_loss: bool = False
    # The kv sources' caches already hold every group this call's queries see (CED decoder replay:
    # the decoder bank was projected beforehand); they publish it without projecting new groups.
    bank_ready: bool = False
    # [B,S] bool: each batch row is a separate replay segment (model/replay.py) and these its real
    # queries: indexer losses are then per-row means over them ([B] each), not one mean over the call.
    loss_queries: torch.Tensor | None = None


def indexer_alignment_loss(
    out: IndexerOutput, p_comp_BSHK: torch.Tensor, queries_BS: torch.Tensor | None = None
) -> torch.Tensor:
    """KL(p_main || p_index) per query over the entries the indexer selected, mean over queries.

    p_main: the main attention's probabilities at the selected compressed entries (`p_comp_BSHK`,
    per head, from the full softmax incl. window and sink), summed over heads and renormalised
    over those entries; no gradient flows into it. p_index = softmax of the indexer scores over
    the same entries. Only the indexer's parameters receive gradient (its inputs are detached),
    as in DeepSeek sparse attention. Queries with no selected entry are skipped. `queries_BS` (bool):
    one mean per batch row over its True queries, [B] (0 for a row with none), instead of a scalar.
    """
    assert out.topk_scores is not None, "the indexer ran without need_scores=True (or took its restricted path)"
    valid_BSK = out.topk_idxs >= 0
    with torch.no_grad():
        p_BSK = p_comp_BSHK.detach().sum(2) * valid_BSK
        mass_BS1 = p_BSK.sum(-1, keepdim=True)
        target_BSK = p_BSK / mass_BS1.clamp_min(1e-30)
        row_ok = valid_BSK.any(-1) & (mass_BS1.squeeze(-1) > 0)
    logits_BSK = torch.where(valid_BSK, out.topk_scores, -1e30)  # finite: no NaN in backward
    kl_BS = (torch.xlogy(target_BSK, target_BSK) - target_BSK * F.log_softmax(logits_BSK, -1)).sum(-1)
    if queries_BS is not None:
        ok_BS = row_ok & queries_BS
        return (kl_BS * ok_BS).sum(-1) / ok_BS.sum(-1).clamp_min(1)
    if not bool(row_ok.any()):
        return kl_BS.sum() * 0.0
    return kl_BS[row_ok].mean()


def _with_compressed(
    kv_BTD: torch.Tensor, ckv_BGD: torch.Tensor, cidx_BSK: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One KV tensor for the fused kernel: the window rows, then the compressed entries, and the
    compressed part of the index list (-1 kept). Calls that select fewer entries than the bank
    holds (decode: S·K of G) append only the selected ones, query s's K picks at T + s·K.., in
    their order (the kernel then sums the same rows in the same order); others append the bank."""
    B, S, K = cidx_BSK.shape
    T = kv_BTD.size(1)
    if S * K >= ckv_BGD.size(1):
        return torch.cat([kv_BTD, ckv_BGD], dim=1), torch.where(cidx_BSK >= 0, cidx_BSK + T, -1)
    flat = cidx_BSK.clamp(min=0).reshape(B, S * K, 1).expand(B, S * K, ckv_BGD.size(-1))
    kv_all = torch.cat([kv_BTD, ckv_BGD.gather(1, flat)], dim=1)
    at = T + torch.arange(S * K, device=cidx_BSK.device).view(1, S, K)
    return kv_all, torch.where(cidx_BSK >= 0, at, -1)


# ---------------------------------------------------------------------------- the module
class Attention(nn.Module):
    """One layer's attention (§3.4). Every layer computes its own q, window KV, attention and output
    projection; kv sources also own a `compressor`, index sources an `indexer`; Reuse layers read
    compressed KV and top-k from `SharedAttnState`."""

    def __init__(self, args: ModelArgs, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.n_heads, self.head_dim = args.n_heads, args.head_dim
        self.n_groups, self.o_lora_rank = args.o_groups, args.o_lora_rank
        self.window_size = args.window_size
        self.compress_ratio = args.compress_ratio(layer_id)
        self.softmax_scale = self.head_dim**-0.5
        self.attn_sink = nn.Parameter(torch.empty(self.n_heads, dtype=torch.float32))
        self.wq_a = nn.Linear(args.dim, args.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(args.q_lora_rank, args.norm_eps)
        self.wq_b = nn.Linear(args.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wkv = nn.Linear(args.dim, self.head_dim, bias=False)
        self.kv_norm = RMSNorm(self.head_dim, args.norm_eps)
        self.wo_a = nn.Linear(
            self.n_heads * self.head_dim // self.n_groups, self.n_groups * self.o_lora_rank, bias=False
        )
        self.wo_b = nn.Linear(self.n_groups * self.o_lora_rank, args.dim, bias=False)
        self.compressor = Compressor(args, layer_id) if args.is_kv_source(layer_id) else None
        self.indexer = Indexer(args, layer_id) if args.is_index_source(layer_id) else None
        self.sparse_attn = sparse_attn_ref
        self.numerics = args.numerics
        if args.impl == "triton":
            from kernels.sparse_attn import sparse_attn  # chosen at construction (STYLE rule 13)

            self.sparse_attn = sparse_attn

    def forward(self, x_BSD: torch.Tensor, ctx: AttnContext, cache: LayerCache | None = None) -> torch.Tensor:
        """x = attn_norm output [B,S,D] -> [B,S,D]. Reads/extends `cache` when given."""
        B, S, _ = x_BSD.shape
        freqs_BSr = ctx.freqs_q[self.compress_ratio > 0]
        qr_BSQ = self.q_norm(self.wq_a(x_BSD))
        q_BSHD = apply_rotary_emb(self.wq_b(qr_BSQ).view(B, S, self.n_heads, self.head_dim), freqs_BSr)
        kv_BSD = apply_rotary_emb(self.kv_norm(self.wkv(x_BSD)), freqs_BSr)
        if ctx.qat:  # window KV: FP8 over the whole post-RoPE vector (§3.10)
            kv_BSD = fp8_fake_quant(kv_BSD)
        kv_BTD = kv_BSD
        if cache is not None:
            if cache.packed and not ctx.qat:
                raise ValueError("a packed LayerCache is lossless only on the fake-quant grid: run with qat on")
            kv_BTD = cache.append_window(kv_BSD, self.window_size - 1 + cache.max_rollback)
        lay = ctx.layout
        ckv_BGD = cidx_BSK = index_out = p_comp = None
        if self.compress_ratio > 0:
            ckv_BGD, cidx_BSK, index_out = self._compressed(x_BSD, qr_BSQ, freqs_BSr, ctx, cache)
        # a packed cache's main-KV entries: the kernel (or the torch path) decodes the rows it picks
        packed = ckv_BGD is not None and ckv_BGD.dtype == torch.uint8
        if packed and (torch.is_grad_enabled() or ctx.indexer_loss):
            raise ValueError("a packed LayerCache is inference storage: run without gradients or indexer loss")
        if ckv_BGD is not None and not packed:
            ckv_BGD = ckv_BGD.to(kv_BTD.dtype)
        if self.numerics == "reference":
            o_BSHD, p_comp = self._attend_reference(q_BSHD, kv_BTD, ckv_BGD, cidx_BSK, lay, packed, ctx.indexer_loss)
        elif self.sparse_attn is sparse_attn_ref:
            o_BSHD, p_comp = windowed_sparse_attn(
                q_BSHD, kv_BTD, lay.win_lo, lay.win_idxs, self.attn_sink, self.softmax_scale,
                ckv_BGD, cidx_BSK,
            )  # fmt: skip
        else:  # the fused kernel takes one KV tensor and one index list (§3.4 step 4)
            kv_all, idxs_BSK = kv_BTD, lay.win_idxs
            T = kv_BTD.size(1)
            if packed:  # rows past the window come from the packed bank (kernels/sparse_attn.py `ckv=`)
                idxs_BSK = torch.cat([idxs_BSK, torch.where(cidx_BSK >= 0, cidx_BSK + T, -1)], dim=-1)
                o_BSHD = self.sparse_attn(q_BSHD, kv_BTD, self.attn_sink, idxs_BSK, self.softmax_scale, ckv=ckv_BGD)
            else:
                if ckv_BGD is not None:
                    kv_all, cidx_all = _with_compressed(kv_BTD, ckv_BGD, cidx_BSK)
                    idxs_BSK = torch.cat([idxs_BSK, cidx_all], dim=-1)
                o_BSHD = self.sparse_attn(q_BSHD, kv_all, self.attn_sink, idxs_BSK, self.softmax_scale)
            if ctx.indexer_loss and index_out is not None:
                with torch.no_grad():
                    probs = sparse_attn_probs_ref(q_BSHD, kv_all, self.attn_sink, idxs_BSK, self.softmax_scale)
                p_comp = probs[..., lay.win_idxs.size(-1) :]
        if ctx.indexer_loss and index_out is not None:
            ctx.state.indexer_losses.append(indexer_alignment_loss(index_out, p_comp, ctx.loss_queries))
        # Remove the query rotation the rope dims of V picked up (cache stays in one rotated form).
        o_BSHD = apply_rotary_emb(o_BSHD, freqs_BSr, inverse=True)
        # wo_a is block-diagonal over o_groups: group g projects only its own heads.
        o_BSGE = o_BSHD.reshape(B, S, self.n_groups, -1)
        wo_a_GRE = self.wo_a.weight.view(self.n_groups, self.o_lora_rank, -1)
        o_BSGR = torch.einsum("bsge,gre->bsgr", o_BSGE, wo_a_GRE)
        return self.wo_b(o_BSGR.flatten(2))

    def _attend_reference(self, q_BSHD, kv_BTD, ckv_BGD, cidx_BSK, lay: AttnLayout, packed: bool, want_probs: bool):
        """numerics="reference": one index list laid out as the released code's (window part, then
        the indexer's picks shifted past the window rows) through its kernel arithmetic: the torch
        `sparse_attn_blocked_ref` or the Triton kernel (which computes the same way). Returns
        (o [B,S,H,Dh], compressed-entry probabilities for the indexer loss or None)."""
        idxs_BSK = reference_window_idxs(lay.win_idxs, lay.q_pos)
        n_win, T = idxs_BSK.size(-1), kv_BTD.size(1)
        if ckv_BGD is not None:
            idxs_BSK = torch.cat([idxs_BSK, torch.where(cidx_BSK >= 0, cidx_BSK + T, -1)], dim=-1)
        args = (self.attn_sink, idxs_BSK, self.softmax_scale)
        if packed:  # Triton over a packed cache: rows past the window come from the packed bank
            return self.sparse_attn(q_BSHD, kv_BTD, *args, ckv=ckv_BGD, reference=True), None
        kv_all = kv_BTD if ckv_BGD is None else torch.cat([kv_BTD, ckv_BGD], dim=1)
        if self.sparse_attn is sparse_attn_ref:
            o_BSHD = sparse_attn_blocked_ref(q_BSHD, kv_all, *args)
        else:
            o_BSHD = self.sparse_attn(q_BSHD, kv_all, *args, reference=True)
        p_comp = None
        if want_probs and ckv_BGD is not None:
            with torch.no_grad():
                probs = sparse_attn_probs_ref(q_BSHD, kv_all, self.attn_sink, idxs_BSK, self.softmax_scale)
            p_comp = probs[..., n_win:]
        return o_BSHD, p_comp

    def _compress(self, x_BSD: torch.Tensor, gl: GroupLayout, cache: LayerCache | None) -> torch.Tensor:
        """New latents [B,N,Dh]; carries the incomplete group's tokens in and out of `cache`."""
        p = gl.n_pending_before
        pending = None
        if cache is not None and p:
            pending = (cache.raw_kv[:, -p:], cache.raw_score[:, -p:])
        latent_BND, raw = self.compressor(x_BSD, gl.tok_idx, pending)
        if cache is not None and raw is not None:
            keep = gl.ratio - 1 + cache.max_rollback  # what a later call or a rollback may need
            kv, score = raw
            if cache.raw_kv is not None:  # raw already starts with the p carried tokens
                kv = torch.cat([cache.raw_kv[:, : cache.raw_kv.size(1) - p], kv], dim=1)
                score = torch.cat([cache.raw_score[:, : cache.raw_score.size(1) - p], score], dim=1)
            cache.raw_kv, cache.raw_score = (
                kv[:, max(0, kv.size(1) - keep) :],
                score[:, max(0, kv.size(1) - keep) :],
            )
        return latent_BND

    def project_groups(
        self, x_BSD: torch.Tensor, gl: GroupLayout, fa_BNr: torch.Tensor, qat: bool, cache: LayerCache | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A kv source's global bank: the new groups' compressed KV [B,N,Dh] (post-RoPE, QDQ'd) and
        index keys [B,N,Di], appended to `cache` when given; returns all groups (cached + new).
        x is this layer's attention input (attn_norm output); gl/fa its ratio's layout and anchors."""
        r = self.compress_ratio
        latent_BND = self._compress(x_BSD, gl, cache)
        # The indexer consumes the RoPE-free latent; detached so the indexer trains only
        # through its alignment loss.
        assert self.indexer is not None
        if latent_BND.size(1) == 0:  # no group completed in this call (e.g. ratio-2 odd step)
            k_BND, ckv_BND = latent_BND.new_zeros(*latent_BND.shape[:2], self.indexer.head_dim), latent_BND
        else:
            k_BND = self.indexer.index_keys(latent_BND.detach(), fa_BNr, qat)
            ckv_BND = apply_rotary_emb(latent_BND, fa_BNr)  # group j rotates at its anchor position
            if qat:  # compressed main KV: E2M1 with E4M3 scales per 16, post-RoPE (§3.10)
                ckv_BND = fp4_e4m3_fake_quant(ckv_BND)
        if cache is not None:
            ckv_BND, k_BND = cache.append_bank(
                ckv_BND, k_BND, r, packed_kv=self._reads_packed(cache), write_idx=gl.write_idx,
                n_groups=None if gl.write_idx is None else gl.visible.size(-1),
            )  # fmt: skip
        return ckv_BND, k_BND

    def _reads_packed(self, cache: LayerCache | None) -> bool:
        """Whether this layer takes a packed cache's compressed KV as bytes: the Triton kernel and the
        torch path (windowed_sparse_attn) decode the entries they pick; numerics="reference" in torch
        attends a dense bank."""
        if cache is None or not cache.packed:
            return False
        return self.sparse_attn is not sparse_attn_ref or self.numerics != "reference"

    def _compressed(self, x_BSD, qr_BSQ, freqs_BSr, ctx: AttnContext, cache: LayerCache | None):
        """Compressed KV [B,G,Dh] this layer attends and its top-k group indices [B,S,K]."""
        r, st, qat = self.compress_ratio, ctx.state, ctx.qat
        gl = ctx.layout.groups[r]
        if self.compressor is not None:
            if ctx.bank_ready:
                assert cache is not None and cache.compress_kv is not None, "bank_ready needs the bank in the cache"
                ckv_BND, k_BND = cache.bank(packed_kv=self._reads_packed(cache))
            else:
                ckv_BND, k_BND = self.project_groups(x_BSD, gl, ctx.freqs_anchor[r], qat, cache)
            # Published on every call, also when no group completed: a ratio-2 source then scores
            # its OWN keys, fixing the reference's stale-index_k decode bug (model_reference §3.8).
            st.compress_kv[r], st.index_k[r] = ckv_BND, k_BND
        index_out = None
        if self.indexer is not None:
            G = st.index_k[r].size(1)
            if G == 0:
                st.topk_idxs = torch.full((*x_BSD.shape[:2], 0), -1, dtype=torch.long, device=x_BSD.device)
            else:
                index_out = self.indexer(
                    x_BSD.detach(), qr_BSQ.detach(), st.index_k[r], freqs_BSr, gl.visible, qat=qat,
                    candidates_BSG=st.candidates, block_id_BG=gl.block_id, n_blocks=gl.n_blocks,
                    newest_BS=gl.newest, candidate_blocks_BSC=st.candidate_blocks,
                    contiguous_block_size=gl.contiguous_block_size, need_scores=ctx.indexer_loss,
                )  # fmt: skip
                if index_out.candidates is not None:
                    st.candidates, st.candidate_blocks = index_out.candidates, index_out.candidate_blocks
                st.topk_idxs = index_out.topk_idxs
        assert st.topk_idxs is not None, f"layer {self.layer_id} runs before any index source"
        return st.compress_kv[r], st.topk_idxs, index_out
