"""The V4.1 backbone: embedding, Single-Pass-mHC blocks, final collapse, fp32 head.

Two entry points over the same modules: `Transformer.forward` (teacher-forced training over packed
rows, logits at every position, router stats, indexer alignment loss) and
`Transformer.forward_incremental` (any number of new tokens at any `start_pos`, with `ModelCache`).
Layers share compressed KV / top-k through an explicit per-call `SharedAttnState`. Engram layers
(`layers.{i}.engram`) read hash ids made once per call; the DSpark drafter (`mtp.*`, model/dspark.py)
is reached through `draft_teacher_forced` / `draft_step` on detached backbone features.
Images enter through `images` + `token_types` (ViT and aligner in model/vision.py).
Layer ranges (`start_streams` / `run_layers` / `collapse`, `encode_incremental`) let CED prefill and
its training simulation (model/ced.py, model/replay.py) run the encoder and the decoder apart.
Not here: the Engram hash, DSpark and ViT internals (their modules), checkpoint I/O, parallelism.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

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
    build_ragged_layout,
)
from model.config import ModelArgs
from model.engram import Engram, EngramHasher
from model.mhc import hc_coefficients, hc_post, hc_pre, identity_pre_mix, init_hc_params
from model.moe import MoE, RouterStats
from model.norm import RMSNorm
from model.rope import precompute_freqs_cis
from model.vision import DELIMITER_NAMES, Aligner, ViT, embed_images

if TYPE_CHECKING:
    from model.dspark import DraftOutput, DraftStep, DSparkCache, Markov

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
    # the newest tokens (Engram n-grams reach max_ngram-1 back), kept when the model hashes itself
    recent_ids: torch.Tensor | None = None
    # the DSpark drafter's context window (allocated by Transformer.draft_step)
    dspark: DSparkCache | None = None
    # CED decoder bounded replay (model/ced.py): how many of the newest positions' encoder output
    # (the decoder's input streams h [B,T,hc,D] and carried pre [B,T,hc] fp32) to keep; 0 = none.
    encoder_out_len: int = 0
    encoder_h: torch.Tensor | None = None
    encoder_pre: torch.Tensor | None = None

    def truncate(self, new_len: int) -> None:
        """Roll back to the first `new_len` tokens (seq_len - max_rollback <= new_len <= seq_len)."""
        n_drop = self.seq_len - new_len
        if not 0 <= n_drop <= self.max_rollback:
            raise ValueError(f"cannot truncate {self.seq_len} -> {new_len} (max_rollback {self.max_rollback})")
        for layer in self.layers:
            layer.truncate(n_drop, new_len)
        if self.recent_ids is not None:
            self.recent_ids = self.recent_ids[:, : self.recent_ids.size(1) - n_drop]
        if self.dspark is not None:
            self.dspark.truncate(new_len)
        if self.encoder_h is not None:
            keep = self.encoder_h.size(1) - n_drop
            self.encoder_h, self.encoder_pre = self.encoder_h[:, :keep], self.encoder_pre[:, :keep]
        self.seq_len = new_len

    def remember_encoder_out(self, h_BSCD: torch.Tensor, pre_mix_BSC: torch.Tensor) -> None:
        """Append the encoder output of the tokens just consumed, keeping encoder_out_len (+ max_rollback)."""
        if self.encoder_h is not None:
            h_BSCD = torch.cat([self.encoder_h, h_BSCD], dim=1)
            pre_mix_BSC = torch.cat([self.encoder_pre, pre_mix_BSC], dim=1)
        start = max(0, h_BSCD.size(1) - self.encoder_out_len - self.max_rollback)
        self.encoder_h, self.encoder_pre = h_BSCD[:, start:], pre_mix_BSC[:, start:]


@dataclass
class Streams:
    """The mHC residual streams of one call between layer ranges: h [B,S,hc,D], pre_mix [B,S,hc] fp32
    (the FFN pre carried from the last layer run), and what the layers run so far collected."""

    h: torch.Tensor
    pre_mix: torch.Tensor
    stats: list[RouterStats] = field(default_factory=list)
    captured: list[torch.Tensor] = field(default_factory=list)


@dataclass
class EncoderPass:
    """`Transformer.encode_incremental`'s result: the streams after the encoder layers and the call's
    context (layout, shared state), engram inputs and image mask, for the decoder layers to continue."""

    streams: Streams
    ctx: AttnContext
    engram_inputs: dict[str, Any] | None
    image_mask: torch.Tensor | None


class Block(nn.Module):
    """One layer: attention and MoE between mHC pre/post mixes (model_reference §3.2).

    Single-Pass mHC: each sub-layer's input collapse uses the `pre` produced by the PREVIOUS
    sub-layer's mixes (attention: the previous block's FFN `pre`, one-hot for block 0; FFN: this
    block's attention `pre`), and `forward` returns its FFN `pre` for the next block.
    `engram` (optional) is applied to the stream before the block by the Transformer. Layer ids
    >= n_layers are DSpark stages: their MoE has the DSpark expert counts (reference get_moe_config).
    """

    def __init__(self, args: ModelArgs, layer_id: int, engram: nn.Module | None = None):
        super().__init__()
        self.layer_id = layer_id
        self.norm_eps, self.hc_mult = args.norm_eps, args.hc_mult
        self.hc_sinkhorn_iters, self.hc_eps = args.hc_sinkhorn_iters, args.hc_eps
        self.attn = Attention(args, layer_id)
        self.ffn = MoE(args, *args.dspark_experts) if layer_id >= args.n_layers else MoE(args)
        self.ffn.layer_id = layer_id  # routing record/replay keys (model.moe.routing_replay)
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
        return self.run(h_BSCD, pre_mix_BSC, lambda x_BSD: self.attn(x_BSD, ctx, cache), image_mask)

    def attn_input(self, h_BSCD: torch.Tensor, pre_mix_BSC: torch.Tensor) -> torch.Tensor:
        """The attention input [B,S,D] `forward` computes from these streams (attn_norm of the collapse
        with the carried pre): what a kv source projects its global bank from."""
        hc = {"norm_eps": self.norm_eps, "hc_eps": self.hc_eps, "iters": self.hc_sinkhorn_iters}
        return self.attn_norm(self.mixes_pre(h_BSCD, pre_mix_BSC, *self._hc("attn"), **hc)[0])

    def run(
        self,
        h_BSCD: torch.Tensor,
        pre_mix_BSC: torch.Tensor,
        attend: Callable[[torch.Tensor], torch.Tensor],
        image_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, RouterStats]:
        """`forward` with the attention given as `attend(attn_norm output [B,S,D]) -> [B,S,D]`
        (DSpark stages attend over the backbone context instead of their own past)."""
        hc = {"norm_eps": self.norm_eps, "hc_eps": self.hc_eps, "iters": self.hc_sinkhorn_iters}
        # attention coefficients from the stream BEFORE attention; its input uses the carried pre
        x_BSD, attn_pre, attn_post, attn_comb = self.mixes_pre(h_BSCD, pre_mix_BSC, *self._hc("attn"), **hc)
        f_BSD = attend(self.attn_norm(x_BSD))
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


def run_layer(
    layer: Block,
    h_BSCD: torch.Tensor,
    pre_mix_BSC: torch.Tensor,
    ctx: AttnContext,
    cache: LayerCache | None,
    image_mask: torch.Tensor | None,
    engram_inputs: dict[str, Any] | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, RouterStats]:
    """One backbone layer as `Transformer.run_layers` runs it: the Engram lookup on its layers, then
    the block. Returns (the block's input streams, whose mean a DSpark target captures; h; pre_mix;
    stats). A function of the layer rather than a method, so that one compiled version of it serves
    every layer of one kind (model/ragged_cache.py compile_decode)."""
    if layer.engram is not None:
        h_BSCD = layer.engram(h_BSCD, **engram_inputs)
    return h_BSCD, *layer(h_BSCD, pre_mix_BSC, ctx, cache, image_mask)


def ragged_head(model: Transformer, streams: Streams, n_real: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A ragged call's ending: (the fp32 logits [B,V] after each row's last real token, the DSpark
    context [B,S,X] or None). A function of the model, as `run_layer` is of a layer, so that compiled
    decode steps compile it (model/ragged_cache.py compile_decode)."""
    x_BSD, main_hidden = model.collapse(streams)
    last = (n_real - 1).clamp(min=0)
    return model.head(x_BSD[torch.arange(x_BSD.size(0), device=x_BSD.device), last].float()), main_hidden


def make_engram_inputs(
    hasher: EngramHasher,
    input_ids: torch.Tensor,
    *,
    image_mask: torch.Tensor | None = None,
    doc_ids: torch.Tensor | None = None,
    context_ids: torch.Tensor | None = None,
    context_image_mask: torch.Tensor | None = None,
) -> dict[str, torch.Tensor | None]:
    """The `engram_inputs` of ONE forward call: {"hashes": [B,S,n_engram_layers,C] int64 on
    input_ids' device, "engram_mask": ~image_mask or None} (§3.1: hashes once per call, image spans
    closed). Packed rows: pass the call's doc_ids. An incremental call at start_pos > 0: pass
    context_ids = the row's tokens [start_pos - c, start_pos) with c = min(start_pos, max_ngram - 1)
    (and context_image_mask if any of them were image positions)."""
    hashes = hasher(
        input_ids, image_mask, doc_ids=doc_ids, context_ids=context_ids, context_image_mask=context_image_mask
    )
    return {"hashes": hashes.to(input_ids.device), "engram_mask": None if image_mask is None else ~image_mask}


class Transformer(nn.Module):
    """Backbone with official parameter names (`embed`, `layers.{i}.*` incl. `layers.{i}.engram.*`,
    `norm`, `head`) and the DSpark drafter `mtp.{k}.*` when dspark_block_size > 0.

    Construction allocates parameters only (works on the meta device); call `init_weights` for
    values and pass a `ModelCache` to `forward_incremental` for inference state. Engram hashes come
    from the caller (`engram_inputs`, see make_engram_inputs) or, when given none, from the attached
    `engram_hasher` (EngramHasher(args, tokenizer)): forward passes it the call's doc_ids and image
    mask, forward_incremental the cached last max_ngram-1 tokens as context.
    """

    def __init__(self, args: ModelArgs, engram_hasher: EngramHasher | None = None):
        super().__init__()
        self.args = args
        self.engram_hasher = engram_hasher
        self.embed = nn.Embedding(args.vocab_size, args.dim)
        engrams = {i: Engram(args, i) for i in args.engram_layer_ids}
        self.layers = nn.ModuleList(Block(args, i, engrams.get(i)) for i in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        # bf16 in checkpoints, held in fp32 so logits come out fp32 (§3.13).
        self.head = nn.Linear(args.dim, args.vocab_size, bias=False, dtype=torch.float32)
        self.vision = self.aligner = None
        if args.vision_n_layers > 0:  # DeepSeek-ViT + 3x3 unshuffle aligner + learned span delimiters
            self.vision, self.aligner = ViT(args), Aligner(args)
            for name in DELIMITER_NAMES.values():
                setattr(self, name, nn.Parameter(torch.empty(args.dim)))
        self.mtp = None
        if args.dspark_enabled:
            from model.dspark import DSpark  # dspark.py builds its stages on Block: a late import, no cycle

            self.mtp = DSpark(args)
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
            if self.vision is not None:
                for name in DELIMITER_NAMES.values():
                    nn.init.normal_(getattr(self, name), std=std)
        for name, p in self.named_parameters():
            p.data = p.data.to(dtypes[name])

    # ------------------------------------------------------------------ shared plumbing
    def _table(self, compressed: bool, n_pos: int, device: torch.device) -> torch.Tensor:
        """Rope table of layers with/without compression (§3.3), T >= n_pos: the real view [T, R/2, 2] (cos,
        sin) of the complex phasors, so a compiled step fuses the rotation (model/rope.py apply_rotary_emb)."""
        a = self.args
        n = max(n_pos, a.max_seq_len)
        key = (compressed, n, str(device))
        if key not in self._rope_tables:
            base, orig = (a.compress_rope_theta, a.original_seq_len) if compressed else (a.rope_theta, 0)
            table = precompute_freqs_cis(a.rope_head_dim, n, orig, base, a.rope_factor, a.beta_fast, a.beta_slow)
            self._rope_tables = {k: v for k, v in self._rope_tables.items() if k[0] != compressed}
            self._rope_tables[key] = torch.view_as_real(table).to(device)
        return self._rope_tables[key]

    def _context(self, layout: AttnLayout, indexer_loss: bool, n_pos: int | None = None) -> AttnContext:
        """`n_pos`: 1 + the largest position of the call when the caller knows it (no host sync)."""
        dev = layout.q_pos.device
        if n_pos is None:
            n_pos = int(layout.q_pos.max()) + 1 if layout.q_pos.numel() else 1
        freqs_q = {c: self._table(c, n_pos, dev)[layout.q_pos] for c in (False, True)}
        table = self._table(True, n_pos, dev)
        freqs_anchor = {r: table[gl.anchor_pos] for r, gl in layout.groups.items()}
        return AttnContext(layout, SharedAttnState(), freqs_q, freqs_anchor, self.args.qat, indexer_loss)

    def _embed(
        self, input_ids: torch.Tensor, images: Sequence[Any] | None, token_types: torch.Tensor | None, start_pos: int
    ) -> torch.Tensor:
        """Token embeddings [B,S,D] with image spans overwritten by ViT+aligner rows and delimiters (§3.15)."""
        h_BSD = self.embed(input_ids)
        if images:
            if self.vision is None:
                raise ValueError("images were given but this config has no vision tower (vision_n_layers == 0)")
            if token_types is None:
                raise ValueError("images need token_types [B,S] (Tokenizer.image_span / expand_image_placeholders)")
            delimiters = {name: getattr(self, name) for name in DELIMITER_NAMES.values()}
            h_BSD = embed_images(h_BSD, images, token_types, self.vision, self.aligner, delimiters, start_pos)
        return h_BSD

    def start_streams(self, h_BSD: torch.Tensor) -> Streams:
        """hc identical copies of the embeddings and the one-hot pre of block 0."""
        B, S, _ = h_BSD.shape
        hc = self.args.hc_mult
        return Streams(h_BSD.unsqueeze(2).repeat(1, 1, hc, 1), identity_pre_mix(B, S, hc, device=h_BSD.device))

    def run_layers(
        self,
        streams: Streams,
        layer_ids: range,
        ctx: AttnContext,
        caches: list[LayerCache] | None,
        image_mask: torch.Tensor | None,
        engram_inputs: dict[str, Any] | None,
        layer_fn: Callable[..., tuple] = run_layer,
    ) -> Streams:
        """Advance `streams` (in place) through backbone layers `layer_ids`, in order, each by
        `layer_fn` (`run_layer`, or its compiled version)."""
        for i in layer_ids:
            cache = None if caches is None else caches[i]
            h_in, streams.h, streams.pre_mix, s = layer_fn(
                self.layers[i], streams.h, streams.pre_mix, ctx, cache, image_mask, engram_inputs
            )
            if i in self.args.dspark_target_layer_ids:  # DSpark context: mean of the streams at the INPUT
                streams.captured.append(h_in.mean(dim=2))
            streams.stats.append(s)
        return streams

    def collapse(self, streams: Streams) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(final-norm output [B,S,D], DSpark context or None) after the last layer."""
        # Final collapse with the last block's carried FFN pre (V4.1 has no separate hc_head).
        x_BSD = self.norm(hc_pre(streams.h, streams.pre_mix))
        return x_BSD, torch.cat(streams.captured, dim=-1) if streams.captured else None

    def _engram_inputs(
        self,
        input_ids: torch.Tensor,
        image_mask: torch.Tensor | None,
        doc_ids: torch.Tensor | None,
        engram_inputs: dict[str, Any] | None,
        cache: ModelCache | None = None,
    ) -> dict[str, Any] | None:
        a = self.args
        if not a.engram_layer_ids:
            return None
        if engram_inputs is None:
            if self.engram_hasher is None:
                raise ValueError(
                    f"this model has Engram layers {a.engram_layer_ids}: pass engram_inputs="
                    "make_engram_inputs(hasher, input_ids, image_mask=..., doc_ids=...) (incremental calls: "
                    "also context_ids=the previous max_ngram-1 tokens) with hasher = EngramHasher(args, "
                    "tokenizer), or build Transformer(args, engram_hasher=hasher) to hash inside forward"
                )
            n_ctx = a.engram_max_ngram_size - 1
            ctx = None if cache is None or cache.recent_ids is None else cache.recent_ids[:, -n_ctx:]
            engram_inputs = make_engram_inputs(
                self.engram_hasher, input_ids, image_mask=image_mask, doc_ids=doc_ids,
                context_ids=None if ctx is None else ctx.clamp(min=0),
                context_image_mask=None if ctx is None else ctx < 0,
            )  # fmt: skip
        want = (*input_ids.shape, len(a.engram_layer_ids))
        if tuple(engram_inputs["hashes"].shape[:3]) != want:
            raise ValueError(f"engram_inputs['hashes'] has shape {tuple(engram_inputs['hashes'].shape)}, want {want}+C")
        return engram_inputs

    def _remember_ids(self, cache: ModelCache, input_ids: torch.Tensor, image_mask: torch.Tensor | None) -> None:
        """Keep the newest tokens (-1 at image positions) for the next call's Engram context."""
        if not self.args.engram_layer_ids:
            return
        ids = input_ids if image_mask is None else input_ids.masked_fill(image_mask, -1)
        if cache.recent_ids is not None:
            ids = torch.cat([cache.recent_ids, ids], dim=1)
        keep = self.args.engram_max_ngram_size - 1 + cache.max_rollback
        cache.recent_ids = ids[:, max(0, ids.size(1) - keep) :]

    # ------------------------------------------------------------------ entry points
    def forward(
        self,
        input_ids: torch.Tensor,
        doc_ids: torch.Tensor | None = None,
        *,
        image_mask: torch.Tensor | None = None,
        compute_indexer_loss: bool | None = None,
        engram_inputs: dict[str, Any] | None = None,
        images: Sequence[Any] | None = None,
        token_types: torch.Tensor | None = None,
    ) -> TransformerOutput:
        """Teacher-forced forward over packed rows.

        input_ids [B,S]; doc_ids [B,S] (a document starts wherever the id changes; None = one
        document per row). Attention (window and compressed), compression groups, indexer and RoPE
        positions all restart at document boundaries, so a packed row equals its documents run alone.
        `compute_indexer_loss` (default: when autograd is on) adds the indexer alignment loss.
        image_mask [B,S] bool selects the MoE's vision routing bias and closes the Engram gate.
        engram_inputs: make_engram_inputs(hasher, input_ids, image_mask=, doc_ids=) (required with
        Engram layers unless an engram_hasher is attached).
        images (model.image_processor.ProcessedImage, in span order) + token_types [B,S] (TEXT = -1,
        image span >= 0) overwrite the spans' embeddings; token_types also sets image_mask when absent.
        """
        a = self.args
        if image_mask is None and token_types is not None:
            image_mask = token_types >= 0
        engram_inputs = self._engram_inputs(input_ids, image_mask, doc_ids, engram_inputs)
        if doc_ids is None:
            doc_ids = torch.zeros_like(input_ids)
        layout = build_packed_layout(doc_ids, a.window_size, self.ratios, a.candidate_block_size)
        if compute_indexer_loss is None:
            compute_indexer_loss = torch.is_grad_enabled()
        ctx = self._context(layout, compute_indexer_loss)
        streams = self.start_streams(self._embed(input_ids, images, token_types, 0))
        self.run_layers(streams, range(a.n_layers), ctx, None, image_mask, engram_inputs)
        x_BSD, main_hidden = self.collapse(streams)
        stats = streams.stats
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
        images: Sequence[Any] | None = None,
        token_types: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [B,S,V] fp32 for S new tokens at positions start_pos.. (prefill, chunked prefill,
        one-token decode or k-token verification alike). `cache` is extended in place; start_pos
        must equal cache.seq_len (one document per row, rows share start_pos). With
        `return_main_hidden`, returns (logits, main_hidden) (the DSpark context of these tokens).
        engram_inputs: as forward's, with context_ids = the max_ngram-1 tokens before start_pos; without
        them the attached engram_hasher hashes with the tokens the cache remembers."""
        a = self.args
        enc = self.encode_incremental(
            input_ids, start_pos, cache, image_mask=image_mask, engram_inputs=engram_inputs, images=images,
            token_types=token_types,
        )  # fmt: skip
        self.run_layers(enc.streams, range(a.n_encoder_layers, a.n_layers), enc.ctx, cache.layers, enc.image_mask,
                        enc.engram_inputs)  # fmt: skip
        x_BSD, main_hidden = self.collapse(enc.streams)
        logits = self.head(x_BSD.float())
        return (logits, main_hidden) if return_main_hidden else logits

    def forward_ragged(
        self,
        input_ids: torch.Tensor,
        pos: torch.Tensor,
        n_real: torch.Tensor,
        cache: ModelCache,
        *,
        max_end: int,
        bank_slots: dict[int, int],
        engram_inputs: dict[str, Any] | None = None,
        return_main_hidden: bool = False,
        layer_fn: Callable[..., tuple] = run_layer,
        layout_fn: Callable[..., AttnLayout] = build_ragged_layout,
        head_fn: Callable[..., tuple] = ragged_head,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [B,V] fp32 after each row's last real token: input_ids [B,S] holds row b's next
        n_real[b] tokens (then padding) at positions pos[b].., over model/ragged_cache.py's batched
        cache (rings right-aligned, banks preallocated, `bank_slots[r]` the trash slot per ratio);
        max_end >= max(pos + n_real), known to the caller (no host sync): the first max_end // r bank
        slots are visible where complete (decode steps pass the banks' size: shapes that do not move).
        The cache is extended in place, padding included (the caller realigns the rings); seq_len is
        not used (rows differ).
        engram_inputs as forward_incremental's, required with Engram layers (rows' contexts differ,
        so the caller hashes). With `return_main_hidden`: (logits, DSpark context [B,S,X]).
        `layer_fn`, `layout_fn`, `head_fn`: what runs each layer (`run_layer`), builds the attention
        layout (`build_ragged_layout`) and ends the call (`ragged_head`); compiled decode steps pass
        their compiled versions."""
        a = self.args
        enc = self.encode_ragged(input_ids, pos, n_real, cache, max_end=max_end, bank_slots=bank_slots,
                                 engram_inputs=engram_inputs, layer_fn=layer_fn, layout_fn=layout_fn)  # fmt: skip
        streams = enc.streams
        self.run_layers(streams, range(a.n_encoder_layers, a.n_layers), enc.ctx, cache.layers, None, enc.engram_inputs,
                        layer_fn)  # fmt: skip
        logits, main_hidden = head_fn(self, streams, n_real)
        return (logits, main_hidden) if return_main_hidden else logits

    def encode_ragged(
        self,
        input_ids: torch.Tensor,
        pos: torch.Tensor,
        n_real: torch.Tensor,
        cache: ModelCache,
        *,
        max_end: int,
        bank_slots: dict[int, int],
        engram_inputs: dict[str, Any] | None = None,
        layer_fn: Callable[..., tuple] = run_layer,
        layout_fn: Callable[..., AttnLayout] = build_ragged_layout,
    ) -> EncoderPass:
        """The first half of `forward_ragged` (arguments as there): the encoder layers over the rows'
        new tokens, the encoder output remembered when encoder_out_len > 0; the decoder layers'
        caches are untouched, for the caller to run (forward_ragged) or to replay (CED prefill)."""
        a = self.args
        if a.engram_layer_ids and engram_inputs is None:
            raise ValueError("forward_ragged needs engram_inputs (make_engram_inputs per row context)")
        engram_inputs = self._engram_inputs(input_ids, None, None, engram_inputs, cache)
        self._remember_ids(cache, input_ids, None)
        S = input_ids.size(1)
        layout = layout_fn(
            pos, n_real, S, a.window_size, cache.layers[0].window_kv.size(1), self.ratios, a.candidate_block_size,
            {r: max_end // r for r in self.ratios}, bank_slots,
        )  # fmt: skip
        ctx = self._context(layout, indexer_loss=False, n_pos=max_end + S)
        streams = self.start_streams(self.embed(input_ids))
        self.run_layers(streams, range(a.n_encoder_layers), ctx, cache.layers, None, engram_inputs, layer_fn)
        if cache.encoder_out_len:
            cache.remember_encoder_out(streams.h, streams.pre_mix)
        return EncoderPass(streams, ctx, engram_inputs, None)

    def encode_incremental(
        self,
        input_ids: torch.Tensor,
        start_pos: int,
        cache: ModelCache,
        *,
        image_mask: torch.Tensor | None = None,
        engram_inputs: dict[str, Any] | None = None,
        images: Sequence[Any] | None = None,
        token_types: torch.Tensor | None = None,
    ) -> EncoderPass:
        """The first half of `forward_incremental` (arguments as there): the encoder layers
        0..n_encoder_layers-1 over the new tokens. The cache counts the tokens as consumed
        (seq_len += S, encoder caches extended, encoder output remembered when encoder_out_len > 0);
        the decoder layers' caches are untouched, for the caller to run (forward_incremental) or to
        replay (CED prefill, model/ced.py)."""
        a = self.args
        if start_pos != cache.seq_len:
            raise ValueError(f"start_pos {start_pos} != cache.seq_len {cache.seq_len}")
        if image_mask is None and token_types is not None:
            image_mask = token_types >= 0
        engram_inputs = self._engram_inputs(input_ids, image_mask, None, engram_inputs, cache)
        self._remember_ids(cache, input_ids, image_mask)
        if not cache.layers:
            cache.layers = [LayerCache(max_rollback=cache.max_rollback) for _ in self.layers]
        B, S = input_ids.shape
        tail = cache.layers[0].window_kv
        window_base = start_pos - (0 if tail is None else tail.size(1))
        layout = build_incremental_layout(
            B, start_pos, S, a.window_size, window_base, self.ratios, a.candidate_block_size, input_ids.device
        )
        ctx = self._context(layout, indexer_loss=False)
        streams = self.start_streams(self._embed(input_ids, images, token_types, start_pos))
        self.run_layers(streams, range(a.n_encoder_layers), ctx, cache.layers, image_mask, engram_inputs)
        if cache.encoder_out_len:
            cache.remember_encoder_out(streams.h, streams.pre_mix)
        cache.seq_len += S
        return EncoderPass(streams, ctx, engram_inputs, image_mask)

    # ------------------------------------------------------------------ DSpark drafter
    def _drafter(self):
        if self.mtp is None:
            raise ValueError("DSpark is off for this config (dspark_block_size == 0)")
        return self.mtp

    def draft_teacher_forced(
        self,
        main_hidden: torch.Tensor,
        input_ids: torch.Tensor,
        k: int | None = None,
        *,
        doc_ids: torch.Tensor | None = None,
        markov: Markov = "teacher",
        with_logits: bool = True,
        anchors: torch.Tensor | None = None,
    ) -> DraftOutput:
        """DSpark drafts for every anchor position of a teacher-forced row (model.dspark.DraftOutput:
        logits [B,S,k,V], row i of anchor s predicts token s+1+i). main_hidden: TransformerOutput's.
        The context, the embedding and the head enter DETACHED, so a DSpark loss trains mtp.* only.
        k defaults to dspark_block_size. with_logits=False: no logits, for dspark_loss_chunked.
        anchors [B,S] bool: only those anchors, outputs [1,n,k,...] (DSpark.draft_teacher_forced)."""
        mtp = self._drafter()
        K = mtp.block_size
        table = self._table(False, input_ids.size(1) + K, input_ids.device)
        return mtp.draft_teacher_forced(
            main_hidden.detach(), input_ids, k or K, embed_weight=self.embed.weight.detach(),
            head_weight=self.head.weight.detach(), rope_table=table, doc_ids=doc_ids, markov=markov,
            with_logits=with_logits, anchors=anchors,
        )  # fmt: skip

    @torch.no_grad()
    def draft_step(
        self,
        anchor_ids: torch.Tensor,
        main_hidden: torch.Tensor,
        cache: ModelCache,
        k: int | None = None,
        *,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
    ) -> DraftStep:
        """Draft k tokens at decode time (the reference's forward_spec; model.dspark.DraftStep).

        anchor_ids [B]: the token at position cache.seq_len, sampled but not yet consumed.
        main_hidden [B,n,X]: the DSpark context of the tokens the backbone consumed since the last
        draft_step (forward_incremental(..., return_main_hidden=True); after a verification call only
        the accepted prefix), so that the drafter's context ends where the backbone cache does.
        """
        from model.dspark import DSparkCache

        mtp = self._drafter()
        if cache.dspark is None:
            cache.dspark = DSparkCache(max_rollback=cache.max_rollback)
        if cache.dspark.seq_len + main_hidden.size(1) != cache.seq_len:
            raise ValueError(
                f"DSpark context covers {cache.dspark.seq_len} tokens, main_hidden adds {main_hidden.size(1)}, but "
                f"the backbone cache holds {cache.seq_len}: pass the main_hidden of every token consumed since "
                "the last draft_step"
            )
        table = self._table(False, cache.seq_len + mtp.block_size, anchor_ids.device)
        mtp.extend_context(main_hidden, cache.dspark, table)
        return mtp.draft_step(
            anchor_ids, cache.dspark, k or mtp.block_size, embed_weight=self.embed.weight,
            head_weight=self.head.weight, rope_table=table, temperature=temperature, generator=generator,
        )  # fmt: skip
