"""ModelArgs: the one config of the V4.1 architecture, its layer roles, named flavors and loaders.

Field names and defaults are the official `inference/model.py` ones (model_reference §1.4), so a
released `config.json` maps onto them key for key; flashpost adds only `qat`, `impl` and `numerics`. This file
holds choices and the arithmetic that derives layer roles from them; it builds no modules and
reads no weights (that is `model/transformer.py` and `model/checkpoint.py`).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, fields
from typing import Any, Literal

LayerRole = Literal["swa", "full", "reindex", "reuse"]
Flavor = Literal["debug", "tiny", "small", "flash"]

# Every Linear input and every QDQ'd cache vector is quantised in blocks of 32 along its last
# dim (FP8 act_quant, MXFP4); E4M3/16 main-KV blocks divide 32, so 32 is the one constraint.
QUANT_BLOCK = 32


@dataclass(kw_only=True)
class ModelArgs:
    """Official ModelArgs fields (model_reference §1.4 defaults) plus flashpost's `qat`, `impl`, `numerics`.

    Layer indices 0..n_layers-1 are the backbone; n_layers..n_layers+n_mtp_layers-1 are the DSpark
    stages `mtp.0..`, which is why `compress_ratios` has n_layers + n_mtp_layers entries.
    """

    max_batch_size: int = 4
    max_seq_len: int = 4096
    # Sampling temperature of the reference Transformer.forward; flashpost samplers take their own.
    temperature: float = 1.0
    dtype: Literal["fp8", "bf16"] = "fp8"
    expert_dtype: Literal["fp4", "fp8"] | None = "fp4"
    vocab_size: int = 129280
    dim: int = 1024
    moe_inter_dim: int = 1024
    n_layers: int = 5
    n_mtp_layers: int = 1
    n_heads: int = 16
    # MoE
    n_routed_experts: int = 8
    n_shared_experts: int = 1
    n_activated_experts: int = 2
    score_func: Literal["softmax", "sigmoid", "sqrtsoftplus"] = "sqrtsoftplus"
    gate_temp: float = 1.0
    norm_topk_prob: bool = True
    route_scale: float = 1.0
    swiglu_limit: float = 0.0
    # attention
    q_lora_rank: int = 256
    head_dim: int = 128
    rope_head_dim: int = 32
    norm_eps: float = 1e-20
    o_groups: int = 8
    o_lora_rank: int = 256
    window_size: int = 128
    compress_ratios: tuple[int, ...] = (0, 2, 2, 1, 1, 0)
    kv_source_layers: tuple[int, ...] = (1, 3)
    index_source_layers: tuple[int, ...] = (1, 3)
    compress_rope_theta: float = 40000.0
    # YaRN (original_seq_len 0 = off)
    original_seq_len: int = 0
    rope_theta: float = 10000.0
    rope_factor: float = 40
    beta_fast: int = 32
    beta_slow: int = 1
    # indexer and hierarchical candidates (candidate_source_layer -1 = off)
    index_n_heads: int = 16
    index_head_dim: int = 64
    index_topk: int = 64
    candidate_source_layer: int = -1
    candidate_topk_blocks: int = 0
    candidate_block_size: int = 0
    # mHC
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    # Engram (empty engram_layer_ids = off)
    engram_layer_ids: tuple[int, ...] = ()
    engram_num_embeddings: tuple[int, ...] = ()
    engram_max_ngram_size: int = 1
    engram_vocab_size: int = 0
    engram_n_heads: int = 0
    engram_head_dim: int = 0
    engram_pad_id: int = 2
    engram_compressed_vocab_size: int = 0
    # vision (vision_n_layers 0 = off)
    vision_n_layers: int = 0
    vision_dim: int = 1024
    vision_n_heads: int = 16
    vision_inter_dim: int = 2816
    vision_patch_size: int = 14
    vision_rope_theta: float = 10000.0
    vision_downsample_ratio: int = 3
    vision_max_n_token: int = 1024
    vision_min_pixels: int = 544 * 544
    vision_max_wh_ratio: float | None = None
    image_token_id: int = 129264
    # DSpark drafter (dspark_block_size 0 = off; n_routed/n_activated 0 = backbone values)
    dspark_block_size: int = 0
    dspark_noise_token_id: int = 0
    dspark_target_layer_ids: tuple[int, ...] = ()
    dspark_markov_rank: int = 256
    dspark_n_routed_experts: int = 0
    dspark_n_activated_experts: int = 0
    # flashpost: fake-quant of KV / indexer q,k in training (off only for ablations), kernel choice
    qat: bool = True
    impl: Literal["torch", "triton"] = "torch"
    # "flashpost": fp32 attention probabilities and indexer scores, deterministic newer-wins top-k
    # ties (DESIGN §2). "reference": the released inference code's arithmetic where it differs
    # (bf16 probabilities before P·V in blocks of 64, bf16 indexer scores, torch.topk picks, its
    # index-list layout), so log-probs match an engine serving that code (docs/reference_parity.md).
    numerics: Literal["flashpost", "reference"] = "flashpost"

    def __post_init__(self) -> None:
        for f in fields(self):  # JSON and YAML give lists; the config is hashable and immutable-ish
            value = getattr(self, f.name)
            if isinstance(value, list):
                setattr(self, f.name, tuple(value))
        _validate(self)

    # ---------------------------------------------------------------- layer roles
    @property
    def n_total_layers(self) -> int:
        return self.n_layers + self.n_mtp_layers

    def compress_ratio(self, layer_id: int) -> int:
        """Compression ratio of layer `layer_id` (backbone or DSpark stage); 0 = SWA only."""
        if not 0 <= layer_id < self.n_total_layers:
            raise IndexError(f"layer_id {layer_id} outside 0..{self.n_total_layers - 1}")
        return self.compress_ratios[layer_id]

    def is_kv_source(self, layer_id: int) -> bool:
        # As the reference: DSpark stages (layer_id >= n_layers) never own or share global KV.
        return layer_id < self.n_layers and layer_id in self.kv_source_layers

    def is_index_source(self, layer_id: int) -> bool:
        return layer_id < self.n_layers and layer_id in self.index_source_layers

    def is_candidate_source(self, layer_id: int) -> bool:
        return layer_id == self.candidate_source_layer >= 0

    def uses_candidates(self, layer_id: int) -> bool:
        """A Reindex layer after the candidate source searches only inside its candidate pool."""
        return (
            self.is_index_source(layer_id)
            and not self.is_kv_source(layer_id)
            and 0 <= self.candidate_source_layer < layer_id
        )

    def layer_role(self, layer_id: int) -> LayerRole:
        if self.compress_ratio(layer_id) == 0:
            return "swa"
        kv, index = self.is_kv_source(layer_id), self.is_index_source(layer_id)
        if kv and index:
            return "full"
        if index:
            return "reindex"
        return "reuse"

    def kv_source_for(self, layer_id: int) -> int:
        """The layer whose compressed KV (and index keys) `layer_id` attends: the latest kv source
        at or before it with the same ratio."""
        ratio = self.compress_ratio(layer_id)
        found = [s for s in self.kv_source_layers if s <= layer_id and self.compress_ratios[s] == ratio]
        if ratio == 0 or not found:
            raise ValueError(f"layer {layer_id} (ratio {ratio}) has no kv source")
        return found[-1]

    def index_source_for(self, layer_id: int) -> int:
        """The layer whose top-k `layer_id` uses: the latest index source at or before it."""
        found = [s for s in self.index_source_layers if s <= layer_id]
        if self.compress_ratio(layer_id) == 0 or not found:
            raise ValueError(f"layer {layer_id} has no index source")
        return found[-1]

    def role_table(self) -> list[dict[str, Any]]:
        """One row per layer (backbone then DSpark stages) for printing and tests."""
        rows = []
        for i in range(self.n_total_layers):
            role = self.layer_role(i)
            rows.append(
                {
                    "layer": i,
                    "ratio": self.compress_ratio(i),
                    "role": role,
                    "kv_source": None if role == "swa" else self.kv_source_for(i),
                    "index_source": None if role == "swa" else self.index_source_for(i),
                    "engram": i in self.engram_layer_ids,
                    "candidate_source": self.is_candidate_source(i),
                    "dspark_target": i in self.dspark_target_layer_ids,
                    "mtp": i >= self.n_layers,
                }
            )
        return rows

    # ---------------------------------------------------------------- derived sizes
    @property
    def n_encoder_layers(self) -> int:
        """Layers 0..n/2-1 form the causal encoder (report §2.2; the reference has no split)."""
        return self.n_layers // 2

    @property
    def dspark_enabled(self) -> bool:
        return self.dspark_block_size > 0

    @property
    def dspark_experts(self) -> tuple[int, int]:
        """(routed, activated) experts of a DSpark stage; 0 in the config means the backbone's."""
        return (
            self.dspark_n_routed_experts or self.n_routed_experts,
            self.dspark_n_activated_experts or self.n_activated_experts,
        )

    def to_dict(self) -> dict[str, Any]:
        """Flat `inference/config.json`-style dict (lists for tuples), loadable by from_config_json."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    @classmethod
    def from_config_json(cls, source: str | os.PathLike | dict[str, Any], **overrides: Any) -> ModelArgs:
        """Build from a flat `inference/config.json` or an HF config (`text_config`/`vision_config`).

        `overrides` win over the file (e.g. `max_seq_len`, which config.json does not carry).
        Unknown keys raise; known-irrelevant HF keys are ignored explicitly (see `HF_IGNORED`).
        """
        if isinstance(source, dict):
            raw = dict(source)
        else:
            with open(source) as fh:
                raw = json.load(fh)
        flat = _from_hf(raw) if _is_hf(raw) else raw
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(flat) - names)
        if unknown:
            raise ValueError(
                f"unknown config keys {unknown}; expected ModelArgs field names (flat inference/"
                f"config.json) or an HF config with text_config (see model.config.HF_TEXT_KEYS)"
            )
        return cls(**{**flat, **overrides})


# -------------------------------------------------------------------- validation
def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _validate(a: ModelArgs) -> None:
    n, total = a.n_layers, a.n_total_layers
    _require(n >= 1 and a.n_mtp_layers >= 0, f"n_layers={n} must be >= 1, n_mtp_layers >= 0")
    _require(
        len(a.compress_ratios) == total,
        f"compress_ratios has {len(a.compress_ratios)} entries but n_layers + n_mtp_layers = {total}; "
        f"give one ratio per backbone layer and per DSpark stage (or use derive_layer_schedule)",
    )
    _require(all(r >= 0 for r in a.compress_ratios), f"compress_ratios {a.compress_ratios} must be >= 0")
    _require(
        all(r == 0 for r in a.compress_ratios[n:]),
        f"compress_ratios of the DSpark stages (entries {n}..) must be 0, got {a.compress_ratios[n:]}",
    )
    for name in ("kv_source_layers", "index_source_layers"):
        layers = getattr(a, name)
        _require(list(layers) == sorted(set(layers)), f"{name}={layers} must be strictly increasing")
        bad = [i for i in layers if not 0 <= i < n or a.compress_ratios[i] == 0]
        _require(not bad, f"{name} {bad} must be backbone layers (< n_layers={n}) with compress ratio > 0")
    missing_index = sorted(set(a.kv_source_layers) - set(a.index_source_layers))
    _require(
        not missing_index,
        f"kv sources {missing_index} are not index sources; a kv source owns the index keys of its "
        f"cache (Full layer), so add them to index_source_layers",
    )
    for i in range(n):
        r = a.compress_ratios[i]
        if r == 0:
            continue
        kv = [s for s in a.kv_source_layers if s <= i and a.compress_ratios[s] == r]
        _require(
            bool(kv),
            f"layer {i} (ratio {r}) needs a kv source of ratio {r} at or before it in kv_source_layers",
        )
        idx = [s for s in a.index_source_layers if s <= i]
        _require(
            bool(idx) and a.compress_ratios[idx[-1]] == r,
            f"layer {i} (ratio {r}) reuses the top-k of the latest index source "
            f"{idx[-1] if idx else None}, which must exist and have ratio {r}",
        )
    c = a.candidate_source_layer
    if c >= 0:
        _require(
            c in a.kv_source_layers and c in a.index_source_layers,
            f"candidate_source_layer={c} must be a Full layer (in kv_source_layers and index_source_layers)",
        )
        _require(
            a.candidate_topk_blocks > 0 and a.candidate_block_size > 0,
            "candidate_source_layer is set, so candidate_topk_blocks and candidate_block_size must be > 0",
        )
    else:
        _require(c == -1, f"candidate_source_layer={c}: use -1 for off")
    # widths: QUANT_BLOCK covers FP8 Linear inputs, FP8 window KV, MXFP4 index q/k
    for name in ("dim", "moe_inter_dim", "q_lora_rank", "o_lora_rank", "head_dim", "index_head_dim"):
        v = getattr(a, name)
        _require(v > 0 and v % QUANT_BLOCK == 0, f"{name}={v} must be a positive multiple of {QUANT_BLOCK}")
    _require(
        a.rope_head_dim > 0
        and a.rope_head_dim % 2 == 0
        and a.rope_head_dim <= min(a.head_dim, a.index_head_dim),
        f"rope_head_dim={a.rope_head_dim} must be even and <= head_dim={a.head_dim} and "
        f"index_head_dim={a.index_head_dim} (RoPE rotates the last rope_head_dim dims of both)",
    )
    _require(a.n_heads % a.o_groups == 0, f"n_heads={a.n_heads} must be divisible by o_groups={a.o_groups}")
    _require(
        a.n_heads * a.head_dim // a.o_groups % QUANT_BLOCK == 0,
        f"n_heads*head_dim/o_groups = {a.n_heads * a.head_dim // a.o_groups} (wo_a input) must be a "
        f"multiple of {QUANT_BLOCK}",
    )
    _require(a.n_shared_experts == 1, f"n_shared_experts={a.n_shared_experts}: the reference asserts 1")
    _require(
        0 < a.n_activated_experts <= a.n_routed_experts,
        f"n_activated_experts={a.n_activated_experts} must be in 1..n_routed_experts={a.n_routed_experts}",
    )
    _require(a.window_size > 0 and a.index_topk > 0, "window_size and index_topk must be > 0")
    _require(a.hc_mult >= 1 and a.hc_sinkhorn_iters >= 1, "hc_mult and hc_sinkhorn_iters must be >= 1")
    _require(
        a.original_seq_len == 0 or a.rope_factor >= 1,
        f"rope_factor={a.rope_factor} must be >= 1 when YaRN is on (original_seq_len > 0)",
    )
    _require(a.dtype in ("fp8", "bf16"), f"dtype={a.dtype!r} must be 'fp8' or 'bf16'")
    _require(a.expert_dtype in ("fp4", "fp8", None), f"expert_dtype={a.expert_dtype!r}: 'fp4', 'fp8' or None")
    _require(a.impl in ("torch", "triton"), f"impl={a.impl!r} must be 'torch' or 'triton'")
    _require(
        a.numerics in ("flashpost", "reference"), f"numerics={a.numerics!r} must be 'flashpost' or 'reference'"
    )
    _validate_engram(a)
    _validate_dspark(a)


def _validate_engram(a: ModelArgs) -> None:
    if not a.engram_layer_ids:
        return
    ids = a.engram_layer_ids
    _require(
        list(ids) == sorted(set(ids)) and all(0 <= i < a.n_layers for i in ids),
        f"engram_layer_ids={ids} must be increasing backbone layers (< n_layers={a.n_layers})",
    )
    _require(
        len(a.engram_num_embeddings) == len(ids),
        f"engram_num_embeddings has {len(a.engram_num_embeddings)} entries for {len(ids)} Engram layers; "
        f"use engram_table_sizes(...) to compute them",
    )
    _require(a.engram_max_ngram_size >= 2, f"engram_max_ngram_size={a.engram_max_ngram_size} must be >= 2")
    _require(
        a.engram_n_heads > 0 and a.engram_head_dim > 0 and a.engram_head_dim % QUANT_BLOCK == 0,
        f"engram_n_heads={a.engram_n_heads} must be > 0 and engram_head_dim={a.engram_head_dim} a "
        f"positive multiple of {QUANT_BLOCK}",
    )
    _require(
        a.engram_vocab_size > 1 and a.engram_compressed_vocab_size > 0,
        "engram_vocab_size and engram_compressed_vocab_size must be > 0 when Engram is on",
    )


def _validate_dspark(a: ModelArgs) -> None:
    if not a.dspark_enabled:
        return
    t = a.dspark_target_layer_ids
    _require(a.n_mtp_layers >= 1, "dspark_block_size > 0 needs n_mtp_layers >= 1 (the DSpark stages)")
    _require(
        len(t) >= 1 and list(t) == sorted(set(t)) and all(0 <= i < a.n_layers for i in t),
        f"dspark_target_layer_ids={t} must be non-empty increasing backbone layers",
    )
    routed, active = a.dspark_experts
    _require(0 < active <= routed, f"DSpark experts: activated {active} must be in 1..routed {routed}")
    _require(
        0 <= a.dspark_noise_token_id < a.vocab_size,
        f"dspark_noise_token_id={a.dspark_noise_token_id} must be < vocab_size={a.vocab_size}",
    )


# -------------------------------------------------------------------- derived schedules
def _round(x: float) -> int:
    return math.floor(x + 0.5)  # half-up: Python's round() is banker's and surprises at .5


def derive_layer_schedule(n_layers: int, n_mtp_layers: int) -> dict[str, Any]:
    """Scale the released 40-layer schedule (model_reference §2.3) to `n_layers`.

    Rule (exact for n_layers == 40, tested):
    * the first max(1, round(0.05 n)) layers are SWA only (ratio 0);
    * the rest of the encoder (layers < n // 2) has ratio 2, with a Full layer (kv + index source)
      at its first layer and then every max(2, round(6 n / 40)) layers;
    * the decoder (layers >= n // 2) has ratio 1; its first layer is Full and the candidate source;
      Reindex layers (index source only) every max(2, round(4 n / 40)) layers after it; the rest Reuse;
    * Engram before layers round(n / 40) and round(14 n / 40) (released 1 and 14);
    * DSpark targets: the last min(3, max(2, n // 8)) backbone layers, none if n_mtp_layers == 0;
    * DSpark stages (n_mtp_layers) have ratio 0.
    Returns ModelArgs keyword arguments; explicit values given by a caller override them.
    """
    if n_layers < 4:
        raise ValueError(f"derive_layer_schedule needs n_layers >= 4 (SWA, encoder, decoder), got {n_layers}")
    enc = n_layers // 2
    n_swa = max(1, _round(0.05 * n_layers))
    full_every = max(2, _round(6 * n_layers / 40))
    reindex_every = max(2, _round(4 * n_layers / 40))
    ratios = [0] * n_swa + [2] * (enc - n_swa) + [1] * (n_layers - enc) + [0] * n_mtp_layers
    enc_full = list(range(n_swa, enc, full_every))
    reindex = list(range(enc + reindex_every, n_layers, reindex_every))
    n_targets = min(3, max(2, n_layers // 8)) if n_mtp_layers else 0
    return {
        "n_layers": n_layers,
        "n_mtp_layers": n_mtp_layers,
        "compress_ratios": tuple(ratios),
        "kv_source_layers": (*enc_full, enc),
        "index_source_layers": (*enc_full, enc, *reindex),
        "candidate_source_layer": enc,
        "engram_layer_ids": tuple(sorted({_round(n_layers / 40), _round(14 * n_layers / 40)})),
        "dspark_target_layer_ids": tuple(range(n_layers - n_targets, n_layers)),
    }


def _is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin for n < 3.3e24 (these bases suffice); tables are ~1e7 rows."""
    if n < 2:
        return False
    bases = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)
    for p in bases:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d, s = d // 2, s + 1
    for b in bases:
        x = pow(b, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def engram_primes(
    engram_vocab_size: int, n_heads: int, max_ngram_size: int, n_engram_layers: int
) -> list[list[int]]:
    """Per Engram layer, the (max_ngram_size-1) * n_heads table primes in order (n-gram order, head).

    The reference hands out successive primes above engram_vocab_size - 1, layer by layer
    (model_reference §3.12); table rows per layer are their sum.
    """
    per_layer = (max_ngram_size - 1) * n_heads
    primes, p = [], engram_vocab_size - 1
    while len(primes) < per_layer * n_engram_layers:
        p += 1
        if _is_prime(p):
            primes.append(p)
    return [primes[k * per_layer : (k + 1) * per_layer] for k in range(n_engram_layers)]


def engram_table_sizes(
    engram_vocab_size: int, n_heads: int, max_ngram_size: int, n_engram_layers: int
) -> tuple[int, ...]:
    """`engram_num_embeddings`: the table rows of each Engram layer (sum of its primes)."""
    return tuple(sum(p) for p in engram_primes(engram_vocab_size, n_heads, max_ngram_size, n_engram_layers))


# -------------------------------------------------------------------- flavors
def _engram_kwargs(
    vocab_size: int, n_heads: int, head_dim: int, max_ngram: int, n_layers_engram: int
) -> dict:
    return {
        "engram_max_ngram_size": max_ngram,
        "engram_vocab_size": vocab_size,
        "engram_n_heads": n_heads,
        "engram_head_dim": head_dim,
        "engram_num_embeddings": engram_table_sizes(vocab_size, n_heads, max_ngram, n_layers_engram),
    }


def debug_args() -> ModelArgs:
    """CPU unit-test size: 8 layers with every role (SWA 0; Full r2 1,3; Reuse r2 2; Full r1 +
    candidates 4; Reuse r1 5,7; Reindex r1 6), Engram on 0 and 3, DSpark on 6,7, YaRN active."""
    sched = derive_layer_schedule(8, 1)
    return ModelArgs(
        **sched,
        max_batch_size=4, max_seq_len=128, dtype="bf16", expert_dtype=None,
        vocab_size=512, dim=128, moe_inter_dim=64, n_heads=4,
        n_routed_experts=4, n_activated_experts=2, route_scale=1.5, swiglu_limit=10.0,
        q_lora_rank=64, head_dim=64, rope_head_dim=16, o_groups=2, o_lora_rank=64, window_size=16,
        compress_rope_theta=160000.0, original_seq_len=32, rope_factor=4,
        index_n_heads=4, index_head_dim=32, index_topk=8, candidate_topk_blocks=3, candidate_block_size=4,
        **_engram_kwargs(100, 2, 32, 3, len(sched["engram_layer_ids"])),
        engram_compressed_vocab_size=512, image_token_id=510,
        dspark_block_size=2, dspark_noise_token_id=511, dspark_markov_rank=32,
        dspark_n_routed_experts=4, dspark_n_activated_experts=1,
    )  # fmt: skip


def tiny_args() -> ModelArgs:
    """The CPU demo model (~5M parameters, byte-level BPE vocab 4096): 8 layers, dim 128. max_seq_len
    2048: an agent episode's first prompt alone (system turn with the tool schemas, then the task) is
    ~800-1100 tokens, and a rollout keeps room for its replies and observations."""
    sched = derive_layer_schedule(8, 1)
    return ModelArgs(
        **sched,
        max_batch_size=8, max_seq_len=2048, dtype="bf16", expert_dtype=None,
        vocab_size=4096, dim=128, moe_inter_dim=128, n_heads=4,
        n_routed_experts=8, n_activated_experts=2, route_scale=1.5, swiglu_limit=10.0,
        q_lora_rank=64, head_dim=64, rope_head_dim=16, o_groups=2, o_lora_rank=64, window_size=64,
        compress_rope_theta=160000.0, original_seq_len=256, rope_factor=4,
        index_n_heads=4, index_head_dim=32, index_topk=32, candidate_topk_blocks=8, candidate_block_size=8,
        **_engram_kwargs(2000, 2, 32, 3, len(sched["engram_layer_ids"])),
        # ids of the committed default tokenizer (model/assets/tokenizer.json): its compressed
        # Engram vocabulary has 2742 entries, <|image|> is 15 and <|noise|> is 18.
        engram_compressed_vocab_size=2742, image_token_id=15,
        dspark_block_size=3, dspark_noise_token_id=18, dspark_markov_rank=32,
        dspark_n_routed_experts=4, dspark_n_activated_experts=1,
    )  # fmt: skip


def default_tokenizer_fit() -> dict[str, int]:
    """The fields that tie a model to the shipped default tokenizer (tiny's values): replacing them
    fits a flavor sized for the released tokenizer (debug, small, flash) to the default one."""
    t = tiny_args()
    return {k: getattr(t, k) for k in ("vocab_size", "engram_compressed_vocab_size", "image_token_id",
                                       "dspark_noise_token_id")}  # fmt: skip


def small_args() -> ModelArgs:
    """One-H200 size (~1.4B total): 20 layers (derived schedule), dim 1024, 32 experts top-4,
    the released tokenizer's vocab so it can distil from and be compared with real checkpoints."""
    sched = derive_layer_schedule(20, 3)
    return ModelArgs(
        **sched,
        max_batch_size=8, max_seq_len=16384, dtype="bf16", expert_dtype=None,
        vocab_size=129280, dim=1024, moe_inter_dim=512, n_heads=16,
        n_routed_experts=32, n_activated_experts=4, route_scale=1.5, swiglu_limit=10.0,
        q_lora_rank=384, head_dim=128, rope_head_dim=32, o_groups=4, o_lora_rank=256, window_size=128,
        compress_rope_theta=160000.0, original_seq_len=8192, rope_factor=4,
        index_n_heads=8, index_head_dim=64, index_topk=128, candidate_topk_blocks=256, candidate_block_size=8,
        **_engram_kwargs(100_000, 4, 64, 3, len(sched["engram_layer_ids"])),
        engram_compressed_vocab_size=99092,
        dspark_block_size=5, dspark_noise_token_id=128799, dspark_markov_rank=128,
        dspark_n_routed_experts=16, dspark_n_activated_experts=2,
    )  # fmt: skip


def flash_args() -> ModelArgs:
    """The released `inference/config.json` (model_reference §2.1), dataclass defaults elsewhere."""
    return ModelArgs(
        vocab_size=129280, dim=5120, moe_inter_dim=2304, n_layers=40, n_mtp_layers=3,
        n_heads=64, head_dim=512, rope_head_dim=64, q_lora_rank=1280, o_groups=8, o_lora_rank=1024,
        norm_eps=1e-20, window_size=128,
        n_routed_experts=384, n_shared_experts=1, n_activated_experts=6,
        score_func="sqrtsoftplus", route_scale=1.5, swiglu_limit=10.0,
        compress_ratios=(0, 0) + (2,) * 18 + (1,) * 20 + (0, 0, 0),
        kv_source_layers=(2, 8, 14, 20), index_source_layers=(2, 8, 14, 20, 24, 28, 32, 36),
        candidate_source_layer=20, candidate_topk_blocks=2048, candidate_block_size=8,
        index_n_heads=32, index_head_dim=128, index_topk=512,
        rope_theta=10000.0, compress_rope_theta=160000.0,
        original_seq_len=65536, rope_factor=16, beta_fast=32, beta_slow=1,
        hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6,
        engram_layer_ids=(1, 14), engram_num_embeddings=(384006168, 384016682),
        engram_max_ngram_size=4, engram_vocab_size=16000000, engram_n_heads=8, engram_head_dim=256,
        engram_pad_id=2, engram_compressed_vocab_size=99092,
        dspark_block_size=5, dspark_noise_token_id=128799, dspark_target_layer_ids=(37, 38, 39),
        dspark_markov_rank=256, dspark_n_routed_experts=128, dspark_n_activated_experts=3,
        dtype="fp8", expert_dtype="fp4",
        vision_n_layers=32, vision_dim=1024, vision_n_heads=16, vision_inter_dim=2816,
        vision_patch_size=14, vision_downsample_ratio=3, vision_max_n_token=1024,
        vision_min_pixels=295936, vision_max_wh_ratio=None, vision_rope_theta=10000.0,
        image_token_id=129264,
    )  # fmt: skip


FLAVORS = {"debug": debug_args, "tiny": tiny_args, "small": small_args, "flash": flash_args}


def get_flavor(name: Flavor, **overrides: Any) -> ModelArgs:
    """A named flavor; `overrides` replace fields (validated again).

    Overriding n_layers or n_mtp_layers re-derives the layer schedule (derive_layer_schedule)
    and the Engram table sizes, except for the schedule fields given explicitly.
    """
    if name not in FLAVORS:
        raise ValueError(f"unknown flavor {name!r}; choose one of {sorted(FLAVORS)}")
    args = FLAVORS[name]()
    if not overrides:
        return args
    if {"n_layers", "n_mtp_layers"} & overrides.keys():
        n = overrides.get("n_layers", args.n_layers)
        sched = derive_layer_schedule(n, overrides.get("n_mtp_layers", args.n_mtp_layers))
        if not args.engram_layer_ids:
            sched["engram_layer_ids"] = ()
        if args.candidate_source_layer < 0:
            sched["candidate_source_layer"] = -1
        engram = {**asdict(args), **sched, **overrides}
        sched["engram_num_embeddings"] = engram_table_sizes(
            engram["engram_vocab_size"],
            engram["engram_n_heads"],
            engram["engram_max_ngram_size"],
            len(engram["engram_layer_ids"]),
        )
        overrides = {**sched, **overrides}
    return ModelArgs(**{**asdict(args), **overrides})


# -------------------------------------------------------------------- HF config names
# HF text_config key -> ModelArgs field (model_reference §2.2); identical names pass through.
HF_TEXT_KEYS = {
    "hidden_size": "dim",
    "moe_intermediate_size": "moe_inter_dim",
    "num_hidden_layers": "n_layers",
    "num_attention_heads": "n_heads",
    "qk_rope_head_dim": "rope_head_dim",
    "rms_norm_eps": "norm_eps",
    "sliding_window": "window_size",
    "num_experts_per_tok": "n_activated_experts",
    "scoring_func": "score_func",
    "routed_scaling_factor": "route_scale",
    "kv_source_layer_ids": "kv_source_layers",
    "index_source_layer_ids": "index_source_layers",
    "candidate_source_layer_id": "candidate_source_layer",
    "engram_pad_token_id": "engram_pad_id",
    "num_nextn_predict_layers": "n_mtp_layers",
    "dspark_num_experts_per_tok": "dspark_n_activated_experts",
}
HF_VISION_KEYS = {
    "num_hidden_layers": "vision_n_layers",
    "hidden_size": "vision_dim",
    "num_attention_heads": "vision_n_heads",
    "intermediate_size": "vision_inter_dim",
    "patch_size": "vision_patch_size",
    "rope_theta": "vision_rope_theta",
    "downsample_ratio": "vision_downsample_ratio",
    "max_image_tokens": "vision_max_n_token",
    "min_pixels": "vision_min_pixels",
    "max_wh_ratio": "vision_max_wh_ratio",
}
# HF keys with no ModelArgs counterpart. max_position_embeddings is not max_seq_len: the
# reference keeps the dataclass default 4096 when loading config.json (§2.1).
HF_IGNORED = {
    "architectures", "model_type", "torch_dtype", "dtype", "transformers_version",
    "bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings", "initializer_range",
    "use_cache", "attention_dropout", "auto_map",
}  # fmt: skip
# HF keys that must hold the value V4.1 hard-codes; anything else is a different architecture.
HF_FIXED = {
    "num_key_value_heads": 1,
    "topk_method": "noaux_tc",
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "attention_bias": False,
}


def _is_hf(raw: dict[str, Any]) -> bool:
    return "text_config" in raw or "hidden_size" in raw


def _rename(section: dict[str, Any], names: dict[str, str], where: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in section.items():
        if key in HF_FIXED:
            if value != HF_FIXED[key]:
                raise ValueError(f"{where}.{key}={value!r} is not supported; V4.1 has {HF_FIXED[key]!r}")
        elif key == "rope_scaling":
            out.update(_rope_scaling(value, where))
        elif key not in HF_IGNORED:
            out[names.get(key, key)] = value
    return out


def _rope_scaling(rs: dict[str, Any] | None, where: str) -> dict[str, Any]:
    if rs is None:
        return {"original_seq_len": 0}
    if rs.get("rope_type", rs.get("type")) != "yarn":
        raise ValueError(f"{where}.rope_scaling={rs}: only rope_type 'yarn' exists in V4.1")
    known = {"rope_type", "type", "factor", "beta_fast", "beta_slow", "original_max_position_embeddings"}
    if set(rs) - known:
        raise ValueError(f"{where}.rope_scaling has unknown keys {sorted(set(rs) - known)}")
    out = {"rope_factor": rs["factor"], "original_seq_len": rs["original_max_position_embeddings"]}
    out.update({k: rs[k] for k in ("beta_fast", "beta_slow") if k in rs})
    return out


def _from_hf(raw: dict[str, Any]) -> dict[str, Any]:
    raw = dict(raw)
    text = raw.pop("text_config", None)
    vision = raw.pop("vision_config", None)
    quant = raw.pop("quantization_config", None)
    flat: dict[str, Any] = {}
    if text is None:  # a text-only HF config carries the text keys at top level
        text, raw = raw, {}
    flat.update(_rename(text, HF_TEXT_KEYS, "text_config"))
    if vision is not None:
        flat.update(_rename(vision, HF_VISION_KEYS, "vision_config"))
    flat.update(_rename(raw, {}, "config"))
    # Weight formats come from quantization_config: present = fp8 (experts per expert_dtype).
    if quant is None:
        flat.setdefault("dtype", "bf16")
        flat.setdefault("expert_dtype", None)
    else:
        if quant.get("quant_method") != "fp8":
            raise ValueError(f"quantization_config.quant_method={quant.get('quant_method')!r}: only 'fp8'")
        flat["dtype"] = "fp8"
        flat["expert_dtype"] = quant.get("expert_dtype", "fp8")
    return flat


__all__ = [
    "FLAVORS", "HF_IGNORED", "HF_TEXT_KEYS", "HF_VISION_KEYS", "LayerRole", "ModelArgs", "QUANT_BLOCK",
    "derive_layer_schedule", "engram_primes", "engram_table_sizes", "get_flavor",
]  # fmt: skip
