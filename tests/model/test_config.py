"""ModelArgs: official defaults, the released layer-role table, derivation, flavors, JSON/HF loading."""

import json
from dataclasses import fields
from pathlib import Path

import pytest

from model.config import (
    FLAVORS,
    ModelArgs,
    derive_layer_schedule,
    engram_primes,
    engram_table_sizes,
    get_flavor,
)

DATA = Path(__file__).parent / "data"


def test_reference_defaults():
    a = ModelArgs()
    assert (a.max_batch_size, a.max_seq_len, a.vocab_size, a.dim, a.n_layers, a.n_mtp_layers) == (
        4, 4096, 129280, 1024, 5, 1,
    )  # fmt: skip
    assert a.compress_ratios == (0, 2, 2, 1, 1, 0)
    assert a.kv_source_layers == a.index_source_layers == (1, 3)
    assert (a.score_func, a.norm_eps, a.rope_factor) == ("sqrtsoftplus", 1e-20, 40)
    assert (a.compress_rope_theta, a.rope_theta, a.original_seq_len) == (40000.0, 10000.0, 0)
    assert (a.candidate_source_layer, a.engram_layer_ids, a.dspark_block_size) == (-1, (), 0)
    assert (a.vision_min_pixels, a.image_token_id, a.dspark_markov_rank) == (295936, 129264, 256)
    assert (a.qat, a.impl, a.dtype, a.expert_dtype) == (True, "torch", "fp8", "fp4")
    # the reference's own tiny model: layers 1..4 are Full r2, Reuse r2, Full r1, Reuse r1
    assert [a.layer_role(i) for i in range(6)] == ["swa", "full", "reuse", "full", "reuse", "swa"]


# model_reference §2.3, row by row
FLASH_ROLES = (
    {0: "swa", 1: "swa"}
    | {i: "full" for i in (2, 8, 14, 20)}
    | {i: "reuse" for i in [*range(3, 8), *range(9, 14), *range(15, 20), 21, 22, 23]}
    | {i: "reindex" for i in (24, 28, 32, 36)}
    | {i: "reuse" for i in [*range(25, 28), *range(29, 32), *range(33, 36), *range(37, 40)]}
    | {40: "swa", 41: "swa", 42: "swa"}
)


def _expected_sources(i: int) -> tuple[int | None, int | None]:
    if i < 2 or i >= 40:
        return None, None
    if i < 20:
        src = 2 if i < 8 else 8 if i < 14 else 14
        return src, src
    return 20, max([20, *[s for s in (24, 28, 32, 36) if s <= i]])


def test_flash_role_table_matches_reference_section_2_3():
    rows = get_flavor("flash").role_table()
    assert len(rows) == 43 and sorted(FLASH_ROLES) == list(range(43))
    for row in rows:
        i = row["layer"]
        ratio = 0 if i < 2 or i >= 40 else 2 if i < 20 else 1
        kv, idx = _expected_sources(i)
        assert row == {
            "layer": i,
            "ratio": ratio,
            "role": FLASH_ROLES[i],
            "kv_source": kv,
            "index_source": idx,
            "engram": i in (1, 14),
            "candidate_source": i == 20,
            "dspark_target": i in (37, 38, 39),
            "mtp": i >= 40,
        }, f"layer {i}"


def test_flash_layer_helpers():
    a = get_flavor("flash")
    assert a.is_kv_source(20) and a.is_index_source(24) and not a.is_kv_source(24)
    assert a.uses_candidates(28) and not a.uses_candidates(20) and not a.uses_candidates(21)
    assert not a.is_kv_source(40) and a.n_encoder_layers == 20 and a.dspark_experts == (128, 3)
    with pytest.raises(ValueError, match="no kv source"):
        a.kv_source_for(1)
    with pytest.raises(IndexError):
        a.compress_ratio(43)


def test_derivation_reproduces_released_schedule_exactly():
    flash = get_flavor("flash")
    for key, value in derive_layer_schedule(40, 3).items():
        assert getattr(flash, key) == value, key


@pytest.mark.parametrize("n_layers", [4, 6, 8, 12, 20, 24, 32, 61])
def test_derived_schedules_are_valid_and_keep_the_structure(n_layers):
    sched = derive_layer_schedule(n_layers, 2)
    n_engram = len(sched["engram_layer_ids"])
    a = ModelArgs(  # validation runs in __post_init__
        **sched,
        candidate_topk_blocks=4,
        candidate_block_size=4,
        engram_num_embeddings=engram_table_sizes(100, 2, 3, n_engram),
        engram_max_ngram_size=3,
        engram_vocab_size=100,
        engram_n_heads=2,
        engram_head_dim=32,
        engram_compressed_vocab_size=100,
    )
    roles = [a.layer_role(i) for i in range(n_layers)]
    enc = n_layers // 2
    assert roles[0] == "swa" and "swa" not in roles[enc:]
    assert all(a.compress_ratio(i) == 2 for i in range(enc) if roles[i] != "swa")
    assert all(a.compress_ratio(i) == 1 for i in range(enc, n_layers))
    assert roles[enc] == "full" and a.candidate_source_layer == enc
    assert "full" not in roles[enc + 1 :]
    assert len(a.dspark_target_layer_ids) >= 1 and a.dspark_target_layer_ids[-1] == n_layers - 1
    assert a.compress_ratios[n_layers:] == (0, 0)


def test_debug_covers_every_role_and_feature():
    a = get_flavor("debug")
    kinds = {(a.layer_role(i), a.compress_ratio(i)) for i in range(a.n_layers)}
    assert kinds >= {("swa", 0), ("full", 2), ("reuse", 2), ("full", 1), ("reuse", 1), ("reindex", 1)}
    assert a.compress_ratio(a.candidate_source_layer) == 1 and any(a.uses_candidates(i) for i in range(8))
    assert a.engram_layer_ids and a.dspark_enabled and len(a.dspark_target_layer_ids) >= 2
    assert 0 < a.original_seq_len < a.max_seq_len  # YaRN ramp is exercised


@pytest.mark.parametrize("name", sorted(FLAVORS))
def test_flavors_build_and_round_trip_through_json(name, tmp_path):
    a = get_flavor(name)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(a.to_dict()))
    assert ModelArgs.from_config_json(path) == a


def test_flavor_overrides_and_unknown_name():
    assert get_flavor("debug", qat=False).qat is False
    deeper = get_flavor("debug", n_layers=12)  # the schedule follows the new depth
    assert deeper.compress_ratios == derive_layer_schedule(12, 1)["compress_ratios"]
    assert len(deeper.engram_num_embeddings) == len(deeper.engram_layer_ids)
    explicit = get_flavor("debug", n_layers=8, index_source_layers=(1, 3, 4))  # no Reindex layer
    assert explicit.index_source_layers == (1, 3, 4) and explicit.kv_source_layers == (1, 3, 4)
    assert "reindex" not in [explicit.layer_role(i) for i in range(8)]
    with pytest.raises(ValueError, match="unknown flavor"):
        get_flavor("huge")  # type: ignore[arg-type]


def test_released_flat_config_loads_to_flash():
    assert ModelArgs.from_config_json(DATA / "flash_config.json") == get_flavor("flash")
    a = ModelArgs.from_config_json(DATA / "flash_config.json", max_seq_len=65536)
    assert a.max_seq_len == 65536 and a.max_batch_size == 4


def test_hf_config_loads_to_flash():
    a = ModelArgs.from_config_json(DATA / "flash_hf_config.json")
    assert a == get_flavor("flash")


def test_hf_config_without_quantization_is_bf16_and_rejects_other_architectures():
    raw = json.loads((DATA / "flash_hf_config.json").read_text())
    del raw["quantization_config"]
    a = ModelArgs.from_config_json(raw)
    assert (a.dtype, a.expert_dtype) == ("bf16", None)
    raw["text_config"]["num_key_value_heads"] = 8
    with pytest.raises(ValueError, match="num_key_value_heads"):
        ModelArgs.from_config_json(raw)


def test_unknown_keys_are_listed():
    raw = json.loads((DATA / "flash_config.json").read_text())
    raw["kv_lora_rank"] = 512
    raw["bogus"] = 1
    with pytest.raises(ValueError, match=r"\['bogus', 'kv_lora_rank'\]"):
        ModelArgs.from_config_json(raw)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"compress_ratios": (0, 2, 2, 1, 1)}, "compress_ratios has 5 entries"),
        ({"kv_source_layers": (0, 3), "index_source_layers": (0, 3)}, "compress ratio > 0"),
        ({"kv_source_layers": (1,), "index_source_layers": (1, 3)}, "needs a kv source of ratio 1"),
        ({"index_source_layers": (1,)}, "are not index sources"),
        ({"head_dim": 80}, "head_dim=80"),
        ({"rope_head_dim": 33}, "rope_head_dim=33"),
        ({"o_groups": 3}, "divisible by o_groups"),
        ({"dim": 1000}, "dim=1000"),
        ({"candidate_source_layer": 3}, "candidate_topk_blocks"),
        ({"candidate_source_layer": 2}, "must be a Full layer"),
        ({"engram_layer_ids": (1,)}, "engram_num_embeddings"),
        ({"dspark_block_size": 5}, "dspark_target_layer_ids"),
        ({"compress_ratios": (0, 2, 2, 1, 1, 1)}, "DSpark stages"),
    ],
)
def test_validation_names_the_field(change, message):
    with pytest.raises(ValueError, match=message):
        ModelArgs(**change)


def test_every_field_is_json_serialisable_and_official_names_present():
    names = {f.name for f in fields(ModelArgs)}
    flat = json.loads((DATA / "flash_config.json").read_text())
    assert set(flat) <= names
    json.dumps(get_flavor("flash").to_dict())


def test_engram_primes_reproduce_released_table_sizes():
    # model_reference §3.12: successive primes above 15999999, 24 per layer
    primes = engram_primes(16_000_000, 8, 4, 2)
    assert primes[0][:3] == [16000057, 16000079, 16000081]
    assert engram_table_sizes(16_000_000, 8, 4, 2) == (384006168, 384016682)
