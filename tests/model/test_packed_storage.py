"""Packed cache storage (LayerCache(packed=True), InferenceEngine(packed_cache=True)) on the debug model
with QAT on: generation equals dense storage token for token and log-prob for log-prob, the unpacked
caches are bit-identical to the dense ones, the bytes held equal the packed_cache.py formula (also at
small's head dims), and truncation (speculative rollback) matches dense truncation."""

import pytest
import torch

from model.attention import LayerCache
from model.chat_template import ChatTemplate
from model.config import get_flavor
from model.engine import InferenceEngine
from model.engram import EngramHasher
from model.packed_cache import (
    bytes_per_token,
    index_key_entry_bytes,
    main_kv_entry_bytes,
    unpack_index_k,
    unpack_main_kv,
    unpack_window_kv,
    window_entry_bytes,
)
from model.quant import fp4_e4m3_fake_quant, mxfp4_fake_quant
from model.speculative import CostModel, SpeculativeConfig
from model.tokenizer import Tokenizer
from model.transformer import ModelCache, Transformer

torch.set_num_threads(1)

ARGS = get_flavor("debug", vocab_size=4096, engram_compressed_vocab_size=2742)  # default tokenizer's Engram
UNPACK = {"window_kv": unpack_window_kv, "compress_kv": unpack_main_kv, "index_k": unpack_index_k}


@pytest.fixture(scope="module")
def template() -> ChatTemplate:
    return ChatTemplate(Tokenizer.default())


@pytest.fixture(scope="module")
def hasher(template) -> EngramHasher:
    return EngramHasher(ARGS, template.tokenizer)


@pytest.fixture(scope="module")
def model(hasher) -> Transformer:
    assert ARGS.qat
    m = Transformer(ARGS, engram_hasher=hasher)  # hashes inside forward_incremental (direct cache tests)
    m.init_weights(seed=0, std=0.1)
    return m


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(32, ARGS.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _assert_same_cache(packed: ModelCache, dense: ModelCache) -> None:
    """Every packed field unpacks bit for bit to the dense field; the rest is equal as is."""
    assert packed.seq_len == dense.seq_len and len(packed.layers) == len(dense.layers)
    for p, d in zip(packed.layers, dense.layers):
        assert p.packed and not d.packed and p.ratio == d.ratio
        for name, unpack in UNPACK.items():
            pt, dt = getattr(p, name), getattr(d, name)
            assert (pt is None) == (dt is None), name
            if pt is None:
                continue
            assert pt.dtype == torch.uint8 and pt.shape[:2] == dt.shape[:2], name
            got = unpack(pt, dt.dtype)
            assert torch.equal(got.view(torch.int32), dt.view(torch.int32)), f"{name}: not bit-identical"
        for name in ("raw_kv", "raw_score"):
            pt, dt = getattr(p, name), getattr(d, name)
            assert (pt is None and dt is None) or torch.equal(pt, dt), name


def test_packed_generation_equals_dense(model, template):
    prompts = [_prompt(21, 0), _prompt(21, 1), _prompt(14, 2)]  # 21 > window 16, odd: a pending ratio-2 token
    kw = {"temperature": 0.9, "top_p": 0.95, "stop_ids": (), "seed": [11, 12, 13]}
    runs = {}
    for packed in (False, True):
        engine = InferenceEngine(model, template, max_sessions=4, packed_cache=packed)
        sids = [engine.start(p) for p in prompts]
        gens = engine.generate(sids, 9, **kw)
        engine.extend(sids[0], _prompt(5, 3))  # a second turn: prefill on top of a packed cache
        gens += engine.generate(sids[:1], 4, stop_ids=())
        runs[packed] = (engine, sids, gens)
    (dense, d_ids, d_gens), (packed, p_ids, p_gens) = runs[False], runs[True]
    assert packed.stats["forward_calls"] == dense.stats["forward_calls"]  # the equal prompts still batch
    for g, w in zip(p_gens, d_gens):
        assert g.token_ids == w.token_ids
        assert g.logprobs == w.logprobs  # exactly: the attended values are the same bits
    for p, d in zip(p_ids, d_ids):
        _assert_same_cache(packed.cache(p), dense.cache(d))
        assert packed.cache_bytes(p) == dense.cache_bytes(d)


def test_packed_ced_prefill_equals_dense(model, template):
    """CED prefill reads the decoder bank back from the cache (bank_ready) and pads decoder windows."""
    prompt = _prompt(27, 4)
    gens, caches = [], []
    for packed in (False, True):
        engine = InferenceEngine(model, template, prefill_mode="ced", packed_cache=packed)
        sid = engine.start(prompt)
        gens.append(engine.generate([sid], 5, stop_ids=())[0])
        caches.append(engine.cache(sid))
    assert gens[1].token_ids == gens[0].token_ids and gens[1].logprobs == gens[0].logprobs
    _assert_same_cache(caches[1], caches[0])


def test_held_bytes_equal_the_formula_debug(model, template):
    engine = InferenceEngine(model, template, packed_cache=True)
    for n in (9, 24):
        sid = engine.start(_prompt(n, 20 + n))
        engine.prefill([sid])
        layers = engine.cache(sid).layers
        held_global = sum(t.nbytes for c in layers for t in (c.compress_kv, c.index_k) if t is not None)
        held_window = sum(c.window_kv.nbytes for c in layers)
        want = engine.cache_bytes(sid)
        assert held_global == want["global"] and held_window == want["window"]
        if n % 2 == 0:
            assert held_global == bytes_per_token(ARGS) * n
        for c in layers:
            if c.compress_kv is not None:
                assert c.compress_kv.size(-1) == main_kv_entry_bytes(ARGS.head_dim)
                assert c.index_k.size(-1) == index_key_entry_bytes(ARGS.index_head_dim)
            assert c.window_kv.size(-1) == window_entry_bytes(ARGS.head_dim)


def test_held_bytes_per_token_small():
    """small (~1.4B) is not built: its kv sources' LayerCaches get random fake-quantised banks."""
    a = get_flavor("small")
    n = 96  # tokens; every ratio divides it
    g = torch.Generator().manual_seed(0)
    held = 0
    for s in a.kv_source_layers:
        r = a.compress_ratio(s)
        cache = LayerCache(packed=True)
        for _ in range(2):  # two appends: the bank grows in bytes
            kv = fp4_e4m3_fake_quant(torch.randn(1, n // r // 2, a.head_dim, generator=g))
            k = mxfp4_fake_quant(torch.randn(1, n // r // 2, a.index_head_dim, generator=g))
            all_kv, all_k = cache.append_bank(kv, k, r)
            assert torch.equal(all_kv[:, -kv.size(1) :], kv) and torch.equal(all_k[:, -k.size(1) :], k)
        assert cache.compress_kv.dtype == torch.uint8 and cache.compress_kv.size(1) == n // r
        assert cache.compress_kv.size(-1) == 72 and cache.index_k.size(-1) == 34  # 128/2+128/16, 64/2+64/32
        held += cache.compress_kv.nbytes + cache.index_k.nbytes
    assert held / n == bytes_per_token(a) == 265.0


def test_truncate_packed_equals_dense(model):
    K = 3
    ids = torch.tensor([_prompt(23, 30)])
    dense, packed = ModelCache(max_rollback=K), ModelCache(max_rollback=K)
    packed.layers = [LayerCache(max_rollback=K, packed=True) for _ in model.layers]
    with torch.no_grad():
        for cache in (dense, packed):
            model.forward_incremental(ids[:, :19], 0, cache)
            model.forward_incremental(ids[:, 19:22], 19, cache)  # a "verification" of 3 tokens
        _assert_same_cache(packed, dense)
        for cache in (dense, packed):
            cache.truncate(20)  # reject 2 of them: window rows, ratio-2 groups and pending tokens drop
        _assert_same_cache(packed, dense)
        assert packed.layers[0].window_kv.size(1) == dense.layers[0].window_kv.size(1) == ARGS.window_size - 1 + K - 2
        logits = [model.forward_incremental(ids[:, 20:23], 20, cache) for cache in (dense, packed)]
    _assert_same_cache(packed, dense)
    assert torch.equal(logits[1], logits[0])


def test_packed_needs_qat(hasher):
    no_qat = Transformer(get_flavor("debug", vocab_size=4096, engram_compressed_vocab_size=2742, qat=False),
                         engram_hasher=hasher)  # fmt: skip
    with pytest.raises(ValueError, match="qat"):
        InferenceEngine(no_qat, packed_cache=True)
    cache = ModelCache(layers=[LayerCache(packed=True) for _ in no_qat.layers])
    no_qat.init_weights(seed=0, std=0.1)
    with pytest.raises(ValueError, match="qat"), torch.no_grad():
        no_qat.forward_incremental(torch.tensor([_prompt(4, 40)]), 0, cache)


def test_packed_speculative_decoding_equals_dense(model, template):
    """Verification calls roll rejected drafts back with truncate, on the engine's packed caches."""
    always_k = SpeculativeConfig(cost=CostModel([1.0] * (ARGS.dspark_block_size + 1), 0.0, t_plain=64.0))
    prompts = [_prompt(12, 50), _prompt(12, 51), _prompt(21, 52)]
    out = []
    for packed in (False, True):
        engine = InferenceEngine(model, template, max_sessions=4, speculative=always_k, packed_cache=packed)
        sids = [engine.start(p) for p in prompts]
        gens = engine.generate_speculative(sids, 10, stop_ids=())
        assert all(engine.speculation_stats(s)["drafted"] > 0 for s in sids)
        out.append((engine, sids, gens))
    (dense, d_ids, d_gens), (packed, p_ids, p_gens) = out
    for g, w in zip(p_gens, d_gens):
        assert g.token_ids == w.token_ids and g.logprobs == w.logprobs
    for p, d in zip(p_ids, d_ids):
        _assert_same_cache(packed.cache(p), dense.cache(d))
