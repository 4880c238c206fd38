"""DSpark, the speculative drafter of V4.1 (model_reference §3.14): the `mtp.{k}` stages, teacher-forced
drafts at every position, one decode-time draft step with its window cache, and the alignment loss.

The drafter reads the backbone's DETACHED context (`main_hidden`, the mean of the 4 streams at the
inputs of the target layers) and uses the backbone's embedding and head through detached weights, so
no DSpark loss reaches a backbone parameter (DESIGN §3). Not here: verification/acceptance, the
confidence-based scheduler, the decode loop (the engine's), and the backbone itself (transformer.py).

Shape legend: B batch, S anchor positions, K draft block rows (dspark_block_size), k returned rows,
N = S·K draft tokens, T cached context rows, W window, H heads, Dh head dim, D dim, X = n_targets·D,
V vocab, r markov rank, hc streams.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from model.attention import Attention, sparse_attn_blocked_ref, window_topk_idxs, windowed_sparse_attn
from model.config import ModelArgs
from model.mhc import hc_pre, identity_pre_mix
from model.moe import RouterStats
from model.norm import RMSNorm
from model.quant import fp8_fake_quant
from model.rope import apply_rotary_emb
from model.sampling import sample
from model.transformer import Block

Markov = Literal["teacher", "greedy"]


@dataclass
class DraftOutput:
    """Teacher-forced drafts. Row i at anchor position s is what decoding drafts when token s is the
    anchor and positions < s are the context: it predicts token s+1+i, whose policy distribution is
    the backbone's logits at position s+i.

    logits [B,S,k,V] fp32 (Markov-biased); confidence [B,S,k] fp32 raw logits; draft_ids [B,S,k]
    argmax of the biased logits; router_stats one per stage (tokens = the S·K block rows).
    Without logits (`with_logits=False`, Markov "teacher"): logits and draft_ids are None, and
    hidden [B,S,k,D] (the last stage's pre-norm rows) with prev_ids [B,S,k] (each row's Markov
    predecessor) give any slice's logits through `DSpark.draft_logits`: a loss can then be taken
    over positions chunk by chunk (`dspark_loss_chunked`), never [B,S,k,V] at once."""

    logits: torch.Tensor | None
    confidence: torch.Tensor
    draft_ids: torch.Tensor | None
    router_stats: list[RouterStats] = field(default_factory=list)
    hidden: torch.Tensor | None = None
    prev_ids: torch.Tensor | None = None


@dataclass
class DraftStep:
    """One decode-time draft (the reference's forward_spec): out_ids [B,k+1] = anchor then the k drafted
    tokens; logits [B,k,V] fp32 (biased); confidence [B,k] fp32 raw logits."""

    out_ids: torch.Tensor
    logits: torch.Tensor
    confidence: torch.Tensor


@dataclass
class DSparkCache:
    """Per-stage window of context KV (post-RoPE, QDQ'd) [B,T,Dh], T <= W + max_rollback, and the
    number of context positions it covers (`seq_len`, equal to the backbone cache's after a step)."""

    max_rollback: int = 0
    window_kv: list[torch.Tensor] = field(default_factory=list)
    seq_len: int = 0

    def truncate(self, new_len: int) -> None:
        n_drop = self.seq_len - new_len
        if n_drop <= 0:
            return
        if n_drop > self.max_rollback:
            raise ValueError(f"cannot drop {n_drop} DSpark context rows (max_rollback {self.max_rollback})")
        self.window_kv = [kv[:, : kv.size(1) - n_drop] for kv in self.window_kv]
        self.seq_len = new_len


class MarkovHead(nn.Module):
    """Rank-r bigram bias: logits of the next row += head(embed(previous token)). `head` is fp32."""

    def __init__(self, vocab_size: int, rank: int):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, rank)
        self.head = nn.Linear(rank, vocab_size, bias=False, dtype=torch.float32)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [...] -> (bias [..., V] fp32, embedding [..., r])."""
        e = self.embed(ids)
        return F.linear(e.float(), self.head.weight), e


class ConfidenceHead(nn.Module):
    """Raw acceptance logit from [pre-norm hidden ; Markov embedding of the predecessor] (fp32)."""

    def __init__(self, dim: int):
        super().__init__()
        self.proj = nn.Linear(dim, 1, bias=False, dtype=torch.float32)

    def forward(self, x: torch.Tensor, markov_embed: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.cat([x, markov_embed.to(x.dtype)], dim=-1).float()).squeeze(-1)


class DSparkStage(Block):
    """One drafter stage `mtp.{k}`: a Block (own mHC, norms, MoE with the DSpark expert counts, no
    Engram) whose attention sees the backbone context window plus the whole draft block (no causal
    mask inside the block). Stage 0 adds `main_proj`/`main_norm`; the last stage `norm`,
    `markov_head` and `confidence_head`. No `embed`/`head`: those are the backbone's."""

    def __init__(self, args: ModelArgs, stage_id: int):
        super().__init__(args, args.n_layers + stage_id)
        self.stage_id = stage_id
        self.qat = args.qat
        if stage_id == 0:
            self.main_proj = nn.Linear(len(args.dspark_target_layer_ids) * args.dim, args.dim, bias=False)
            self.main_norm = RMSNorm(args.dim, args.norm_eps)
        if stage_id == args.n_mtp_layers - 1:
            self.norm = RMSNorm(args.dim, args.norm_eps)
            self.markov_head = MarkovHead(args.vocab_size, args.dspark_markov_rank)
            self.confidence_head = ConfidenceHead(args.dim + args.dspark_markov_rank)

    def context_kv(self, main_x_BSD: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        """This stage's KV of the projected context [B,S,Dh] (its own wkv, RoPE, FP8 QDQ)."""
        kv = apply_rotary_emb(self.attn.kv_norm(self.attn.wkv(main_x_BSD)), freqs)
        return fp8_fake_quant(kv) if self.qat else kv

    def attend(
        self,
        x_BND: torch.Tensor,
        ctx_kv: torch.Tensor,
        freqs_BNr: torch.Tensor,
        win_lo: int,
        win_idxs: torch.Tensor,
        ref_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x = attn_norm output of N = S·K block rows [B,N,D] -> [B,N,D].

        Query (s, i) sees the context rows win_lo + s + (0..W-1) of `ctx_kv` [B,T,Dh] that are valid in
        win_idxs [B,S,W], and the K rows of its own block. The K rows of a block share one window, so
        they run as K·H heads of one query: one windowed attention serves training and decoding.
        `ref_rows` [n] (numerics="reference", one decode step): the context rows in the released
        code's order (its ring slots); each block row then attends [those rows ; the K block rows]
        through `sparse_attn_blocked_ref`, as its forward_spec."""
        attn: Attention = self.attn
        B, N, _ = x_BND.shape
        S, K = win_idxs.size(1), N // win_idxs.size(1)
        H, Dh = attn.n_heads, attn.head_dim
        q_BNHD = apply_rotary_emb(attn.wq_b(attn.q_norm(attn.wq_a(x_BND))).view(B, N, H, Dh), freqs_BNr)
        kv_BND = apply_rotary_emb(attn.kv_norm(attn.wkv(x_BND)), freqs_BNr)
        if self.qat:
            kv_BND = fp8_fake_quant(kv_BND)
        if ref_rows is not None:
            T = ctx_kv.size(1)
            idxs = torch.cat([ref_rows, T + torch.arange(N, device=x_BND.device)]).expand(B, N, -1)
            kv_all = torch.cat([ctx_kv.to(kv_BND.dtype), kv_BND], dim=1)
            o = sparse_attn_blocked_ref(q_BNHD, kv_all, attn.attn_sink, idxs, attn.softmax_scale)
        else:
            blk_BSK = torch.arange(S, device=x_BND.device)[:, None] * K + torch.arange(K, device=x_BND.device)
            o, _ = windowed_sparse_attn(
                q_BNHD.reshape(B, S, K * H, Dh), ctx_kv, win_lo, win_idxs, attn.attn_sink.repeat(K),
                attn.softmax_scale, kv_BND, blk_BSK.expand(B, S, K),
            )  # fmt: skip
        o_BNHD = apply_rotary_emb(o.reshape(B, N, H, Dh), freqs_BNr, inverse=True)
        o_BNGE = o_BNHD.reshape(B, N, attn.n_groups, -1)
        wo_a_GRE = attn.wo_a.weight.view(attn.n_groups, attn.o_lora_rank, -1)
        return attn.wo_b(torch.einsum("bnge,gre->bngr", o_BNGE, wo_a_GRE).flatten(2))


class DSpark(nn.ModuleList):
    """The stages `mtp.0..n_mtp_layers-1`. Every method takes the backbone's embedding and head weights
    and the RoPE table (base theta, no YaRN) from the caller; pass them detached (the Transformer does)."""

    def __init__(self, args: ModelArgs):
        super().__init__(DSparkStage(args, k) for k in range(args.n_mtp_layers))
        self.args = args
        self.block_size, self.noise_id = args.dspark_block_size, args.dspark_noise_token_id

    def project_context(self, main_hidden: torch.Tensor) -> torch.Tensor:
        """main_hidden [B,S,X] -> main_x [B,S,D], shared by all stages."""
        first = self[0]
        return first.main_norm(first.main_proj(main_hidden.to(first.main_proj.weight.dtype)))

    def _block_rows(self, anchor_ids: torch.Tensor, embed_weight: torch.Tensor) -> torch.Tensor:
        """anchor ids [B,S] -> embedded draft blocks [B,S·K,hc,D]: anchor then K-1 noise tokens."""
        ids = anchor_ids[..., None].repeat(*([1] * anchor_ids.dim()), self.block_size)
        ids[..., 1:] = self.noise_id
        h = F.embedding(ids.flatten(1), embed_weight)
        return h.unsqueeze(2).repeat(1, 1, self.args.hc_mult, 1)

    def _run(
        self,
        h_BNCD: torch.Tensor,
        attend_args: Callable[[DSparkStage], tuple],
    ) -> tuple[torch.Tensor, list[RouterStats]]:
        """All stages over the block rows; returns the pre-norm hidden [B,N,D] (last stage's carried
        pre) and router stats."""
        pre = identity_pre_mix(h_BNCD.size(0), h_BNCD.size(1), self.args.hc_mult, device=h_BNCD.device)
        stats = []
        for stage in self:
            args = attend_args(stage)
            h_BNCD, pre, s = stage.run(h_BNCD, pre, lambda x, st=stage, a=args: st.attend(x, *a))
            stats.append(s)
        return hc_pre(h_BNCD, pre), stats

    def _head(self, x_BSKD: torch.Tensor, head_weight: torch.Tensor) -> torch.Tensor:
        return F.linear(self[-1].norm(x_BSKD).float(), head_weight.float())

    # ------------------------------------------------------------------ training
    def draft_teacher_forced(
        self,
        main_hidden: torch.Tensor,
        input_ids: torch.Tensor,
        k: int,
        *,
        embed_weight: torch.Tensor,
        head_weight: torch.Tensor,
        rope_table: torch.Tensor,
        doc_ids: torch.Tensor | None = None,
        markov: Markov = "teacher",
        with_logits: bool = True,
    ) -> DraftOutput:
        """Drafts for every anchor position s of a teacher-forced sequence, batched over s (see
        DraftOutput for the alignment). main_hidden [B,S,X]; input_ids [B,S] (anchors); doc_ids [B,S]
        (packed rows: context and positions restart per document, as the backbone's).
        `with_logits=False` (teacher Markov only) skips the [B,S,k,V] logits (DraftOutput).

        The block always has K rows (they attend to each other); the first k are returned. The Markov
        bias of row i uses the predecessor token: `markov="teacher"` the true token s+i (row 0: the
        anchor), the conditional that matters when all earlier drafts were accepted; `"greedy"` the
        argmax of row i-1, exactly what a greedy decode produces (rows then run one after another)."""
        K, W = self.block_size, self.args.window_size
        if not 1 <= k <= K:
            raise ValueError(f"k={k} must be in 1..dspark_block_size={K}")
        B, S = input_ids.shape
        dev = input_ids.device
        ar = torch.arange(S, device=dev)
        if doc_ids is None:
            start_BS = torch.zeros(B, S, dtype=torch.long, device=dev)
        else:
            is_start = torch.ones(B, S, dtype=torch.bool, device=dev)
            is_start[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
            start_BS = torch.cummax(torch.where(is_start, ar, 0), dim=1).values
        pos_BS = ar - start_BS
        freqs_ctx = rope_table[pos_BS]
        freqs_blk = rope_table[(pos_BS[..., None] + torch.arange(K, device=dev)).flatten(1)]
        # anchor s sees context rows s-W..s-1 of its own document (the query "is" at s-1 for the window)
        win_idxs = window_topk_idxs((ar - 1).expand(B, S), start_BS, W)
        main_x = self.project_context(main_hidden)
        x_BND, stats = self._run(
            self._block_rows(input_ids, embed_weight),
            lambda st: (st.context_kv(main_x, freqs_ctx), freqs_blk, -W, win_idxs),
        )
        x_BSKD = x_BND.view(B, S, K, -1)[:, :, :k]
        last = self[-1]
        if markov not in ("teacher", "greedy"):
            raise ValueError(f"markov={markov!r} must be 'teacher' or 'greedy'")
        if not with_logits and markov != "teacher":
            raise ValueError("with_logits=False needs markov='teacher' (greedy rows read the previous row's logits)")
        if markov == "teacher":
            # row i's predecessor is token s+i (beyond the row's end: noise; those rows have no target)
            nxt = F.pad(input_ids, (0, k - 1), value=self.noise_id)
            if doc_ids is not None:
                same = F.pad(doc_ids, (0, k - 1), value=-1).unfold(1, k, 1) == doc_ids[..., None]
                prev_BSk = torch.where(same, nxt.unfold(1, k, 1), self.noise_id)
            else:
                prev_BSk = nxt.unfold(1, k, 1)
            m_embed = last.markov_head.embed(prev_BSk)
            confidence = last.confidence_head(x_BSKD, m_embed)
            if not with_logits:
                return DraftOutput(None, confidence, None, stats, hidden=x_BSKD, prev_ids=prev_BSk)
            logits = self.draft_logits(x_BSKD, prev_BSk, head_weight)
            return DraftOutput(logits, confidence, logits.argmax(-1), stats)
        base_BSkV = self._head(x_BSKD, head_weight)
        if markov == "greedy":
            rows, embeds, prev = [], [], input_ids
            for i in range(k):
                bias, e = last.markov_head(prev)
                rows.append(base_BSkV[:, :, i] + bias)
                embeds.append(e)
                prev = rows[-1].argmax(-1)
            logits, m_embed = torch.stack(rows, 2), torch.stack(embeds, 2)
        confidence = last.confidence_head(x_BSKD, m_embed)
        return DraftOutput(logits, confidence, logits.argmax(-1), stats)

    def draft_logits(self, hidden: torch.Tensor, prev_ids: torch.Tensor, head_weight: torch.Tensor) -> torch.Tensor:
        """Markov-biased draft logits [..., V] fp32 of pre-norm rows hidden [..., D] whose Markov
        predecessors are prev_ids [...] (DraftOutput.hidden / prev_ids, or a slice of them)."""
        return self._head(hidden, head_weight) + self[-1].markov_head(prev_ids)[0]

    # ------------------------------------------------------------------ decoding
    def extend_context(self, main_hidden: torch.Tensor, cache: DSparkCache, rope_table: torch.Tensor) -> None:
        """Append the context KV of positions cache.seq_len.. (main_hidden [B,n,X]) to every stage's window."""
        n = main_hidden.size(1)
        main_x = self.project_context(main_hidden)
        freqs = rope_table[cache.seq_len : cache.seq_len + n]
        keep = self.args.window_size + cache.max_rollback
        if not cache.window_kv:
            cache.window_kv = [main_x.new_zeros(main_x.size(0), 0, self[0].attn.head_dim) for _ in self]
        for j, stage in enumerate(self):
            kv = torch.cat([cache.window_kv[j], stage.context_kv(main_x, freqs)], dim=1)
            cache.window_kv[j] = kv[:, max(0, kv.size(1) - keep) :]
        cache.seq_len += n

    def draft_step(
        self,
        anchor_ids: torch.Tensor,
        cache: DSparkCache,
        k: int,
        *,
        embed_weight: torch.Tensor,
        head_weight: torch.Tensor,
        rope_table: torch.Tensor,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
    ) -> DraftStep:
        """Draft k tokens after anchor_ids [B] (the token at position cache.seq_len, not yet in the
        context). Rows are sampled one after another, each Markov-biased by its predecessor
        (temperature 0 = greedy), as the reference's forward_head."""
        K, W = self.block_size, self.args.window_size
        if not 1 <= k <= K:
            raise ValueError(f"k={k} must be in 1..dspark_block_size={K}")
        B, p = anchor_ids.size(0), cache.seq_len
        dev = anchor_ids.device
        T = cache.window_kv[0].size(1) if cache.window_kv else 0
        ctx = cache.window_kv or [torch.zeros(B, 0, self[0].attn.head_dim, device=dev)] * len(self)
        rows = T - W + torch.arange(W, device=dev)  # the newest W context rows
        win_idxs = torch.where(rows >= 0, rows, -1).expand(B, 1, W)
        freqs = rope_table[p : p + K]
        ref_rows = None
        if self.args.numerics == "reference":
            # the released code lists its context ring by slot (position % W), not oldest first
            pos = torch.arange(max(0, p - W), p, device=dev)
            ref_rows = pos[torch.argsort(pos % W, stable=True)] - (p - T)
        x_BND, _ = self._run(
            self._block_rows(anchor_ids[:, None], embed_weight),
            lambda st: (ctx[st.stage_id], freqs, T - W, win_idxs, ref_rows),
        )
        x_BkD = x_BND[:, :k]
        base_BkV = self._head(x_BkD, head_weight)
        last = self[-1]
        out_ids, logits, embeds = [anchor_ids], [], []
        for i in range(k):
            bias, e = last.markov_head(out_ids[-1])
            logits.append(base_BkV[:, i] + bias)
            embeds.append(e)
            out_ids.append(sample(logits[-1], temperature, generator=generator)[0])
        confidence = last.confidence_head(x_BkD, torch.stack(embeds, 1))
        return DraftStep(torch.stack(out_ids, 1), torch.stack(logits, 1), confidence)


# ---------------------------------------------------------------------- loss
@dataclass
class DSparkLoss:
    """loss = draft_ce + confidence_weight·confidence_bce (scalars, means over valid rows);
    acceptance = fraction of valid rows whose draft equals the policy's token (no grad)."""

    loss: torch.Tensor
    draft_ce: torch.Tensor
    confidence_bce: torch.Tensor
    acceptance: torch.Tensor


def draft_rows(mtp: DSpark, draft: DraftOutput, head_weight: torch.Tensor, rows: torch.Tensor) -> DraftOutput:
    """The rows `rows` [B,S,k] bool of a logit-free DraftOutput (`with_logits=False`, Markov "teacher")
    as a DraftOutput over n = rows.sum() rows: logits [n,V] fp32, confidence [n], draft_ids [n]
    (stats kept). Only those rows' vocabulary logits are computed, in the forward and the backward: a
    loss over few rows (a learner's generated tokens) costs n·V, not B·S·k·V. Pair it with the
    targets of the same rows, e.g. `align_to_drafts(policy_logits, k)[rows]`."""
    if draft.hidden is None or draft.prev_ids is None:
        raise ValueError("draft_rows needs a DraftOutput from draft_teacher_forced(with_logits=False)")
    logits = mtp.draft_logits(draft.hidden[rows], draft.prev_ids[rows], head_weight)
    return DraftOutput(logits, draft.confidence[rows], logits.argmax(-1), draft.router_stats)


def align_to_drafts(x: torch.Tensor, k: int, fill: float | int = 0) -> torch.Tensor:
    """x [B,S,...] -> [B,S,k,...] with out[:, s, i] = x[:, s+i] (`fill` past the end): e.g. the
    policy's logits/probs at s+i, the distribution row i of anchor s is trained on."""
    padded = torch.cat([x, x.new_full((x.size(0), k - 1, *x.shape[2:]), fill)], dim=1)
    return padded.unfold(1, k, 1).movedim(-1, 2)


def draft_target_ids(input_ids: torch.Tensor, k: int, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Hard targets [B,S,k]: token s+1+i of the same document, -1 where there is none."""
    nxt = align_to_drafts(F.pad(input_ids[:, 1:], (0, 1), value=-1), k, -1)
    if doc_ids is not None:
        same = align_to_drafts(F.pad(doc_ids[:, 1:], (0, 1), value=-1), k, -1) == doc_ids[..., None]
        nxt = torch.where(same, nxt, -1)
    return nxt


def dspark_loss(
    draft: DraftOutput,
    target: torch.Tensor,
    accepted: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    confidence_weight: float = 1.0,
) -> DSparkLoss:
    """Alignment loss of the drafter to the current policy (DESIGN §3.1), a pure function.

    draft_ce = −Σ_v sg(p_policy(v)) log p_draft(v) per row, with target [B,S,k,V] policy
    probabilities (e.g. `align_to_drafts(policy_logits.softmax(-1), k)`) or hard ids [B,S,k]
    (`draft_target_ids`; -1 = no target). confidence_bce = BCE of the confidence logit against
    `accepted` [B,S,k] (does the draft token equal the policy's token; default: draft_ids equals the
    target id, or the target's argmax). mask [B,S,k] bool selects rows (default: all rows with a
    target; a probability row of all zeros counts as none)."""
    ce, has_target, policy_ids = _draft_ce(torch.log_softmax(draft.logits.float(), dim=-1), target)
    valid = has_target if mask is None else mask & has_target
    if accepted is None:
        accepted = draft.draft_ids == policy_ids
    bce = F.binary_cross_entropy_with_logits(draft.confidence.float(), accepted.float(), reduction="none")
    n = valid.sum().clamp_min(1)
    ce_mean, bce_mean = (ce * valid).sum() / n, (bce * valid).sum() / n
    acceptance = ((accepted & valid).sum() / n).detach()
    return DSparkLoss(ce_mean + confidence_weight * bce_mean, ce_mean, bce_mean, acceptance)


def _draft_ce(logp: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row cross-entropy, has-target mask and policy ids of `dspark_loss` (target: probs or ids)."""
    if target.dim() == logp.dim():
        probs = target.detach().float()
        return -(probs * logp).sum(-1), probs.sum(-1) > 0, probs.argmax(-1)
    policy_ids = target.clamp_min(0)
    return -logp.gather(-1, policy_ids[..., None]).squeeze(-1), target >= 0, policy_ids


def dspark_loss_chunked(
    mtp: DSpark,
    draft: DraftOutput,
    head_weight: torch.Tensor,
    target: Callable[[int, int], torch.Tensor],
    accepted: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    confidence_weight: float = 1.0,
    chunk: int = 256,
) -> DSparkLoss:
    """`dspark_loss` of a logit-free DraftOutput (`with_logits=False`), over anchor positions `chunk`
    at a time: the same loss and gradients (up to fp32 summation order), but the draft logits and the
    target of one chunk [B,chunk,k,V] are the largest vocabulary-sized tensors ever alive, in the
    forward and in the backward (each chunk's cross-entropy is checkpointed: its logits are
    recomputed during backward instead of kept).

    target(lo, hi): the target of anchors lo..hi-1, probabilities [B,hi-lo,k,V] or ids [B,hi-lo,k]
    (as dspark_loss's); it is called under no_grad, again during backward for soft targets, so it
    must be a pure function (build it from the policy's hidden state, not from stored logits).
    accepted / mask [B,S,k] as dspark_loss's (default accepted: the draft's argmax equals the
    target's)."""
    if draft.hidden is None or draft.prev_ids is None:
        raise ValueError("dspark_loss_chunked needs a DraftOutput from draft_teacher_forced(with_logits=False)")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    S = draft.prev_ids.size(1)

    def chunk_ce(hidden: torch.Tensor, prev_ids: torch.Tensor, lo: int, hi: int):
        logits = mtp.draft_logits(hidden, prev_ids, head_weight)
        with torch.no_grad():
            tgt = target(lo, hi)
        ce, has_target, policy_ids = _draft_ce(torch.log_softmax(logits, dim=-1), tgt)
        valid = has_target if mask is None else mask[:, lo:hi] & has_target
        hit = logits.detach().argmax(-1) == policy_ids
        return (ce * valid).sum(), valid, hit

    ce_sum, valids, hits = draft.confidence.new_zeros(()), [], []
    for lo in range(0, S, chunk):
        hi = min(S, lo + chunk)
        args = (draft.hidden[:, lo:hi], draft.prev_ids[:, lo:hi], lo, hi)
        grad = torch.is_grad_enabled()
        part, valid, hit = checkpoint(chunk_ce, *args, use_reentrant=False) if grad else chunk_ce(*args)
        ce_sum, valids, hits = ce_sum + part, valids + [valid], hits + [hit]
    valid, hit = torch.cat(valids, 1), torch.cat(hits, 1)
    if accepted is None:
        accepted = hit
    bce = F.binary_cross_entropy_with_logits(draft.confidence.float(), accepted.float(), reduction="none")
    n = valid.sum().clamp_min(1)
    ce_mean, bce_mean = ce_sum / n, (bce * valid).sum() / n
    acceptance = ((accepted & valid).sum() / n).detach()
    return DSparkLoss(ce_mean + confidence_weight * bce_mean, ce_mean, bce_mean, acceptance)


__all__ = [
    "DSpark", "DSparkCache", "DSparkLoss", "DSparkStage", "DraftOutput", "DraftStep", "align_to_drafts",
    "draft_rows", "draft_target_ids", "dspark_loss", "dspark_loss_chunked",
]  # fmt: skip
