"""The V4.1 lightning indexer: picks, per query, the compressed KV entries the attention reads.

Holds the deterministic top-k (`topk_indices`, the one tie rule of the default numerics), the torch
reference of the scores (`index_scores_ref`; kernels/indexer.py is the Triton one), the released
code's bf16 scores and torch.topk picks (numerics="reference"), the first level
of hierarchical indexing (`select_candidate_blocks`) and the `Indexer` module (model_reference
§3.6-3.7). It does not build compressed KV (compressor.py) nor attend (attention.py); which
queries may see which groups comes in as a mask from the caller's layout.

Shape legend: B batch, S queries of this call, G compressed groups (cached + new), N new groups,
I index heads, Di index head dim, NB candidate blocks, C kept candidate blocks, K selected entries.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from model.config import ModelArgs
from model.norm import RMSNorm
from model.quant import mxfp4_fake_quant
from model.rope import apply_rotary_emb


def topk_indices(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-`k` along the last dim with flashpost's DETERMINISTIC TIE RULE.

    Among equal scores the NEWER (larger) position wins. After the indexer's ReLU many scores are
    exactly 0, so ties at the cut are common and `torch.topk`'s device-dependent order would change
    which entries are attended (DESIGN.md §2). The rule is implemented once, here; every path of the
    default numerics (indexer, candidate blocks, tests, the Triton engine) must use it;
    numerics="reference" calls torch.topk. `-inf` entries sort last and are returned like any other
    pick; NaN sorts first (as in a descending sort); -0.0 ties with 0.0.
    Returns (values, indices), both [..., min(k, n)], in descending score order.

    Computed as `torch.topk` of a unique int64 key: the score's fp32 bits mapped to an order-preserving
    int32 (negative floats have their 31 magnitude bits flipped) in the high half, the position in the
    low half, so equal scores order by position, newest first. O(n) per row where the stable sort of
    all n scores was O(n log n) (tests/model/test_indexer.py checks it against that sort).
    """
    n = scores.size(-1)
    k = min(k, n)
    if n >= 2**31:
        raise ValueError(f"topk_indices keys positions in 31 bits; got {n} entries")
    x = scores.float() + 0.0  # + 0.0 turns -0.0 into 0.0 (they tie)
    bits = x.view(torch.int32)
    ordered = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).masked_fill(x.isnan(), 2**31 - 1).long()
    key = (ordered << 32) | torch.arange(n, device=scores.device)
    idx = key.topk(k, dim=-1).values & 0xFFFFFFFF
    return scores.gather(-1, idx), idx


def index_scores_ref(
    q_BSID: torch.Tensor, k_BGD: torch.Tensor, w_BSI: torch.Tensor, visible_BSG: torch.Tensor | None = None
) -> torch.Tensor:
    """Indexer scores [B,S,G] fp32: `score = Σ_i relu(q_i · k_g) · w_i` (§3.6 step 5), -inf where
    `visible_BSG` (bool, None = all visible) is False. q/k in any float dtype are multiplied in fp32;
    w [B,S,I] fp32 already carries the weight scale. Materialises [B,S,I,G] fp32: a reference only."""
    dots_BSIG = torch.einsum("bsid,bgd->bsig", q_BSID.float(), k_BGD.float())
    # ReLU per head BEFORE the weighted head sum (§3.6 step 5).
    score_BSG = torch.einsum("bsig,bsi->bsg", dots_BSIG.relu(), w_BSI)
    return score_BSG if visible_BSG is None else score_BSG.masked_fill(~visible_BSG, -torch.inf)


MIN_SCORE_COLUMNS = 16


def causal_index_scores(
    q_BSID: torch.Tensor, k_BGD: torch.Tensor, w_BSI: torch.Tensor, visible_BSG: torch.Tensor, chunk: int = 128
) -> torch.Tensor:
    """`index_scores_ref`'s values [B,S,G] fp32 without autograd (the picks take no gradient), computed
    per chunk of `chunk` queries over only the groups some query of the chunk sees: causality and
    document boundaries leave most of [S,G] invisible in a training row, and the [B,S,I,G] product of
    the reference is then never built for it. The same einsums on slices: the same masking and values
    up to fp32 summation order (the CPU BLAS picks its kernel by matrix shape, and which shapes round
    alike differs between CPUs; tested to 1e-5 relative)."""
    B, S, _, _ = q_BSID.shape
    G = k_BGD.size(1)
    score_BSG = torch.full((B, S, G), -torch.inf, dtype=torch.float32, device=q_BSID.device)
    seen_SG = visible_BSG.any(0)
    with torch.no_grad():
        for lo in range(0, S, chunk):
            cols = seen_SG[lo : lo + chunk].any(0).nonzero()
            if cols.numel() == 0:
                continue
            g0, g1 = int(cols[0]), int(cols[-1]) + 1
            # >= 16 groups wide: on common CPUs GEMMs this wide round like the full-width one (the BLAS
            # takes another kernel below ~12 columns), so the values usually match bit for bit; the extra
            # groups are masked anyway
            g1 = min(G, max(g1, g0 + MIN_SCORE_COLUMNS))
            g0 = max(0, min(g0, g1 - MIN_SCORE_COLUMNS))
            rows = slice(lo, lo + chunk)
            score_BSG[:, rows, g0:g1] = index_scores_ref(
                q_BSID[:, rows], k_BGD[:, g0:g1], w_BSI[:, rows], visible_BSG[:, rows, g0:g1]
            )
    return score_BSG


def gathered_index_scores(
    q_BSID: torch.Tensor, k_BGD: torch.Tensor, w_BSI: torch.Tensor, idx_BSK: torch.Tensor
) -> torch.Tensor:
    """`index_scores_ref` at the picked groups only, [B,S,K] fp32 (junk where idx_BSK is -1), with
    autograd: all the alignment loss differentiates (§3.6: it reads the scores of the selected entries),
    at S·K instead of S·G dot products. Equal to the dense scores up to fp32 summation order (tested)."""
    B, S, K = idx_BSK.shape
    flat = idx_BSK.clamp(min=0).reshape(B, S * K, 1).expand(B, S * K, k_BGD.size(-1))
    k_BSKD = k_BGD.float().gather(1, flat).view(B, S, K, -1)
    dots_BSIK = torch.einsum("bsid,bskd->bsik", q_BSID.float(), k_BSKD)
    return torch.einsum("bsik,bsi->bsk", dots_BSIK.relu(), w_BSI)


def index_scores_bf16_ref(
    q_BSID: torch.Tensor, k_BGD: torch.Tensor, w_BSI: torch.Tensor, visible_BSG: torch.Tensor | None = None
) -> torch.Tensor:
    """`index_scores_ref` in the released code's arithmetic (numerics="reference"): the q·k GEMM,
    ReLU, head weighting and head sum all in the inputs' dtype (bf16), -inf where not visible.
    w [B,S,I] is `weights_proj(x)·scale` in that dtype too. Returns [B,S,G] in q's dtype."""
    dots_BSIG = torch.einsum("bsid,bgd->bsig", q_BSID, k_BGD)
    score_BSG = (dots_BSIG.relu() * w_BSI.unsqueeze(-1)).sum(dim=2)
    return score_BSG if visible_BSG is None else score_BSG.masked_fill(~visible_BSG, -torch.inf)


def torch_topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`torch.topk` (sorted), whose order among ties is the implementation's: the released code's
    candidate-block pick (numerics="reference"); same contract as `topk_indices`."""
    return scores.topk(min(k, scores.size(-1)), dim=-1)


def top_candidate_blocks(
    bscore_BSNB: torch.Tensor, pinned_BS: torch.Tensor, topk_blocks: int, topk=topk_indices
) -> torch.Tensor:
    """The kept candidate blocks [B,S,C] (C = min(topk_blocks, NB)) in ascending order, -1 first.

    Block `pinned_BS` (-1 = none) scores +inf; of the top `topk_blocks` (ties: newer block wins),
    those scoring -inf are dropped (-1). Ascending order keeps the newer-wins tie rule when a later
    top-k runs over the blocks' groups laid out in this order (kernels/indexer.py restricted scores).
    """
    n_blocks = bscore_BSNB.size(-1)
    pin_BSNB = (torch.arange(n_blocks, device=bscore_BSNB.device) == pinned_BS[..., None]) & (pinned_BS[..., None] >= 0)
    top_vals, top_idx = topk(bscore_BSNB.masked_fill(pin_BSNB, torch.inf), topk_blocks)
    return torch.where(top_vals > -torch.inf, top_idx, -1).sort(dim=-1).values


def candidate_block_ids(
    scores_BSG: torch.Tensor,
    block_id_BG: torch.Tensor,
    n_blocks: int,
    newest_BS: torch.Tensor,
    topk_blocks: int,
    topk=topk_indices,
) -> torch.Tensor:
    """Level one of hierarchical indexing (§3.7): the kept candidate blocks [B,S,C], ascending, -1 first.

    A block's score is the max over its groups (unreachable groups are already -inf). The block
    holding the query's newest visible group (`newest_BS`, -1 = none) is pinned with +inf: it is
    partly filled and would otherwise lose to older full blocks. Of the top `topk_blocks` blocks
    (ties: newer block wins), those scoring -inf are dropped (-1). Blocks are given per group by
    `block_id_BG` rather than by position // block_size, so that in packed batches blocks restart
    at every document, exactly as when the document runs alone. `topk`: the tie rule
    (`topk_indices`, or `torch_topk` under numerics="reference").
    """
    B, S, G = scores_BSG.shape
    blk_BSG = block_id_BG[:, None, :].expand(B, S, G)
    bscore_BSNB = scores_BSG.new_full((B, S, n_blocks), -torch.inf)
    bscore_BSNB = bscore_BSNB.scatter_reduce(-1, blk_BSG, scores_BSG, reduce="amax", include_self=True)
    pinned_BS = torch.where(newest_BS >= 0, block_id_BG.gather(1, newest_BS.clamp(min=0)), -1)
    return top_candidate_blocks(bscore_BSNB, pinned_BS, topk_blocks, topk)


def candidate_mask(blk_BSC: torch.Tensor, block_id_BG: torch.Tensor, n_blocks: int) -> torch.Tensor:
    """The bool candidate pool [B,S,G]: groups whose block is among the kept blocks `blk_BSC`."""
    B, S, _ = blk_BSC.shape
    G = block_id_BG.size(1)
    # dropped picks (-1) scatter into a spare last slot
    keep_BSNB = torch.zeros(B, S, n_blocks + 1, dtype=torch.bool, device=blk_BSC.device)
    keep_BSNB = keep_BSNB.scatter(-1, torch.where(blk_BSC >= 0, blk_BSC, n_blocks), True)[..., :n_blocks]
    return keep_BSNB.gather(-1, block_id_BG[:, None, :].expand(B, S, G))


def select_candidate_blocks(
    scores_BSG: torch.Tensor,
    block_id_BG: torch.Tensor,
    n_blocks: int,
    newest_BS: torch.Tensor,
    topk_blocks: int,
) -> torch.Tensor:
    """The bool candidate pool [B,S,G] of §3.7: `candidate_block_ids` expanded by `candidate_mask`."""
    blk_BSC = candidate_block_ids(scores_BSG, block_id_BG, n_blocks, newest_BS, topk_blocks)
    return candidate_mask(blk_BSC, block_id_BG, n_blocks)


@dataclass
class IndexerOutput:
    """topk_idxs: [B,S,K] int64 group indices in ascending order, -1 = nothing selected.
    scores: [B,S,G] fp32 scores after visibility/candidate masking (-inf = not selectable); None
    when a Reindex layer took the restricted path (`Indexer.forward`), which never builds them: only
    the indexer alignment loss reads scores, and asking for it (`need_scores`) keeps the dense path.
    candidates: [B,S,G] bool and candidate_blocks: [B,S,C] int64 (the kept block ids, ascending,
    -1 = dropped), both only from the candidate source layer. topk_scores [B,S,K] fp32: the scores at
    topk_idxs (junk at -1), the tensor the alignment loss differentiates; None with `scores`. On the
    torch impl (default numerics) `scores` carries no gradient and topk_scores is recomputed at the picks
    (`gathered_index_scores`); elsewhere it is gathered from the differentiable `scores`."""

    topk_idxs: torch.Tensor
    scores: torch.Tensor | None
    candidates: torch.Tensor | None = None
    candidate_blocks: torch.Tensor | None = None
    topk_scores: torch.Tensor | None = None


class Indexer(nn.Module):
    """Scores compressed groups per query: `score = sum_h relu(q_h . k) * w_h` (§3.6).

    `wq_b` reads the attention's shared `qr`; `weights_proj` reads the attention input x. Only a
    kv source ("owns_k", a Full layer) has `wk`/`k_norm` and produces index keys from its RoPE-free
    latent; Reindex layers score the keys published by the latest kv source, inside its candidate
    pool. There is no stale-key fallback: a ratio-2 source always scores its own key cache (the
    reference instead scores the previous publisher's keys on decode steps with an incomplete
    group, model_reference §3.8; DESIGN.md fixes that). The score op comes from `args.impl` at
    construction: `index_scores_ref`, or the Triton `kernels.indexer.index_scores` (same contract,
    no [B,S,I,G] buffer). With impl="triton" a Reindex layer at inference scores only its candidate
    pool (`kernels.indexer.index_scores_restricted`): no [B,S,G] score matrix at all.
    numerics="reference" (either impl) scores densely in bf16 (`index_scores_bf16_ref`) and picks with
    `torch.topk` as the released code does (`_reference_topk`, `torch_topk` for candidate blocks).
    """

    def __init__(self, args: ModelArgs, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.compress_ratio = args.compress_ratio(layer_id)
        self.owns_k = args.is_kv_source(layer_id)
        self.is_candidate_source = args.is_candidate_source(layer_id)
        self.uses_candidates = args.uses_candidates(layer_id)
        self.candidate_topk_blocks = args.candidate_topk_blocks
        self.candidate_block_size = args.candidate_block_size
        self.n_heads = args.index_n_heads
        self.head_dim = args.index_head_dim
        self.index_topk = args.index_topk
        # Both constants of the reference are folded into the head weights (§3.6 step 4).
        self.weight_scale = self.head_dim**-0.5 * self.n_heads**-0.5
        self.wq_b = nn.Linear(args.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.weights_proj = nn.Linear(args.dim, self.n_heads, bias=False)
        if self.owns_k:
            self.wk = nn.Linear(args.head_dim, self.head_dim, bias=False)
            self.k_norm = RMSNorm(self.head_dim, args.norm_eps)
        self.index_scores = index_scores_ref
        self.index_scores_restricted = None  # Reindex layers with impl="triton" only
        self.numerics = args.numerics
        if args.numerics == "reference":
            # bf16 scores and torch.topk picks over the dense [B,S,G] scores, on either impl: the
            # released code's arithmetic (the Triton score kernels accumulate in fp32)
            self.index_scores = index_scores_bf16_ref
        elif args.impl == "triton":
            # chosen at construction (STYLE rule 13)
            from kernels.indexer import index_scores, index_scores_restricted

            self.index_scores = index_scores
            if self.uses_candidates:
                self.index_scores_restricted = index_scores_restricted

    def index_keys(self, latent_BND: torch.Tensor, freqs_BNr: torch.Tensor, qat: bool) -> torch.Tensor:
        """Index keys [B,N,Di] of new groups from the RoPE-free latent: k_norm(wk), RoPE at the group
        anchor positions, MXFP4 QDQ (post-RoPE)."""
        k_BND = self.k_norm(self.wk(latent_BND))
        k_BND = apply_rotary_emb(k_BND, freqs_BNr)
        return mxfp4_fake_quant(k_BND) if qat else k_BND

    def queries(
        self, x_BSD: torch.Tensor, qr_BSQ: torch.Tensor, freqs_BSr: torch.Tensor, qat: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Index queries q [B,S,I,Di] (RoPE, then MXFP4 QDQ under QAT) and head weights w [B,S,I] fp32."""
        B, S, _ = x_BSD.shape
        q_BSID = self.wq_b(qr_BSQ).view(B, S, self.n_heads, self.head_dim)
        q_BSID = apply_rotary_emb(q_BSID, freqs_BSr)
        if qat:
            q_BSID = mxfp4_fake_quant(q_BSID)
        w_BSI = self.weights_proj(x_BSD)
        if self.numerics != "reference":  # the released code weights the heads in bf16
            w_BSI = w_BSI.float()
        return q_BSID, w_BSI * self.weight_scale

    def scores(
        self,
        x_BSD: torch.Tensor,
        qr_BSQ: torch.Tensor,
        index_k_BGD: torch.Tensor,
        freqs_BSr: torch.Tensor,
        qat: bool,
    ) -> torch.Tensor:
        """Raw scores [B,S,G] in fp32 (no masking)."""
        q_BSID, w_BSI = self.queries(x_BSD, qr_BSQ, freqs_BSr, qat)
        return self.index_scores(q_BSID, index_k_BGD, w_BSI)

    def _takes_restricted_path(
        self,
        tensors: tuple[torch.Tensor, ...],
        candidate_blocks_BSC: torch.Tensor | None,
        contiguous_block_size: int,
        need_scores: bool,
    ) -> bool:
        """Whether this call scores only the candidate pool (`index_scores_restricted`).

        Needs the Triton impl in a Reindex layer, the candidate source's kept blocks, blocks that are
        contiguous runs of candidate_block_size groups (the kernel maps block c to groups
        c·bs .. c·bs+bs-1; packed rows with several documents restart blocks per document), no
        caller asking for the dense scores (the alignment loss), and no gradient: the restricted
        kernel is forward only, and the indexer trains through the dense, differentiable scores.
        """
        if self.index_scores_restricted is None or candidate_blocks_BSC is None or need_scores:
            return False
        if contiguous_block_size != self.candidate_block_size:
            return False
        if not torch.is_grad_enabled():
            return True
        return not any(t.requires_grad for t in (*tensors, *self.parameters()))

    def forward(
        self,
        x_BSD: torch.Tensor,
        qr_BSQ: torch.Tensor,
        index_k_BGD: torch.Tensor,
        freqs_BSr: torch.Tensor,
        visible_BSG: torch.Tensor,
        *,
        qat: bool,
        candidates_BSG: torch.Tensor | None = None,
        block_id_BG: torch.Tensor | None = None,
        n_blocks: int = 0,
        newest_BS: torch.Tensor | None = None,
        candidate_blocks_BSC: torch.Tensor | None = None,
        contiguous_block_size: int = 0,
        need_scores: bool = True,
    ) -> IndexerOutput:
        """Select up to `index_topk` visible groups per query.

        Picks whose score is -inf (invisible, or outside the candidate pool) become -1. The
        reference keeps such picks when they are visible but outside the pool; that only happens
        when the pool is smaller than index_topk, which no released configuration allows.
        A Reindex layer given the candidate source's kept blocks `candidate_blocks_BSC` (and
        `contiguous_block_size` of the layout, 0 = blocks not contiguous) may take the restricted
        path (`_takes_restricted_path`): same picks, `scores` None.
        """
        q_BSID, w_BSI = self.queries(x_BSD, qr_BSQ, freqs_BSr, qat)
        inputs = (x_BSD, qr_BSQ, index_k_BGD)
        if self._takes_restricted_path(inputs, candidate_blocks_BSC, contiguous_block_size, need_scores):
            assert candidate_blocks_BSC is not None
            idx_BSK = self._restricted_topk(q_BSID, index_k_BGD, w_BSI, visible_BSG, candidate_blocks_BSC)
            return IndexerOutput(idx_BSK, None)
        # torch impl, default numerics: picks from gradient-free scores over the visible range only
        # (found by host syncs, which a compiled forward cannot make: it scores every group, masked)
        lean = self.index_scores is index_scores_ref and not torch.compiler.is_compiling()
        if lean:
            score_BSG = causal_index_scores(q_BSID, index_k_BGD, w_BSI, visible_BSG)
        else:
            score_BSG = self.index_scores(q_BSID, index_k_BGD, w_BSI, visible_BSG)
        reference = self.numerics == "reference"
        candidates = blocks = None
        if self.is_candidate_source:
            assert block_id_BG is not None and newest_BS is not None
            blocks = candidate_block_ids(
                score_BSG.detach(), block_id_BG, n_blocks, newest_BS, self.candidate_topk_blocks,
                torch_topk if reference else topk_indices,
            )  # fmt: skip
            candidates = candidate_mask(blocks, block_id_BG, n_blocks)
        elif self.uses_candidates:
            assert candidates_BSG is not None, f"layer {self.layer_id} needs the candidate pool"
            score_BSG = score_BSG.masked_fill(~candidates_BSG, -torch.inf)
        if reference:
            idx_BSK = self._reference_topk(score_BSG.detach(), visible_BSG)
        else:
            vals_BSK, idx_BSK = topk_indices(score_BSG.detach(), self.index_topk)
            idx_BSK = torch.where(vals_BSK > -torch.inf, idx_BSK, -1)
            # Position order like the reference (-1 first); attention does not depend on the order.
            idx_BSK = idx_BSK.sort(dim=-1).values
        topk_scores = None
        if need_scores:
            if lean:
                topk_scores = gathered_index_scores(q_BSID, index_k_BGD, w_BSI, idx_BSK)
            else:
                topk_scores = score_BSG.gather(-1, idx_BSK.clamp(min=0))
        return IndexerOutput(idx_BSK, score_BSG, candidates, blocks, topk_scores)

    def _reference_topk(self, score_BSG: torch.Tensor, visible_BSG: torch.Tensor) -> torch.Tensor:
        """The released code's picks: `torch.topk(sorted=False)` (its tie order), sorted ascending,
        then -1 for groups the query cannot see, left in place (the -1 land last). Unlike the default
        path, a visible pick outside the candidate pool (score -inf, when the pool holds fewer than
        index_topk groups) stays selected, as there."""
        K = min(self.index_topk, score_BSG.size(-1))
        idx_BSK = score_BSG.topk(K, dim=-1, sorted=False).indices.sort(dim=-1).values
        return torch.where(visible_BSG.gather(-1, idx_BSK), idx_BSK, -1)

    def _restricted_topk(
        self,
        q_BSID: torch.Tensor,
        index_k_BGD: torch.Tensor,
        w_BSI: torch.Tensor,
        visible_BSG: torch.Tensor,
        blocks_BSC: torch.Tensor,
    ) -> torch.Tensor:
        """topk_idxs [B,S,K] (K = min(index_topk, G), as the dense path) from the candidate blocks'
        scores [B,S,C·bs]. The kernel lays the pool out in ascending group order (blocks ascending,
        groups ascending inside each block), so `topk_indices`' newer-wins tie rule picks the same
        groups as over the dense, pool-masked [B,S,G] scores."""
        K = min(self.index_topk, index_k_BGD.size(1))
        score_BSN, ids_BSN = self.index_scores_restricted(
            q_BSID.contiguous(), index_k_BGD.contiguous(), w_BSI.contiguous(), blocks_BSC,
            self.candidate_block_size, visible_BSG,
        )  # fmt: skip
        vals_BSK, pos_BSK = topk_indices(score_BSN, K)
        idx_BSK = torch.where(vals_BSK > -torch.inf, ids_BSN.gather(-1, pos_BSK), -1)
        # a pool smaller than K (few blocks kept): the dense path's extra picks are all -1
        idx_BSK = torch.nn.functional.pad(idx_BSK, (0, K - idx_BSK.size(-1)), value=-1)
        return idx_BSK.sort(dim=-1).values
