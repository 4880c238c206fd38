"""Continuous batching on the debug model: sessions of different lengths decode in ONE forward per
step (model/ragged_cache.py) and each gets what a per-session `forward_incremental` decode loop
gives it (greedy and seeded sampling, dense and packed caches, CED prefill, the model's own Engram
hasher), sessions leave the batch as they stop, and the caches they keep equal the loop's."""

import dataclasses

import pytest
import torch

from model.chat_template import ChatTemplate
from model.config import get_flavor
from model.engine import InferenceEngine
from model.engram import EngramHasher
from model.sampling import sample
from model.tokenizer import Tokenizer
from model.transformer import ModelCache, Transformer, make_engram_inputs

torch.set_num_threads(1)

# QAT off for the equality tests: rows batched differently route different token sets through each
# expert, so the expert matmuls round differently in the last fp32 bits; with QAT on, FP8/FP4
# rounding and the Engram gate's signed square root (steep near 0) amplify that up to ~1e-2 in the
# logits (measured on teacher-forced rows that differ only in a LATER token), while with QAT off it
# stays ~3e-6. Packed caches need QAT: that test compares packed with dense over the same batches.
QAT_ARGS = get_flavor("debug", vocab_size=4096, engram_compressed_vocab_size=2742)  # default tokenizer's Engram
ARGS = dataclasses.replace(QAT_ARGS, qat=False)
# 3..30 tokens: before/after the window (16), odd and even (a pending ratio-2 token or not), one
# shorter than the Engram context (a 1-token prompt decodes its first token with 1 token of context)
LENGTHS = (1, 4, 9, 16, 17, 30)
ATOL = 1e-4  # log-probs of ~-8: fp32 rounding of differently shaped batches, far below top-token gaps


@pytest.fixture(scope="module")
def template() -> ChatTemplate:
    return ChatTemplate(Tokenizer.default())


@pytest.fixture(scope="module")
def hasher(template) -> EngramHasher:
    return EngramHasher(ARGS, template.tokenizer)


@pytest.fixture(scope="module")
def model() -> Transformer:
    m = Transformer(ARGS)
    m.init_weights(seed=0, std=0.1)
    return m


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(32, ARGS.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.inference_mode()
def _loop(model, hasher, prompt, n_new, temperature=0.0, top_p=1.0, seed=0):
    """The per-session decode the engine must reproduce: forward_incremental one token at a time."""
    cache, ids, out, lps = ModelCache(), list(prompt), [], []
    gen = torch.Generator().manual_seed(seed)

    def feed(new, pos):
        x = torch.tensor([new])
        c = min(pos, ARGS.engram_max_ngram_size - 1)
        ctx = torch.tensor([ids[pos - c : pos]]) if c else None
        return model.forward_incremental(x, pos, cache, engram_inputs=make_engram_inputs(hasher, x, context_ids=ctx))

    logits = feed(ids, 0)[0, -1]
    for _ in range(n_new):
        tok, lp = sample(logits[None], temperature, top_p, [gen])
        out.append(int(tok[0]))
        lps.append(float(lp[0]))
        ids.append(out[-1])
        if len(out) < n_new:
            logits = feed([out[-1]], len(ids) - 1)[0, -1]
    return out, lps, cache


def _check(got, want_tokens, want_lps):
    assert got.token_ids == want_tokens
    torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(want_lps), rtol=0, atol=ATOL)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_mixed_lengths_decode_in_one_forward_per_step(model, template, hasher, temperature):
    prompts = [_prompt(n, 40 + n) for n in LENGTHS]
    seeds = [7 + k for k in range(len(prompts))]
    engine = InferenceEngine(model, template, max_sessions=8)
    sids = [engine.start(p) for p in prompts]
    engine.prefill(sids)
    assert engine.stats["forward_calls"] == 1  # six lengths, one ragged prefill forward
    calls = engine.stats["forward_calls"]
    n_new = 8
    gens = engine.generate(sids, n_new, temperature=temperature, top_p=0.95, stop_ids=(), seed=seeds)
    # the first token comes from the prefill logits; every later one costs one call for all six
    assert engine.stats["forward_calls"] - calls == n_new - 1 == engine.stats["decode_steps"]
    for p, s, g in zip(prompts, seeds, gens):
        _check(g, *_loop(model, hasher, p, n_new, temperature, 0.95, s)[:2])


def test_sessions_leave_and_keep_their_caches(model, template, hasher):
    prompts = [_prompt(n, 60 + n) for n in (5, 12, 19)]
    free = [_loop(model, hasher, p, 10)[0] for p in prompts]
    stop = free[1][3]  # the second session stops at its 4th token; the others stop there only if they draw it
    engine = InferenceEngine(model, template, max_sessions=4)
    sids = [engine.start(p) for p in prompts]
    gens = engine.generate(sids, 10, stop_ids=(stop,))
    for f, g in zip(free, gens):
        k = f.index(stop) + 1 if stop in f else 10
        assert g.token_ids == f[:k] and g.finish_reason == ("stop" if stop in f else "length")
    # every session's cache is what its own loop leaves (the newest token not fed yet)
    for p, g, sid in zip(prompts, gens, sids):
        want = _loop(model, hasher, p, len(g.token_ids))[2]
        got = engine.cache(sid)
        assert got.seq_len == want.seq_len == len(p) + len(g.token_ids) - 1
        for a, b in zip(got.layers, want.layers):
            for name in ("window_kv", "compress_kv", "index_k", "raw_kv", "raw_score"):
                x, y = getattr(a, name), getattr(b, name)
                assert (x is None) == (y is None), name
                if x is not None:
                    assert x.shape == y.shape, name
                    torch.testing.assert_close(x.float(), y.float(), rtol=0, atol=1e-4)
    # a second turn on top of the decoded caches: one session extended, positions diverge further
    engine.extend(sids[0], _prompt(6, 99))
    again = engine.generate(sids, 4, stop_ids=())
    for sid, g in zip(sids, again):
        toks = engine.tokens(sid)
        _check(g, *_loop(model, hasher, toks[: len(toks) - 4], 4)[:2])


def test_packed_ragged_decode_equals_dense(template):
    model = Transformer(QAT_ARGS)
    model.init_weights(seed=0, std=0.1)
    prompts = [_prompt(n, 80 + n) for n in (3, 14, 21)]
    kw = {"temperature": 0.9, "top_p": 0.95, "stop_ids": (), "seed": [1, 2, 3]}
    runs = [InferenceEngine(model, template, max_sessions=4, packed_cache=p) for p in (False, True)]
    outs = [e.generate([e.start(p) for p in prompts], 7, **kw) for e in runs]
    for d, p in zip(*outs):
        assert p.token_ids == d.token_ids and p.logprobs == d.logprobs  # the same bits are attended
    assert runs[0].stats["forward_calls"] == runs[1].stats["forward_calls"] == 1 + 6  # one prefill for all


def test_ced_and_model_hasher_sessions_batch_too(template, hasher):
    m = Transformer(ARGS, engram_hasher=hasher)  # the model hashes itself: the engine hashes rows for it
    m.init_weights(seed=0, std=0.1)
    prompts = [_prompt(n, 90 + n) for n in (6, 11, 23)]
    for mode in ("full", "ced"):
        together = InferenceEngine(m, max_sessions=4, prefill_mode=mode)
        gens = together.generate([together.start(p) for p in prompts], 6, stop_ids=())
        assert together.stats["decode_steps"] == 5
        for p, g in zip(prompts, gens):
            alone = InferenceEngine(m, prefill_mode=mode)
            w = alone.generate([alone.start(p)], 6, stop_ids=())[0]
            _check(g, w.token_ids, w.logprobs)


def test_speculation_continues_after_ragged_decode(template, hasher):
    """A speculative engine's plain decode steps keep each row's DSpark context (the drafter's
    input), so speculation continuing from them is still lossless (greedy = plain greedy)."""
    from model.speculative import CostModel, SpeculativeConfig

    m = Transformer(ARGS, engram_hasher=hasher)
    m.init_weights(seed=0, std=0.2)
    # every step verifies all drafts, and plain decoding is modelled slow: speculation pays at any positions
    always_k = CostModel([1.0] * (ARGS.dspark_block_size + 1), 0.0, t_plain=64.0)
    prompts = [_prompt(n, 120 + n) for n in (7, 12, 21)]
    plain = InferenceEngine(m, template, max_sessions=4)
    want = plain.generate([plain.start(p) for p in prompts], 14, stop_ids=())
    spec = InferenceEngine(m, template, max_sessions=4, speculative=SpeculativeConfig(cost=always_k))
    sids = [spec.start(p) for p in prompts]
    first = spec.generate(sids, 6, stop_ids=())
    rest = spec.generate_speculative(sids, 8, stop_ids=())
    assert spec.stats["decode_steps"] == 5 and all(spec.speculation_stats(s)["drafted"] > 0 for s in sids)
    for w, a, b in zip(want, first, rest):
        assert a.token_ids + b.token_ids == w.token_ids
        # verification scores k+1 positions per matmul, plain decode one: fp32 summation order (and
        # QAT rounding downstream of it) differs, as in test_speculative
        torch.testing.assert_close(torch.tensor(a.logprobs + b.logprobs), torch.tensor(w.logprobs), rtol=0, atol=1e-3)


def test_chunked_ragged_prefill(model, template, hasher):
    """Prompts longer than prefill_chunk take several ragged steps; rows that finish early ride along
    fed nothing (their rings realigned back), and every row still gets its own loop's tokens."""
    prompts = [_prompt(n, 130 + n) for n in (3, 8, 13, 30)]
    engine = InferenceEngine(model, template, max_sessions=4, prefill_chunk=8)
    gens = engine.generate([engine.start(p) for p in prompts], 5, stop_ids=())
    assert engine.stats["forward_calls"] == 4 + 4  # ceil(30 / 8) prefill steps, then 4 decode steps
    for p, g in zip(prompts, gens):
        _check(g, *_loop(model, hasher, p, 5)[:2])


def test_sessions_join_a_running_generate_between_steps(model, template, hasher):
    """Continuous batching: a session started while a generate call runs joins it at the next step
    (`admit`), decodes in the same forward as the others from then on, and gets its own loop's
    tokens; `on_finish` reports each session as it stops."""
    prompts = [_prompt(n, 140 + n) for n in (5, 12, 19)]
    engine = InferenceEngine(model, template, max_sessions=4)
    first = [engine.start(p) for p in prompts[:2]]
    polls, finished = [], []

    def admit():
        polls.append(len(polls) + 1)
        return [(engine.start(prompts[2]), 33)] if len(polls) == 3 else []

    gens = engine.generate(first, 8, temperature=0.9, top_p=0.95, stop_ids=(), seed=[31, 32], admit=admit,
                           on_finish=lambda sid, g: finished.append((sid, len(g.token_ids))))  # fmt: skip
    assert len(gens) == 3 and finished == [(first[0], 8), (first[1], 8), (2, 8)]
    # the joiner's prompt is one more prefill forward; its first token comes from it, its 7 others
    # from decode steps 3..9, shared with the first two sessions' steps 3..7
    assert engine.stats["decode_steps"] == 9 and engine.stats["forward_calls"] == 1 + 1 + 9
    for p, seed, g in zip(prompts, (31, 32, 33), gens):
        _check(g, *_loop(model, hasher, p, 8, 0.9, 0.95, seed)[:2])
    with pytest.raises(ValueError, match="only once at a time"):
        engine.generate([0], 3, stop_ids=(), admit=lambda: [(0, 1)])
    # the joiner's 19-token prompt needs longer banks than the first two sessions': the batch is rebuilt
    assert engine.stats["rows_joined_in_place"] == 0


def test_sessions_join_in_place_where_the_batch_holds_them(model, template, hasher):
    """Joiners whose rows fit the running batch's banks go in after its rows, in place: the first one
    while both first sessions decode, the second after they have stopped and left the batch; every
    session still gets its own loop's tokens."""
    prompts = [_prompt(n, 150 + n) for n in (19, 12, 5, 9, 3)]
    engine = InferenceEngine(model, template, max_sessions=8)
    first = [engine.start(p) for p in prompts[:2]]
    polls = []
    joins = {2: 2, 4: 3, 10: 4}  # poll -> prompt index; by poll 10 the first two have drawn their 8 tokens

    def admit():
        polls.append(len(polls) + 1)
        k = joins.get(len(polls))
        return [(engine.start(prompts[k]), 40 + k)] if k is not None else []

    gens = engine.generate(first, 8, temperature=0.9, top_p=0.95, stop_ids=(), seed=[40, 41], admit=admit)
    assert len(gens) == 5 and engine.stats["rows_joined_in_place"] == 3
    for p, seed, g in zip(prompts, range(40, 45), gens):
        _check(g, *_loop(model, hasher, p, 8, 0.9, 0.95, seed)[:2])


def _prefilled_caches(model, template, lengths: tuple[int, ...]) -> list[ModelCache]:
    engine = InferenceEngine(model, template, max_sessions=len(lengths))
    sids = [engine.start(_prompt(n, 160 + n)) for n in lengths]
    engine.prefill(sids)
    return [engine.cache(s) for s in sids]


@pytest.mark.parametrize("storage", [False, True])
def test_extend_lays_rows_out_as_a_batch_built_with_them(model, template, hasher, storage):
    """RaggedBatch.extend: the rows added after the live ones hold what a batch built with every row
    holds, field by field (on graph storage, whose padding rows take them, too: a GraphPool on the CPU,
    its graphs never run here); it refuses rows its storage or banks cannot hold and changes nothing."""
    from model.ragged_cache import GraphPool, RaggedBatch

    caches = _prefilled_caches(model, template, LENGTHS)
    max_tokens = max(LENGTHS) + 8
    with torch.inference_mode(not storage):
        grown = RaggedBatch(model, caches[:3], max_tokens, pool=GraphPool() if storage else None, hasher=hasher)
        whole = RaggedBatch(model, caches[:4], max_tokens, hasher=hasher)
    assert grown.extend(caches[3:4])
    assert grown.pos == whole.pos and grown.rings == whole.rings
    for (o, a), (q, b) in zip(grown.fields(), whole.fields(), strict=True):
        assert a == b and torch.equal(getattr(o, a)[:4], getattr(q, b)), a
    # a bucket of 4 rows is full; banks of max_tokens cannot hold a 30-token row's next token
    before = (list(grown.pos), [getattr(o, a).clone() for o, a in grown.fields()])
    if storage:
        assert not grown.extend(caches[4:5])
    with torch.inference_mode(not storage):
        short = RaggedBatch(model, caches[:2], 20)
    assert not short.extend(caches[5:6])
    assert (list(grown.pos), [getattr(o, a).clone() for o, a in grown.fields()])[0] == before[0]
    assert all(torch.equal(x, getattr(o, a)) for x, (o, a) in zip(before[1], grown.fields()))
    if not storage:  # the grown batch decodes as the one built whole
        ids = [7, 8, 9, 10]
        torch.testing.assert_close(grown.decode(ids), whole.decode(ids), rtol=0, atol=ATOL)


def test_rows_copy_out_and_back_in_from_any_layout():
    """A split's per-row copies (`_gather`) hold each row's newest entries (rings) or first ones (banks),
    read from a plain tensor, from a ring one entry into its allocation (the batch's layout) and from a
    tensor of other strides (copied first); `_fill` writes them back where they were read."""
    from model.ragged_cache import _fill, _gather

    x = torch.arange(4 * 7 * 3, dtype=torch.float32).view(4, 7, 3)
    ring = torch.zeros(4, 8, 3)[:, 1:]
    ring.copy_(x)
    other = x.transpose(0, 1).contiguous().transpose(0, 1)  # the same values, row-interleaved in memory
    rows, lens = [3, 0, 2], [2, 0, 7]
    for src in (x, ring, other):
        for right in (True, False):
            got = _gather(src, rows, lens, right, {})
            for r, n, part in zip(rows, lens, got):
                assert torch.equal(part, x[r : r + 1, 7 - n :] if right else x[r : r + 1, :n])
    for empty in (x, torch.zeros(4, 0, 3)):  # rows without entries, of a field with or without any
        assert [tuple(part.shape) for part in _gather(empty, [1, 2], [0, 0], True, {})] == [(1, 0, 3)] * 2
    out = torch.zeros(3, 8, 3)[:, 1:]
    _fill(out, list(_gather(ring, rows, lens, True, {})), lens, right=True, index={})
    assert torch.equal(out[0, 5:], x[3, 5:]) and not out[0, :5].any()
    assert not out[1].any() and torch.equal(out[2], x[2])
