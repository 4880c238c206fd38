"""Accounting: the released model's headline figures, family classification, the two count paths."""

import math

import pytest
import torch

from model.accounting import (
    FAMILIES,
    active_params,
    cache_bytes,
    classify,
    official_shapes,
    param_counts,
    param_counts_from_model,
)
from model.config import get_flavor


@pytest.fixture(scope="module")
def flash():
    return get_flavor("flash")


@pytest.fixture(scope="module")
def flash_counts(flash):
    return param_counts(flash)


def test_flash_routed_experts_and_engram_tables_are_exact(flash_counts):
    assert flash_counts["routed_experts"] == 543_581_798_400  # 40 x 384 x 3 x 5120 x 2304
    assert flash_counts["engram_table"] == 196_613_849_600  # (384006168 + 384016682) x 256


def test_flash_backbone_is_552b(flash_counts):
    # backbone = everything but Engram tables, DSpark and vision (the report's "552B")
    assert abs(flash_counts["backbone"] / 552e9 - 1) < 0.01
    assert flash_counts["backbone"] - flash_counts["routed_experts"] == pytest.approx(8.3e9, rel=0.01)
    assert flash_counts["total"] == sum(flash_counts[f] for f in FAMILIES)


def test_flash_per_layer_attention_is_127m(flash):
    shapes = official_shapes(flash)
    attn = sum(math.prod(s) for n, s in shapes.items() if n.startswith("layers.5.attn."))
    assert attn == pytest.approx(127e6, rel=0.005)  # the infra diagram's "127M per layer"
    assert shapes["layers.20.attn.compressor.wkv.weight"] == (512, 5120)
    assert "layers.20.attn.compressor.wgate.weight" not in shapes  # ratio 1: no gated pooling
    assert shapes["layers.2.attn.compressor.wgate.weight"] == (512, 5120)
    assert "layers.24.attn.indexer.wk.weight" not in shapes  # Reindex layers borrow layer 20's keys
    assert shapes["layers.14.engram.wkv.weight"] == (25600, 6144)
    assert shapes["mtp.0.main_proj.weight"] == (5120, 15360)
    assert shapes["mtp.2.confidence_head.proj.weight"] == (1, 5376)
    assert shapes["mtp.1.ffn.gate.weight"] == (128, 5120)
    assert "mtp.1.ffn.experts.128.w1.weight" not in shapes


def test_flash_active_params_near_8b_prefill_16b_decode(flash):
    prefill, decode = active_params(flash, "prefill"), active_params(flash, "decode")
    # documented band: the report rounds to 8B / 16B; our rule lands within +-5%
    assert 7.6e9 < prefill["total"] < 8.4e9
    assert 15.2e9 < decode["total"] < 16.8e9
    assert decode["routed_experts"] == 40 * 6 * 3 * 5120 * 2304
    assert prefill["routed_experts"] == 20 * 6 * 3 * 5120 * 2304
    assert "head" not in prefill and decode["head"] == 129280 * 5120
    # the decoder bank projection is the only decoder work in prefill: layer 20's compressor
    assert prefill["compressor"] == decode["compressor"] == (3 * 2 + 1) * 512 * 5120
    with pytest.raises(ValueError, match="phase"):
        active_params(flash, "train")


def test_flash_cache_bytes(flash):
    c = cache_bytes(flash)
    assert (c["main_kv_entry_bytes"], c["index_key_entry_bytes"]) == (288, 68)
    assert c["global_entries_per_token"] == 2.5
    assert c["global_bytes_per_token"] == 890
    assert c["swa_bytes_per_layer"] == 128 * 528


def test_classify():
    assert classify("layers.3.ffn.experts.17.w2.weight") == "routed_experts"
    assert classify("layers.3.ffn.shared_experts.w1.weight") == "shared_experts"
    assert classify("layers.3.attn.indexer.k_norm.weight") == "norms"
    assert classify("layers.3.attn.indexer.wk.weight") == "indexer"
    assert classify("layers.3.attn.compressor.wgate.weight") == "compressor"
    assert classify("layers.3.attn.attn_sink") == "attention"
    assert classify("layers.3.hc_ffn_base") == "mhc"
    assert classify("layers.1.engram.embed.weight") == "engram_table"
    assert classify("layers.1.engram.q_weight") == "engram"
    assert classify("mtp.2.markov_head.embed.weight") == "dspark"
    assert classify("image_newline") == "vision"
    with pytest.raises(ValueError, match="not an official"):
        classify("layers.0.mlp.gate_proj.weight")


class _Named(torch.nn.Module):
    """Holds meta parameters under arbitrary dotted official names."""

    def __init__(self, shapes):
        super().__init__()
        for name, shape in shapes.items():
            owner = self
            *path, leaf = name.split(".")
            for part in path:
                if not hasattr(owner, part):
                    owner.add_module(part, torch.nn.Module())
                owner = getattr(owner, part)
            owner.register_parameter(leaf, torch.nn.Parameter(torch.empty(shape, device="meta")))


def test_model_path_counts_match_shapes_and_skip_scales():
    args = get_flavor("debug")
    model = _Named(official_shapes(args))
    # a quantised checkpoint would carry block scales; they are not logical parameters
    model.head.register_parameter("scale", torch.nn.Parameter(torch.empty(16, 4, device="meta")))
    assert param_counts_from_model(model) == param_counts(args)


def _transformer():
    try:
        from model.transformer import Transformer
    except ImportError as exc:  # another engineer's module; the analytic path is tested above
        pytest.skip(f"model/transformer.py not importable yet: {exc}")
    return Transformer


BACKBONE_ONLY = {
    "engram_layer_ids": (),
    "engram_num_embeddings": (),
    "dspark_block_size": 0,
    "vision_n_layers": 0,
}
# flash widths and the full released schedule; 8 experts keep the meta build around a second
FLASH_FEW_EXPERTS = {"n_routed_experts": 8, "dspark_n_routed_experts": 8, "dspark_n_activated_experts": 2}
VARIANTS = {"debug": ("debug", {}), "tiny": ("tiny", {}), "flash8": ("flash", FLASH_FEW_EXPERTS)}


def _meta_transformer(args):
    transformer = _transformer()
    with torch.device("meta"):
        return transformer(args)


def _assert_matches_official_shapes(model, args):
    got = {n: tuple(p.shape) for n, p in model.named_parameters() if not n.endswith(".scale")}
    expected = official_shapes(args)
    assert sorted(set(got) - set(expected)) == [], "model tensors the accounting does not know"
    assert sorted(set(expected) - set(got)) == [], "official tensors the model lacks"
    assert {n: (s, expected[n]) for n, s in got.items() if expected[n] != s} == {}
    assert param_counts_from_model(model) == param_counts(args)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_transformer_backbone_matches_official_shapes(variant):
    name, overrides = VARIANTS[variant]
    args = get_flavor(name, **overrides, **BACKBONE_ONLY)
    _assert_matches_official_shapes(_meta_transformer(args), args)


def _assert_full_model_matches(args):
    model = _meta_transformer(args)
    families = {classify(n) for n, _ in model.named_parameters()}
    wanted = {
        "engram": bool(args.engram_layer_ids),
        "dspark": args.dspark_enabled,
        "vision": args.vision_n_layers > 0,
    }
    absent = [f for f, on in wanted.items() if on and f not in families]
    if absent:  # a feature built partially still fails below; one not wired at all is reported here
        pytest.skip(f"Transformer does not build {absent} yet; the analytic counts cover them")
    _assert_matches_official_shapes(model, args)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_transformer_with_engram_dspark_vision_matches_official_shapes(variant):
    name, overrides = VARIANTS[variant]
    _assert_full_model_matches(get_flavor(name, **overrides))


@pytest.mark.slow
def test_full_flash_transformer_counts_match_analytic():
    # ~47k expert Linear modules: tens of seconds to build even on the meta device
    _assert_full_model_matches(get_flavor("flash"))
