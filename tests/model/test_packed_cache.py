"""Packed cache format: unpack(pack(x)) is bit-identical to the training fake quant (edge values
included), the byte layout and entry sizes are the report's (890 B/token for flash), and an engine
session's cache size in packed form follows the formula."""

import pytest
import torch

from model.accounting import cache_bytes as accounting_cache_bytes
from model.config import get_flavor
from model.engine import InferenceEngine
from model.packed_cache import (
    bytes_per_token,
    index_key_entry_bytes,
    main_kv_entry_bytes,
    pack_index_k,
    pack_main_kv,
    pack_window_kv,
    unpack_index_k,
    unpack_main_kv,
    unpack_window_kv,
    window_entry_bytes,
)
from model.quant import E2M1_GRID, fp4_e4m3_fake_quant, fp8_fake_quant, mxfp4_fake_quant
from model.tokenizer import Tokenizer
from model.transformer import Transformer

torch.set_num_threads(1)

FORMATS = {
    "main_kv": (pack_main_kv, unpack_main_kv, fp4_e4m3_fake_quant),
    "index_k": (pack_index_k, unpack_index_k, mxfp4_fake_quant),
    "window_kv": (pack_window_kv, unpack_window_kv, fp8_fake_quant),
}


def _edge_rows(width: int) -> torch.Tensor:
    """Rows of `width` values exercising every rounding corner of the three formats."""
    g = torch.Generator().manual_seed(0)
    grid = torch.tensor(E2M1_GRID)
    mids = (grid[1:] + grid[:-1]) / 2  # exact E2M1 ties when the block scale is 1 (amax = 6)
    ties = torch.cat([torch.tensor([6.0]), mids, -mids, torch.tensor([0.0, -0.0])])
    rows = [
        ties.repeat(width // len(ties) + 1)[:width],
        torch.zeros(width),
        torch.full((width,), -0.0),
        torch.randn(width, generator=g) * 1e-30,  # below every amax floor
        torch.randn(width, generator=g) * 1e-42,  # fp32 subnormals
        torch.randn(width, generator=g) * 1e4,  # E4M3 scale saturates at 448 for the main KV
        torch.randn(width, generator=g) * 3e36,
        torch.randn(width, generator=g).exp2() * torch.randn(width, generator=g).sign(),  # powers of 2
        torch.randn(width, generator=g) * torch.logspace(-6, 6, width),  # wide range in one row
    ]
    one_big = torch.randn(width, generator=g) * 1e-3
    one_big[::16] = 100.0  # one outlier per block: the rest flush to 0 or the smallest code
    rows.append(one_big)
    return torch.stack(rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_unpack_of_pack_is_bit_identical_to_fake_quant(fmt, dtype):
    pack, unpack, fake_quant = FORMATS[fmt]
    width = 128
    g = torch.Generator().manual_seed(1)
    x = torch.cat([_edge_rows(width), torch.randn(64, width, generator=g) * 2.0]).to(dtype)
    x = x.view(2, -1, width)  # leading dims are kept
    packed = pack(x)
    assert packed.dtype == torch.uint8 and packed.shape[:-1] == x.shape[:-1]
    got, want = unpack(packed, dtype), fake_quant(x)
    assert got.dtype == want.dtype == dtype
    int_view = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(got.view(int_view), want.view(int_view)), f"{fmt}: not bit-identical"
    # the fake quant is idempotent, so a cache that holds fake-quantised values packs losslessly
    again = unpack(pack(want), dtype)
    assert torch.equal(again.view(int_view), want.view(int_view)), f"{fmt}: repacking changed values"


def test_byte_layout_low_nibble_is_the_even_element():
    x = torch.zeros(32)
    x[0], x[1], x[2], x[3] = 0.5, -6.0, 6.0, -0.5  # amax 6 -> scale 1 in both FP4 formats
    main = pack_main_kv(x)
    # codes: 0.5 -> 1, -6 -> 8|7 = 15, 6 -> 7, -0.5 -> 8|1 = 9
    assert main[0].item() == 0xF1 and main[1].item() == 0x97 and main[2:16].eq(0).all()
    # E4M3 1.0 = 0x38; the second block (all zeros) has the floor scale 2^-9, the smallest subnormal
    assert main[16].item() == 0x38 and main[17].item() == 0x01
    index = pack_index_k(x)
    assert index[0].item() == 0xF1 and index[16].item() == 127  # UE8M0 of 2^0
    window = pack_window_kv(x)
    # FP8: amax 6 -> scale 2^ceil(log2(6/448)) = 2^-6; 0.5/2^-6 = 32 -> e4m3 0x60
    assert window[0].item() == 0x60 and window[32].item() == 127 - 6


def test_entry_sizes_and_bytes_per_token():
    flash = get_flavor("flash")
    assert main_kv_entry_bytes(flash.head_dim) == 288
    assert index_key_entry_bytes(flash.index_head_dim) == 68
    assert window_entry_bytes(flash.head_dim) == 528
    assert bytes_per_token(flash) == 890
    for name in ("debug", "tiny", "small", "flash"):
        a = get_flavor(name)
        acc = accounting_cache_bytes(a)
        assert bytes_per_token(a) == acc["global_bytes_per_token"]
        assert main_kv_entry_bytes(a.head_dim) == acc["main_kv_entry_bytes"]
        assert window_entry_bytes(a.head_dim) * a.window_size == acc["swa_bytes_per_layer"]
    x = torch.randn(3, flash.head_dim)
    assert pack_main_kv(x).shape[-1] == 288 and pack_window_kv(x).shape[-1] == 528
    assert pack_index_k(torch.randn(3, flash.index_head_dim)).shape[-1] == 68


def test_engine_cache_bytes_follow_the_formula():
    a = get_flavor("debug", vocab_size=4096, engram_compressed_vocab_size=2742)  # default tokenizer's Engram
    model = Transformer(a)
    model.init_weights(seed=0, std=0.1)
    engine = InferenceEngine(model, Tokenizer.default())
    per_entry = main_kv_entry_bytes(a.head_dim) + index_key_entry_bytes(a.index_head_dim)
    win_b = window_entry_bytes(a.head_dim)
    g = torch.Generator().manual_seed(0)
    for n in (9, 24):  # odd: a pending ratio-2 token; even: all groups complete
        sid = engine.start(torch.randint(0, a.vocab_size, (n,), generator=g).tolist())
        engine.prefill([sid])
        got = engine.cache_bytes(sid)
        want_global = sum((n // a.compress_ratio(s)) * per_entry for s in a.kv_source_layers)
        assert got["global"] == want_global
        if n % 2 == 0:
            assert got["global"] == bytes_per_token(a) * n
        assert got["window"] == a.n_layers * min(n, a.window_size - 1) * win_b
        n_r2 = sum(a.compress_ratio(s) == 2 for s in a.kv_source_layers)
        assert got["pending"] == n_r2 * 2 * a.head_dim * 4  # one fp32 (kv, score) token per ratio-2 source
        assert got["total"] == got["global"] + got["window"] + got["pending"]
        # what the session's layers hold now (dense fake-quantised tensors) round-trips bit for bit
        for layer in engine.cache(sid).layers:
            for name, fmt in (("window_kv", "window_kv"), ("compress_kv", "main_kv"), ("index_k", "index_k")):
                t = getattr(layer, name)
                if t is not None and t.numel():
                    pack, unpack, _ = FORMATS[fmt]
                    assert torch.equal(unpack(pack(t), t.dtype), t), name
