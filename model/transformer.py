"""The V4.1 backbone: embedding, Single-Pass-mHC blocks, final collapse, fp32 head.

Two entry points over the same modules: `Transformer.forward` (teacher-forced training over packed
rows, logits at every position, router stats, indexer alignment loss) and
`Transformer.forward_incremental` (any number of new tokens at any `start_pos`, with `ModelCache`).
Layers share compressed KV / top-k through an explicit per-call `SharedAttnState`.
Not here: Engram, DSpark stages and vision (hooks only), checkpoint I/O, parallelism.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from model.attention import (
    Attention,
    AttnContext,
    AttnLayout,
    LayerCache,
    SharedAttnState,
    build_incremental_layout,
    build_packed_layout,
)
from model.config import ModelArgs
from model.mhc import hc_coefficients, hc_post, hc_pre, identity_pre_mix, init_hc_params
from model.moe import MoE, RouterStats
from model.norm import RMSNorm
from model.rope import precompute_freqs_cis

# Trainable-looking parameters that gradient descent never updates, by name suffix: the MoE
# selection biases only pick experts (their values are set by `update_expert_bias`, aux-loss-free
# balancing), so no loss reaches them.
INTENTIONALLY_FROZEN: tuple[str, ...] = ("ffn.gate.bias", "ffn.gate.bias_vl")


@dataclass
class TransformerOutput:
    """logits [B,S,V] fp32 at every position; router_stats one per layer; indexer_loss scalar
    (mean over index-source layers, 0 if none ran); hidden [B,S,D] final-norm output;
    main_hidden [B,S,len(dspark_target_layer_ids)*D] (DSpark context) or None."""

    logits: torch.Tensor
    router_stats: list[RouterStats]
    indexer_loss: torch.Tensor
    hidden: torch.Tensor
    main_hidden: torch.Tensor | None = None


@dataclass
class ModelCache:
    """Incremental state of a whole model: one LayerCache per backbone layer (allocated on first
    use) and the number of tokens already consumed (`seq_len`); the next call must start there.
    `max_rollback`: how many of the newest tokens `truncate` may drop again (e.g. rejected
    speculative tokens after a verification call); it sets how much history the layers keep."""

    max_rollback: int = 0
    layers: list[LayerCache] = field(default_factory=list)
    seq_len: int = 0

    def truncate(self, new_len: int) -> None:
        """Roll back to the first `new_len` tokens (seq_len - max_rollback <= new_len <= seq_len)."""
        n_drop = self.seq_len - new_len
        if not 0 <= n_drop <= self.max_rollback:
            raise ValueError(f"cannot truncate {self.seq_len} -> {new_len} (max_rollback {self.max_rollback})")
        for layer in self.layers:
            layer.truncate(n_drop, new_len)
        self.seq_len = new_len


class Block(nn.Module):
    """One layer: attention and MoE between mHC pre/post mixes (model_reference §3.2).

    Single-Pass mHC: each sub-layer's input collapse uses the `pre` produced by the PREVIOUS
    sub-layer's mixes (attention: the previous block's FFN `pre`, one-hot for block 0; FFN: this
    block's attention `pre`), and `forward` returns its FFN `pre` for the next block.
    `engram` (optional) is applied to the stream before the block by the Transformer.
    """

    def __init__(self, args: ModelArgs, layer_id: int, engram: nn.Module | None = None):
        super().__init__()
        self.layer_id = layer_id
        self.norm_eps, self.hc_mult = args.norm_eps, args.hc_mult
        self.hc_sinkhorn_iters, self.hc_eps = args.hc_sinkhorn_iters, args.hc_eps
        self.attn = Attention(args, layer_id)
        self.ffn = MoE(args)
        self.attn_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.engram = engram
        # mHC boundaries: torch composition, or the fused Triton kernels (CUDA, hc_mult 4).
        self.mixes_pre, self.post_mixes_pre = hc_mixes_pre_torch, hc_post_mixes_pre_torch
        if args.impl == "triton":
            from kernels.mhc import hc_mixes_pre, hc_post_mixes_pre  # chosen at construction

            self.mixes_pre, self.post_mixes_pre = hc_mixes_pre, hc_post_mixes_pre
        n_mix, hc_dim = (2 + args.hc_mult) * args.hc_mult, args.hc_mult * args.dim
        f32 = torch.float32
        self.hc_attn_fn = nn.Parameter(torch.empty(n_mix, hc_dim, dtype=f32))
        self.hc_ffn_fn = nn.Parameter(torch.empty(n_mix, hc_dim, dtype=f32))
        self.hc_attn_base = nn.Parameter(torch.empty(n_mix, dtype=f32))
        self.hc_ffn_base = nn.Parameter(torch.empty(n_mix, dtype=f32))
        self.hc_attn_scale = nn.Parameter(torch.empty(3, dtype=f32))
        self.hc_ffn_scale = nn.Parameter(torch.empty(3, dtype=f32))

    def _hc(self, which: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return getattr(self, f"hc_{which}_fn"), getattr(self, f"hc_{which}_scale"), getattr(self, f"hc_{which}_base")

    def forward(
        self,
        h_BSCD: torch.Tensor,
        pre_mix_BSC: torch.Tensor,
        ctx: AttnContext,
        cache: LayerCache | None = None,
        image_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, RouterStats]:
        """h [B,S,hc,D], pre_mix [B,S,hc] fp32 -> (h, this block's FFN pre for the next block, stats)."""
        hc = {"norm_eps": self.norm_eps, "hc_eps": self.hc_eps, "iters": self.hc_sinkhorn_iters}
        # attention coefficients from the stream BEFORE attention; its input uses the carried pre
        x_BSD, attn_pre, attn_post, attn_comb = self.mixes_pre(h_BSCD, pre_mix_BSC, *self._hc("attn"), **hc)
        f_BSD = self.attn(self.attn_norm(x_BSD), ctx, cache)
        # FFN coefficients from the stream BEFORE the FFN; its input uses the attention's pre
        h_BSCD, x_BSD, ffn_pre, ffn_post, ffn_comb = self.post_mixes_pre(
            f_BSD, h_BSCD, attn_post, attn_comb, attn_pre, *self._hc("ffn"), **hc
        )
        f_BSD, stats = self.ffn(self.ffn_norm(x_BSD), image_mask)
        return hc_post(f_BSD, h_BSCD, ffn_post, ffn_comb), ffn_pre, stats


def hc_mixes_pre_torch(x, pre_carried, fn, scale, base, *, norm_eps: float, hc_eps: float, iters: int):
    """Sub-layer boundary without a preceding hc_post: (hc_pre(x, pre_carried), pre, post, comb)."""
    coef = hc_coefficients(x, fn, scale, base, norm_eps=norm_eps, hc_mult=x.size(-2), iters=iters, hc_eps=hc_eps)
    return (hc_pre(x, pre_carried), *coef)


def hc_post_mixes_pre_torch(f, residual, post, comb, pre_carried, fn, scale, base, **consts):
    """Sub-layer boundary: x_new = hc_post(f, residual, post, comb), then (x_new, hc_pre(x_new,
    pre_carried), pre, post, comb of the next sub-layer): the unfused kernels.mhc.hc_post_mixes_pre."""
    x_new = hc_post(f, residual, post, comb)
    return (x_new, *hc_mixes_pre_torch(x_new, pre_carried, fn, scale, base, **consts))


class Transformer(nn.Module):
    """Backbone with official parameter names (`embed`, `layers.{i}.*`, `norm`, `head`).

    Construction allocates parameters only (works on the meta device); call `init_weights` for
    values and pass a `ModelCache` to `forward_incremental` for inference state.
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(args, i) for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        # bf16 in checkpoints, held in fp32 so logits come out fp32 (§3.13).
        self.head = nn.Linear(args.dim, args.vocab_size, bias=False, dtype=torch.float32)
        self.ratios = tuple(sorted({args.compress_ratio(i) for i in range(args.n_layers)} - {0}))
        self._rope_tables: dict[tuple[bool, int, str], torch.Tensor] = {}

    # ------------------------------------------------------------------ init
    @torch.no_grad()
    def init_weights(self, seed: int = 0, std: float = 0.02) -> None:
        """Deterministic init (seeded, caller's RNG state untouched): embedding and projections
        N(0, std), output projections `wo_b` N(0, std/sqrt(2 n_layers)); modules with their own
        `reset_parameters` (norms, MoE gate/experts) use it; mHC per `init_hc_params`; sinks 0."""
        out_std = std / math.sqrt(2 * self.args.n_layers)
        # Draw everything in fp32 and round once, so a bf16 model gets exactly the rounded values of
        # the fp32 one (RNG streams differ per dtype).
        dtypes = {name: p.dtype for name, p in self.named_parameters()}
        for p in self.parameters():
            p.data = p.data.float()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            for name, m in self.named_modules():
                if isinstance(m, (nn.Linear, nn.Embedding)):
                    nn.init.normal_(m.weight, std=out_std if name.endswith("wo_b") else std)
                elif hasattr(m, "reset_parameters"):
                    m.reset_parameters()
                if isinstance(m, Attention):
                    m.attn_sink.zero_()
                if isinstance(m, Block):
                    for which in ("attn", "ffn"):
                        for key, value in init_hc_params(self.args.dim, self.args.hc_mult).items():
                            getattr(m, f"hc_{which}_{key}").copy_(value)
        for name, p in self.named_parameters():
            p.data = p.data.to(dtypes[name])

    # ------------------------------------------------------------------ shared plumbing
    def _table(self, compressed: bool, n_pos: int, device: torch.device) -> torch.Tensor:
        """complex [T, R/2] rope table of layers with/without compression (§3.3), T >= n_pos."""
        a = self.args
        n = max(n_pos, a.max_seq_len)
        key = (compressed, n, str(device))
        if key not in self._rope_tables:
            base, orig = (a.compress_rope_theta, a.original_seq_len) if compressed else (a.rope_theta, 0)
            table = precompute_freqs_cis(a.rope_head_dim, n, orig, base, a.rope_factor, a.beta_fast, a.beta_slow)
            self._rope_tables = {k: v for k, v in self._rope_tables.items() if k[0] != compressed}
            self._rope_tables[key] = table.to(device)
        return self._rope_tables[key]

    def _context(self, layout: AttnLayout, indexer_loss: bool) -> AttnContext:
        dev = layout.q_pos.device
        n_pos = int(layout.q_pos.max()) + 1 if layout.q_pos.numel() else 1
        freqs_q = {c: self._table(c, n_pos, dev)[layout.q_pos] for c in (False, True)}
        table = self._table(True, n_pos, dev)
        freqs_anchor = {r: table[gl.anchor_pos] for r, gl in layout.groups.items()}
        return AttnContext(layout, SharedAttnState(), freqs_q, freqs_anchor, self.args.qat, indexer_loss)

    def _run_layers(
        self,
        input_ids: torch.Tensor,
        ctx: AttnContext,
        caches: list[LayerCache] | None,
        image_mask: torch.Tensor | None,
        engram_inputs: dict[str, Any] | None,
    ) -> tuple[torch.Tensor, list[RouterStats], torch.Tensor | None]:
        B, S = input_ids.shape
        a = self.args
        h_BSCD = self.embed(input_ids).unsqueeze(2).repeat(1, 1, a.hc_mult, 1)  # hc identical copies
        pre_mix = identity_pre_mix(B, S, a.hc_mult, device=input_ids.device)
        stats, captured = [], []
        for i, layer in enumerate(self.layers):
            if layer.engram is not None:
                h_BSCD = layer.engram(h_BSCD, **(engram_inputs or {}))
            if i in a.dspark_target_layer_ids:  # DSpark context: mean of the streams at the INPUT
                captured.append(h_BSCD.mean(dim=2))
            h_BSCD, pre_mix, s = layer(h_BSCD, pre_mix, ctx, None if caches is None else caches[i], image_mask)
            stats.append(s)
        # Final collapse with the last block's carried FFN pre (V4.1 has no separate hc_head).
        x_BSD = self.norm(hc_pre(h_BSCD, pre_mix))
        return x_BSD, stats, torch.cat(captured, dim=-1) if captured else None

    # ------------------------------------------------------------------ entry points
    def forward(
        self,
        input_ids: torch.Tensor,
        doc_ids: torch.Tensor | None = None,
        *,
        image_mask: torch.Tensor | None = None,
        compute_indexer_loss: bool | None = None,
        engram_inputs: dict[str, Any] | None = None,
    ) -> TransformerOutput:
        """Teacher-forced forward over packed rows.

        input_ids [B,S]; doc_ids [B,S] (a document starts wherever the id changes; None = one
        document per row). Attention (window and compressed), compression groups, indexer and RoPE
        positions all restart at document boundaries, so a packed row equals its documents run alone.
        `compute_indexer_loss` (default: when autograd is on) adds the indexer alignment loss.
        image_mask [B,S] bool selects the MoE's vision routing bias; engram_inputs go to Engram layers.
        """
        a = self.args
        if doc_ids is None:
            doc_ids = torch.zeros_like(input_ids)
        layout = build_packed_layout(doc_ids, a.window_size, self.ratios, a.candidate_block_size)
        if compute_indexer_loss is None:
            compute_indexer_loss = torch.is_grad_enabled()
        ctx = self._context(layout, compute_indexer_loss)
        x_BSD, stats, main_hidden = self._run_layers(input_ids, ctx, None, image_mask, engram_inputs)
        logits = self.head(x_BSD.float())
        losses = ctx.state.indexer_losses
        indexer_loss = torch.stack(losses).mean() if losses else logits.new_zeros(())
        return TransformerOutput(logits, stats, indexer_loss, x_BSD, main_hidden)

    def forward_incremental(
        self,
        input_ids: torch.Tensor,
        start_pos: int,
        cache: ModelCache,
        *,
        image_mask: torch.Tensor | None = None,
        engram_inputs: dict[str, Any] | None = None,
        return_main_hidden: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [B,S,V] fp32 for S new tokens at positions start_pos.. (prefill, chunked prefill,
        one-token decode or k-token verification alike). `cache` is extended in place; start_pos
        must equal cache.seq_len (one document per row, rows share start_pos). With
        `return_main_hidden`, returns (logits, main_hidden) (the DSpark context of these tokens)."""
        a = self.args
        if start_pos != cache.seq_len:
            raise ValueError(f"start_pos {start_pos} != cache.seq_len {cache.seq_len}")
        if not cache.layers:
            cache.layers = [LayerCache(max_rollback=cache.max_rollback) for _ in self.layers]
        B, S = input_ids.shape
        tail = cache.layers[0].window_kv
        window_base = start_pos - (0 if tail is None else tail.size(1))
        layout = build_incremental_layout(
            B, start_pos, S, a.window_size, window_base, self.ratios, a.candidate_block_size, input_ids.device
        )
        ctx = self._context(layout, indexer_loss=False)
        x_BSD, _, main_hidden = self._run_layers(input_ids, ctx, cache.layers, image_mask, engram_inputs)
        cache.seq_len += S
        logits = self.head(x_BSD.float())
        return (logits, main_hidden) if return_main_hidden else logits
