"""Parameter, active-parameter and cache-byte accounting for a ModelArgs, by official tensor name.

Two independent paths that must agree: `official_shapes(args)` lists every official tensor name
and shape from the config alone (model_reference §3.17), and `param_counts_from_model(model)`
classifies a built model's `named_parameters()` (build it on the meta device for `flash`). Both
sum into the same families via `classify`. Counts are logical weight elements: quantisation
scale tensors (`*.scale`) and buffers (caches) are not parameters. Nothing here runs a forward.

Active parameters per token (`active_params`) count every weight element a token's computation
multiplies, plus the rows it gathers (one embedding row of `dim`, one Engram row per hash head);
DSpark and vision are excluded (the drafter is a separate pass, images are not tokens).
* decode (per generated token): every backbone layer (attention, its compressor/indexer if any,
  router, the top-k routed experts, the shared expert, mHC, norms, Engram projections), the final
  norm and the head.
* prefill (per prompt token, CED path of the report): the encoder layers 0..n/2-1 as in decode,
  plus what projects the decoder's global bank: the first decoder layer's attn_norm, compressor
  and indexer key projection (wk, k_norm). No head (logits only at the last position) and no
  decoder body; the decoder's bounded replay of the last `window_size` prompt tokens is a fixed
  per-prompt cost, not a per-token one, and is left out.
"""

from __future__ import annotations

import math
from collections import defaultdict

from torch import nn

from model.config import ModelArgs

FAMILIES = (
    "routed_experts", "shared_experts", "router", "attention", "compressor", "indexer", "mhc",
    "norms", "embed", "head", "engram", "engram_table", "dspark", "vision",
)  # fmt: skip
# "backbone" = what the report's 552B counts: everything except the Engram tables (reported
# separately as 196B), the DSpark drafter and the vision tower.
BACKBONE_EXCLUDES = ("engram_table", "dspark", "vision")

Shapes = dict[str, tuple[int, ...]]


def classify(name: str) -> str:
    """Family of an official tensor name; unknown names raise so new tensors get accounted."""
    parts = name.split(".")
    if parts[0] == "mtp":
        return "dspark"
    if parts[0] in ("vision", "aligner") or parts[0].startswith("image_"):
        return "vision"
    if parts[0] == "embed":
        return "embed"
    if parts[0] == "head":
        return "head"
    if parts[0] == "norm":
        return "norms"
    if parts[0] != "layers":
        raise ValueError(f"cannot classify tensor {name!r}: not an official V4.1 name")
    sub = ".".join(parts[2:])
    if sub.startswith("engram.embed."):
        return "engram_table"
    if sub.startswith("engram."):
        return "engram"
    if parts[-2].endswith("norm") and parts[-1] == "weight":
        return "norms"  # attn_norm, ffn_norm, q_norm, kv_norm, compressor.norm, indexer.k_norm
    if sub.startswith("hc_"):
        return "mhc"
    for prefix, family in (
        ("ffn.experts.", "routed_experts"),
        ("ffn.shared_experts.", "shared_experts"),
        ("ffn.gate.", "router"),
        ("attn.compressor.", "compressor"),
        ("attn.indexer.", "indexer"),
        ("attn.", "attention"),
    ):
        if sub.startswith(prefix):
            return family
    raise ValueError(f"cannot classify tensor {name!r}: not an official V4.1 name")


# -------------------------------------------------------------------- shapes from the config
def _attention(p: str, a: ModelArgs, shapes: Shapes) -> None:
    hd = a.n_heads * a.head_dim
    shapes[f"{p}.wq_a.weight"] = (a.q_lora_rank, a.dim)
    shapes[f"{p}.q_norm.weight"] = (a.q_lora_rank,)
    shapes[f"{p}.wq_b.weight"] = (hd, a.q_lora_rank)
    shapes[f"{p}.wkv.weight"] = (a.head_dim, a.dim)
    shapes[f"{p}.kv_norm.weight"] = (a.head_dim,)
    shapes[f"{p}.wo_a.weight"] = (a.o_groups * a.o_lora_rank, hd // a.o_groups)
    shapes[f"{p}.wo_b.weight"] = (a.dim, a.o_groups * a.o_lora_rank)
    shapes[f"{p}.attn_sink"] = (a.n_heads,)


def _moe(p: str, a: ModelArgs, n_experts: int, shapes: Shapes) -> None:
    shapes[f"{p}.gate.weight"] = (n_experts, a.dim)
    shapes[f"{p}.gate.bias"] = (n_experts,)
    if a.vision_n_layers > 0:  # modality-specific correction bias exists only with vision
        shapes[f"{p}.gate.bias_vl"] = (n_experts,)
    inter = a.moe_inter_dim
    for j in range(n_experts):
        shapes[f"{p}.experts.{j}.w1.weight"] = (inter, a.dim)
        shapes[f"{p}.experts.{j}.w2.weight"] = (a.dim, inter)
        shapes[f"{p}.experts.{j}.w3.weight"] = (inter, a.dim)
    shared = a.n_shared_experts * inter
    shapes[f"{p}.shared_experts.w1.weight"] = (shared, a.dim)
    shapes[f"{p}.shared_experts.w2.weight"] = (a.dim, shared)
    shapes[f"{p}.shared_experts.w3.weight"] = (shared, a.dim)


def _block(p: str, a: ModelArgs, n_experts: int, shapes: Shapes) -> None:
    n_mix = (2 + a.hc_mult) * a.hc_mult
    for sub in ("attn", "ffn"):
        shapes[f"{p}.hc_{sub}_fn"] = (n_mix, a.hc_mult * a.dim)
        shapes[f"{p}.hc_{sub}_base"] = (n_mix,)
        shapes[f"{p}.hc_{sub}_scale"] = (3,)
    shapes[f"{p}.attn_norm.weight"] = (a.dim,)
    shapes[f"{p}.ffn_norm.weight"] = (a.dim,)
    _attention(f"{p}.attn", a, shapes)
    _moe(f"{p}.ffn", a, n_experts, shapes)


def official_shapes(args: ModelArgs) -> Shapes:
    """Every parameter's official name and logical shape (no `.scale` tensors), from config alone."""
    a, shapes = args, {}
    shapes["embed.weight"] = (a.vocab_size, a.dim)
    for i in range(a.n_layers):
        p = f"layers.{i}"
        if i in a.engram_layer_ids:
            k = a.engram_layer_ids.index(i)
            feat = (a.engram_max_ngram_size - 1) * a.engram_n_heads * a.engram_head_dim
            shapes[f"{p}.engram.embed.weight"] = (a.engram_num_embeddings[k], a.engram_head_dim)
            shapes[f"{p}.engram.wkv.weight"] = ((a.hc_mult + 1) * a.dim, feat)
            shapes[f"{p}.engram.q_weight"] = (a.hc_mult, a.dim)
            shapes[f"{p}.engram.k_weight"] = (a.hc_mult, a.dim)
        _block(p, a, a.n_routed_experts, shapes)
        if a.is_kv_source(i):
            shapes[f"{p}.attn.compressor.wkv.weight"] = (a.head_dim, a.dim)
            if a.compress_ratio(i) > 1:  # ratio 1 has nothing to pool over, so no gate
                shapes[f"{p}.attn.compressor.wgate.weight"] = (a.head_dim, a.dim)
            shapes[f"{p}.attn.compressor.norm.weight"] = (a.head_dim,)
        if a.is_index_source(i):
            shapes[f"{p}.attn.indexer.wq_b.weight"] = (a.index_n_heads * a.index_head_dim, a.q_lora_rank)
            shapes[f"{p}.attn.indexer.weights_proj.weight"] = (a.index_n_heads, a.dim)
            if a.is_kv_source(i):
                shapes[f"{p}.attn.indexer.wk.weight"] = (a.index_head_dim, a.head_dim)
                shapes[f"{p}.attn.indexer.k_norm.weight"] = (a.index_head_dim,)
    shapes["norm.weight"] = (a.dim,)
    shapes["head.weight"] = (a.vocab_size, a.dim)
    if a.dspark_enabled:
        _dspark(a, shapes)
    if a.vision_n_layers > 0:
        _vision(a, shapes)
    return shapes


def _dspark(a: ModelArgs, shapes: Shapes) -> None:
    n_experts, _ = a.dspark_experts
    last = a.n_mtp_layers - 1
    for k in range(a.n_mtp_layers):
        p = f"mtp.{k}"
        _block(p, a, n_experts, shapes)
        if k == 0:
            shapes[f"{p}.main_proj.weight"] = (a.dim, len(a.dspark_target_layer_ids) * a.dim)
            shapes[f"{p}.main_norm.weight"] = (a.dim,)
        if k == last:
            r = a.dspark_markov_rank
            shapes[f"{p}.norm.weight"] = (a.dim,)
            shapes[f"{p}.markov_head.embed.weight"] = (a.vocab_size, r)
            shapes[f"{p}.markov_head.head.weight"] = (a.vocab_size, r)
            shapes[f"{p}.confidence_head.proj.weight"] = (1, a.dim + r)


def _vision(a: ModelArgs, shapes: Shapes) -> None:
    vd, inter = a.vision_dim, a.vision_inter_dim
    shapes["vision.patch_embed.proj.weight"] = (vd, 3 * a.vision_patch_size**2)
    shapes["vision.patch_embed.proj.bias"] = (vd,)
    for b in range(a.vision_n_layers):
        p = f"vision.blocks.{b}"
        shapes[f"{p}.norm1.weight"] = (vd,)
        shapes[f"{p}.norm2.weight"] = (vd,)
        shapes[f"{p}.attn.wqkv.weight"] = (3 * vd, vd)
        shapes[f"{p}.attn.wqkv.bias"] = (3 * vd,)
        shapes[f"{p}.attn.wo.weight"] = (vd, vd)
        shapes[f"{p}.attn.wo.bias"] = (vd,)
        shapes[f"{p}.mlp.w1.weight"] = (2 * inter, vd)
        shapes[f"{p}.mlp.w2.weight"] = (vd, inter)
    shapes["vision.norm.weight"] = (vd,)
    unshuffled = vd * a.vision_downsample_ratio**2
    shapes["aligner.w1.weight"] = (a.dim, unshuffled)
    shapes["aligner.w1.bias"] = (a.dim,)
    shapes["aligner.w2.weight"] = (a.dim, a.dim)
    shapes["aligner.w2.bias"] = (a.dim,)
    for name in ("image_start", "image_end", "image_newline"):
        shapes[name] = (a.dim,)


# -------------------------------------------------------------------- counts
def _by_family(sizes: dict[str, int]) -> dict[str, int]:
    out = dict.fromkeys(FAMILIES, 0)
    for name, n in sizes.items():
        out[classify(name)] += n
    out["backbone"] = sum(v for k, v in out.items() if k in FAMILIES and k not in BACKBONE_EXCLUDES)
    out["total"] = sum(out[k] for k in FAMILIES)
    return out


def param_counts(args: ModelArgs) -> dict[str, int]:
    """Parameters per family plus `backbone` and `total`, from the config alone."""
    return _by_family({name: math.prod(s) for name, s in official_shapes(args).items()})


def param_counts_from_model(model: nn.Module) -> dict[str, int]:
    """The same families from a built model (meta device is fine); `.scale` tensors skipped."""
    return _by_family({n: p.numel() for n, p in model.named_parameters() if not n.endswith(".scale")})


def active_params(args: ModelArgs, phase: str) -> dict[str, int]:
    """Parameters touched per token in `phase` ("prefill" or "decode"), by family (rule: module doc)."""
    if phase not in ("prefill", "decode"):
        raise ValueError(f"phase={phase!r} must be 'prefill' or 'decode'")
    a = args
    enc = a.n_encoder_layers
    out: dict[str, int] = defaultdict(int)
    for name, shape in official_shapes(a).items():
        family, n = classify(name), math.prod(shape)
        if family in ("dspark", "vision"):
            continue
        layer = int(name.split(".")[1]) if name.startswith("layers.") else None
        if layer is None:
            if family == "embed":
                out[family] += a.dim  # one gathered row
            elif phase == "decode":
                out[family] += n  # final norm and head
            continue
        if phase == "prefill" and layer > enc:
            continue
        if phase == "prefill" and layer == enc:
            bank = (".attn_norm.", ".attn.compressor.", ".attn.indexer.wk.", ".attn.indexer.k_norm.")
            if not any(tag in name for tag in bank):
                continue
        if family == "routed_experts":
            n = n * a.n_activated_experts // a.n_routed_experts
        elif family == "engram_table":
            n = (a.engram_max_ngram_size - 1) * a.engram_n_heads * a.engram_head_dim  # gathered rows
        out[family] += n
    result = {f: out[f] for f in FAMILIES if out[f]}
    result["total"] = sum(result.values())
    return result


# -------------------------------------------------------------------- cache bytes
def main_kv_entry_bytes(args: ModelArgs) -> int:
    """Packed compressed-KV entry: FP4 E2M1 payload (head_dim/2 B) + one E4M3 scale per 16."""
    return args.head_dim // 2 + args.head_dim // 16


def index_key_entry_bytes(args: ModelArgs) -> int:
    """Packed indexer key: MXFP4 payload (index_head_dim/2 B) + one UE8M0 scale per 32."""
    return args.index_head_dim // 2 + args.index_head_dim // 32


def swa_entry_bytes(args: ModelArgs) -> int:
    """FP8 window-KV entry: head_dim E4M3 bytes + one UE8M0 scale per 32."""
    return args.head_dim + args.head_dim // 32


def cache_bytes(args: ModelArgs) -> dict[str, float]:
    """Global (persistent) bytes per token and the bounded SWA ring sizes, as the report stores them.

    Only kv sources hold global entries, one per `ratio` tokens, each a main-KV entry plus the
    index key of its indexer (every kv source is an index source, enforced by ModelArgs).
    """
    a = args
    entries = sum(1 / a.compress_ratio(s) for s in a.kv_source_layers)
    per_entry = main_kv_entry_bytes(a) + index_key_entry_bytes(a)
    swa_layer = a.window_size * swa_entry_bytes(a)
    n_swa_rings = a.n_layers + (a.n_mtp_layers if a.dspark_enabled else 0)
    return {
        "global_entries_per_token": entries,
        "main_kv_entry_bytes": main_kv_entry_bytes(a),
        "index_key_entry_bytes": index_key_entry_bytes(a),
        "global_bytes_per_token": entries * per_entry,
        "global_bytes_per_token_bf16": entries * (a.head_dim + a.index_head_dim) * 2,
        "swa_bytes_per_layer": swa_layer,
        "swa_rings": n_swa_rings,
        "swa_bytes_per_sequence": swa_layer * n_swa_rings,
        "encoder_swa_bytes_per_sequence": swa_layer * a.n_encoder_layers,
    }


def report(args: ModelArgs) -> dict[str, dict]:
    """Everything bench/accounting.py prints: params, active params, cache bytes."""
    return {
        "params": param_counts(args),
        "active_prefill": active_params(args, "prefill"),
        "active_decode": active_params(args, "decode"),
        "cache": cache_bytes(args),
    }
