"""The V4.1 lightning indexer: picks, per query, the compressed KV entries the attention reads.

Holds the deterministic top-k (`topk_indices`, the one tie rule used everywhere), the first level
of hierarchical indexing (`select_candidate_blocks`) and the `Indexer` module (model_reference
§3.6-3.7). It does not build compressed KV (compressor.py) nor attend (attention.py); which
queries may see which groups comes in as a mask from the caller's layout.

Shape legend: B batch, S queries of this call, G compressed groups (cached + new), N new groups,
I index heads, Di index head dim, NB candidate blocks, K selected entries.
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
    which entries are attended (DESIGN.md §2). The rule is implemented once, here, as a stable
    descending sort of the position-reversed scores; every path (indexer, candidate blocks, tests,
    the Triton engine) must use it. `-inf` entries sort last and are returned like any other pick.
    Returns (values, indices), both [..., min(k, n)], in descending score order.
    """
    n = scores.size(-1)
    k = min(k, n)
    values, rev = torch.sort(scores.flip(-1), dim=-1, descending=True, stable=True)
    return values[..., :k], (n - 1) - rev[..., :k]


def select_candidate_blocks(
    scores_BSG: torch.Tensor,
    block_id_BG: torch.Tensor,
    n_blocks: int,
    newest_BS: torch.Tensor,
    topk_blocks: int,
) -> torch.Tensor:
    """Level one of hierarchical indexing (§3.7): a bool candidate mask [B,S,G].

    A block's score is the max over its groups (unreachable groups are already -inf). The block
    holding the query's newest visible group (`newest_BS`, -1 = none) is pinned with +inf: it is
    partly filled and would otherwise lose to older full blocks. Of the top `topk_blocks` blocks
    (ties: newer block wins), those scoring -inf are dropped. Blocks are given per group by
    `block_id_BG` rather than by position // block_size, so that in packed batches blocks restart
    at every document, exactly as when the document runs alone.
    """
    B, S, G = scores_BSG.shape
    blk_BSG = block_id_BG[:, None, :].expand(B, S, G)
    bscore_BSNB = scores_BSG.new_full((B, S, n_blocks), -torch.inf)
    bscore_BSNB = bscore_BSNB.scatter_reduce(-1, blk_BSG, scores_BSG, reduce="amax", include_self=True)
    pinned_BS = block_id_BG.gather(1, newest_BS.clamp(min=0))
    pin_BSNB = (torch.arange(n_blocks, device=scores_BSG.device) == pinned_BS[..., None]) & (newest_BS[..., None] >= 0)
    bscore_BSNB = bscore_BSNB.masked_fill(pin_BSNB, torch.inf)
    top_vals, top_idx = topk_indices(bscore_BSNB, topk_blocks)
    keep_BSNB = torch.zeros_like(bscore_BSNB, dtype=torch.bool).scatter(-1, top_idx, top_vals > -torch.inf)
    return keep_BSNB.gather(-1, blk_BSG)


@dataclass
class IndexerOutput:
    """topk_idxs: [B,S,K] int64 group indices in ascending order, -1 = nothing selected.
    scores: [B,S,G] fp32 scores after visibility/candidate masking (-inf = not selectable).
    candidates: [B,S,G] bool, only from the candidate source layer."""

    topk_idxs: torch.Tensor
    scores: torch.Tensor
    candidates: torch.Tensor | None = None


class Indexer(nn.Module):
    """Scores compressed groups per query: `score = sum_h relu(q_h . k) * w_h` (§3.6).

    `wq_b` reads the attention's shared `qr`; `weights_proj` reads the attention input x. Only a
    kv source ("owns_k", a Full layer) has `wk`/`k_norm` and produces index keys from its RoPE-free
    latent; Reindex layers score the keys published by the latest kv source, inside its candidate
    pool. There is no stale-key fallback: a ratio-2 source always scores its own key cache (the
    reference instead scores the previous publisher's keys on decode steps with an incomplete
    group, model_reference §3.8; DESIGN.md fixes that).
    """

    def __init__(self, args: ModelArgs, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.compress_ratio = args.compress_ratio(layer_id)
        self.owns_k = args.is_kv_source(layer_id)
        self.is_candidate_source = args.is_candidate_source(layer_id)
        self.uses_candidates = args.uses_candidates(layer_id)
        self.candidate_topk_blocks = args.candidate_topk_blocks
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

    def index_keys(self, latent_BND: torch.Tensor, freqs_BNr: torch.Tensor, qat: bool) -> torch.Tensor:
        """Index keys [B,N,Di] of new groups from the RoPE-free latent: k_norm(wk), RoPE at the group
        anchor positions, MXFP4 QDQ (post-RoPE)."""
        k_BND = self.k_norm(self.wk(latent_BND))
        k_BND = apply_rotary_emb(k_BND, freqs_BNr)
        return mxfp4_fake_quant(k_BND) if qat else k_BND

    def scores(
        self,
        x_BSD: torch.Tensor,
        qr_BSQ: torch.Tensor,
        index_k_BGD: torch.Tensor,
        freqs_BSr: torch.Tensor,
        qat: bool,
    ) -> torch.Tensor:
        """Raw scores [B,S,G] in fp32 (no masking)."""
        B, S, _ = x_BSD.shape
        q_BSID = self.wq_b(qr_BSQ).view(B, S, self.n_heads, self.head_dim)
        q_BSID = apply_rotary_emb(q_BSID, freqs_BSr)
        if qat:
            q_BSID = mxfp4_fake_quant(q_BSID)
        w_BSI = self.weights_proj(x_BSD).float() * self.weight_scale
        dots_BSIG = torch.einsum("bsid,bgd->bsig", q_BSID.float(), index_k_BGD.float())
        # ReLU per head BEFORE the weighted head sum (§3.6 step 5).
        return torch.einsum("bsig,bsi->bsg", dots_BSIG.relu(), w_BSI)

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
    ) -> IndexerOutput:
        """Select up to `index_topk` visible groups per query.

        Picks whose score is -inf (invisible, or outside the candidate pool) become -1. The
        reference keeps such picks when they are visible but outside the pool; that only happens
        when the pool is smaller than index_topk, which no released configuration allows.
        """
        score_BSG = self.scores(x_BSD, qr_BSQ, index_k_BGD, freqs_BSr, qat)
        score_BSG = score_BSG.masked_fill(~visible_BSG, -torch.inf)
        candidates = None
        if self.is_candidate_source:
            assert block_id_BG is not None and newest_BS is not None
            candidates = select_candidate_blocks(
                score_BSG.detach(), block_id_BG, n_blocks, newest_BS, self.candidate_topk_blocks
            )
        elif self.uses_candidates:
            assert candidates_BSG is not None, f"layer {self.layer_id} needs the candidate pool"
            score_BSG = score_BSG.masked_fill(~candidates_BSG, -torch.inf)
        vals_BSK, idx_BSK = topk_indices(score_BSG.detach(), self.index_topk)
        idx_BSK = torch.where(vals_BSK > -torch.inf, idx_BSK, -1)
        # Position order like the reference (-1 first); attention does not depend on the order.
        idx_BSK = idx_BSK.sort(dim=-1).values
        return IndexerOutput(idx_BSK, score_BSG, candidates)
