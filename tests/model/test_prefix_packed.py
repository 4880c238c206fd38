"""The prefix cache over packed live caches (InferenceEngine(packed_cache=True, prefix_cache=...)) on the
debug model with QAT on, against packed caches without the prefix cache and dense caches with it.

Tolerance: none, tokens and log-probs are compared with ==. Under QAT the dense caches hold values on
the fake-quant grid, which the packed entries reproduce bit for bit (model/packed_cache.py), and the
prefix tiers hand back the stored bits (banks as bytes, windows as the live cache held them); every
engine then runs the same torch kernels on the same rows in the same batch shapes, so nothing can
round apart. Where the hot and cold paths feed different shapes (encoder replay against a cold
prefill, a restarted session against one that decoded its tokens) the exact comparison is against the
dense engine doing the same; encoder replay against a cold prefill within a window is fp32 rounding apart."""

import pytest
import torch

from model.config import get_flavor
from model.engine import InferenceEngine
from model.engram import EngramHasher
from model.prefix_cache import PrefixCache, prefix_key
from model.tokenizer import Tokenizer
from model.transformer import Transformer

ARGS = get_flavor("debug", vocab_size=4096, engram_compressed_vocab_size=2742)
W = ARGS.window_size


@pytest.fixture(scope="module")
def model() -> Transformer:
    assert ARGS.qat
    m = Transformer(ARGS, engram_hasher=EngramHasher(ARGS, Tokenizer.default()))
    m.init_weights(seed=2, std=0.1)
    return m


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(32, ARGS.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _engines(model, clock, **kw) -> dict[str, InferenceEngine]:
    """packed + prefix cache (under test), packed without it, dense with it: one PrefixCache each."""
    pc = lambda: PrefixCache(clock=clock, window_ttl_s=10.0)  # noqa: E731
    return {
        "packed+prefix": InferenceEngine(model, prefill_mode="ced", packed_cache=True, prefix_cache=pc(), **kw),
        "packed": InferenceEngine(model, prefill_mode="ced", packed_cache=True, **kw),
        "dense+prefix": InferenceEngine(model, prefill_mode="ced", prefix_cache=pc(), **kw),
    }


def _same(runs: dict[str, list]) -> None:
    want = runs["packed"]
    for name, got in runs.items():
        assert [g.token_ids for g in got] == [g.token_ids for g in want], name
        assert [g.logprobs for g in got] == [g.logprobs for g in want], name


@pytest.mark.parametrize("sampling", [dict(), dict(temperature=1.0, top_p=0.9)], ids=["greedy", "seeded"])
def test_group_and_later_turns_equal_packed_without_prefix_and_dense(model, sampling, clock):
    """The rollout's uses: a group's head session prefills the prompt but its last token, G samples
    start on the whole prompt (warm hits: one token fed each) and decode; one sample then takes two
    observations (`extend`), each followed by a turn on its own cache. Last, a turn restarted as a
    fresh session on the whole conversation restores the state the previous turn's prefill stored
    (against the dense engine doing the same: the engine without a cache would feed other shapes)."""
    G, n_new = 3, 4
    prompt, obs = _ids(W + 5, 1), [_ids(5, 2), _ids(3, 3)]
    engines = _engines(model, clock, max_sessions=2 * G + 2)
    runs: dict[str, list] = {}
    restarts: dict[str, list] = {}
    for name, eng in engines.items():
        eng.prefill([eng.start(prompt[:-1])])
        if eng.prefix_cache is None:  # the same feeds without the cache: the prompt in two prefills
            sids = [eng.start(prompt[:-1]) for _ in range(G)]
            eng.prefill(sids)
            for s in sids:
                eng.extend(s, prompt[-1:])
        else:
            sids = [eng.start(prompt) for _ in range(G)]
            assert eng.prefix_cache.counters["window_hit"] == G
        gens = eng.generate(sids, n_new, stop_ids=(), seed=[7 + g for g in range(G)], **sampling)
        for turn, ids in enumerate(obs):  # tool results on the sample's own cache
            eng.extend(sids[0], ids)
            gens += eng.generate(sids[:1], n_new, stop_ids=(), seed=20 + turn, **sampling)
        runs[name] = gens
        if eng.prefix_cache is not None:
            again = eng.start(eng.tokens(sids[0]) + obs[0])
            stored = len(prompt) + 2 * n_new + sum(map(len, obs))  # through the last turn's prompt
            assert eng.cache(again).seq_len == stored and eng.prefix_cache.counters["window_hit"] == G + 1
            restarts[name] = eng.generate([again], n_new, stop_ids=(), seed=30, **sampling)
            sids.append(again)
        if eng.packed_cache:  # restored sessions stay packed through the batches they joined
            assert all(c.window_kv.dtype == torch.uint8 for s in sids for c in eng.cache(s).layers)
    _same(runs)
    assert [(g.token_ids, g.logprobs) for g in restarts["packed+prefix"]] == [
        (g.token_ids, g.logprobs) for g in restarts["dense+prefix"]
    ]


@pytest.mark.parametrize("prefix_len", [W - 3, 2 * W + 3])
def test_expired_window_replays_the_encoder_on_packed_caches(model, prefix_len, clock):
    """A global hit with a window miss: encoder bounded replay over the restored packed banks (read,
    never rewritten) equals the dense engine's replay; up to a window it also equals no prefix cache."""
    prefix, rest = _ids(prefix_len, 3), _ids(7, 4)
    engines = _engines(model, clock)
    for eng in engines.values():  # every engine prefills the prefix first (stored by those with a cache)
        eng.prefill([eng.start(prefix)])
    stored = engines["packed+prefix"].prefix_cache._global[prefix_key(prefix)]
    clock.now = 11.0  # past the window tier's TTL: the next start replays the encoder
    runs, caches = {}, {}
    for name, eng in engines.items():
        sid = eng.start(prefix + rest)
        runs[name] = eng.generate([sid], 6, temperature=1.0, stop_ids=(), seed=5)
        caches[name] = eng.cache(sid)
        if eng.prefix_cache is not None:
            assert eng.prefix_cache.counters["window_miss"] == 1 and eng.prefix_cache.counters["window_hit"] == 0
    for i, layer in enumerate(caches["packed+prefix"].layers):  # the stored bytes, not rewritten
        if layer.compress_kv is not None:
            kv, k = stored[f"{i}.compress_kv"], stored[f"{i}.index_k"]
            assert layer.compress_kv.dtype == torch.uint8
            assert torch.equal(layer.compress_kv[:, : kv.size(1)], kv) and torch.equal(layer.index_k[:, : k.size(1)], k)
    cold = runs.pop("packed")
    runs["packed"] = runs["dense+prefix"]  # the same replay over dense caches: exact
    _same(runs)
    if prefix_len <= W:  # the replay covers the whole prefix: the cold prefill's values, summed in other
        # shapes (bank read back vs projected in the call), so fp32 rounding apart: 1e-4 as for dense
        # caches (test_prefix_cache.py); beyond a window the replayed encoder windows lack their left context
        got = runs["packed+prefix"][0]
        assert got.token_ids == cold[0].token_ids
        torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(cold[0].logprobs), rtol=0, atol=1e-4)


def test_packed_banks_are_stored_as_the_live_bytes(model, tmp_path):
    """A packed live cache's banks go to the global tier (and disk) as its bytes, and a fresh process
    restores them as packed entries or dense values, whichever its engine holds."""
    prefix = _ids(2 * W + 3, 6)
    eng = InferenceEngine(model, prefill_mode="ced", packed_cache=True, prefix_cache=PrefixCache(tmp_path))
    sid = eng.start(prefix)
    eng.prefill([sid])
    live = eng.cache(sid).layers
    for packed_cache in (True, False):
        cache, how = PrefixCache(tmp_path).lookup(model, prefix + [9], packed_cache=packed_cache)
        assert how == "replayed"
        for mine, theirs in zip(live, cache.layers):
            assert theirs.packed == packed_cache
            if mine.compress_kv is not None:
                want = mine.bank() if not packed_cache else (mine.compress_kv, mine.index_k)
                assert torch.equal(theirs.compress_kv, want[0]) and torch.equal(theirs.index_k, want[1])
    dense = InferenceEngine(model, prefill_mode="ced", prefix_cache=eng.prefix_cache)
    with pytest.raises(ValueError, match="one packed_cache setting"):  # its window tier holds packed rows
        dense.start(prefix + [9])
