"""Overlapped decode steps (`overlap_decode`, on with CUDA graphs): the next step is launched from
the drawn tokens before the host reads them, and a row that stopped is rolled back by the token it
was fed ahead. Forced on here on CPU, an overlapped engine must give exactly what a plain one gives
(tokens, log-probs, versions, stop reasons) and leave every session's cache as the plain engine
leaves it, so later turns agree too: greedy and seeded sampling, stops at different steps, length
limits, joins (`admit`), CED prefill, packed caches, the model's own Engram hasher, and a speculative
engine's plain steps (the DSpark context of a rolled-back step dropped too)."""

import dataclasses

import pytest
import torch

from model.chat_template import ChatTemplate
from model.config import get_flavor
from model.engine import InferenceEngine
from model.engram import EngramHasher
from model.tokenizer import Tokenizer
from model.transformer import Transformer

torch.set_num_threads(1)

# QAT off, as in test_engine_ragged: the overlapped engine's rings hold one more (masked) entry, its
# rollback, and the step fed ahead to a row that stopped is one row larger than the plain engine's;
# differently shaped attention and expert matmuls round differently in the last fp32 bits (~3e-6 in
# the logits with QAT off, test_engine_ragged), far below the top tokens' gaps. With QAT (packed
# caches) the FP8/FP4 grids amplify that: that case runs rows that stop together (same batches)
ATOL = 1e-4
QAT_ARGS = get_flavor("debug", vocab_size=4096, engram_compressed_vocab_size=2742)
ARGS = dataclasses.replace(QAT_ARGS, qat=False)
CACHE_FIELDS = ("window_kv", "compress_kv", "index_k", "raw_kv", "raw_score")


@pytest.fixture(scope="module")
def template() -> ChatTemplate:
    return ChatTemplate(Tokenizer.default())


def _model(args=ARGS, hasher=None) -> Transformer:
    m = Transformer(args, engram_hasher=hasher)
    m.init_weights(seed=0, std=0.1)
    return m


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(32, ARGS.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _same_generations(a, b, atol=ATOL):
    for x, y in zip(a, b, strict=True):
        assert x.token_ids == y.token_ids
        torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), rtol=0, atol=atol)
        assert (x.finish_reason, x.stop, x.policy_versions, x.prompt_len) == (
            y.finish_reason, y.stop, y.policy_versions, y.prompt_len,
        )  # fmt: skip


def _same_caches(plain, over, plain_sids, over_sids):
    for p, o in zip(plain_sids, over_sids, strict=True):
        a, b = plain.cache(p), over.cache(o)
        assert a.seq_len == b.seq_len == len(plain.tokens(p)) - 1  # the newest token is not fed yet
        assert torch.equal(a.recent_ids[:, -2:], b.recent_ids[:, -2:])
        for la, lb in zip(a.layers, b.layers, strict=True):
            for name in CACHE_FIELDS:
                x, y = getattr(la, name), getattr(lb, name)
                assert (x is None) == (y is None), name
                if x is not None:  # the overlapped cache keeps one more ring entry (its rollback)
                    n = min(x.size(1), y.size(1))
                    torch.testing.assert_close(x[:, x.size(1) - n :], y[:, y.size(1) - n :], rtol=0, atol=ATOL)


def _pair(model, template, **kw):
    return [InferenceEngine(model, template, max_sessions=16, overlap_decode=o, **kw) for o in (False, True)]


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_overlapped_steps_equal_plain_steps(template, temperature):
    model = _model()
    prompts = [_prompt(n, 200 + n) for n in (1, 4, 9, 17, 30)]
    plain, over = _pair(model, template)
    assert over.overlap_decode and not plain.overlap_decode
    free = plain.generate([plain.start(p) for p in prompts], 12, temperature, 0.95, stop_ids=(), seed=5)
    # stops drawn at different steps by different rows: each row's 3rd, 6th and 9th free token
    stops = {g.token_ids[k] for g, k in zip(free, (2, 5, 8, 8, 11))}
    runs = []
    for engine in (plain, over):
        sids = [engine.start(p) for p in prompts]
        first = engine.generate(sids, 12, temperature, 0.95, stop_ids=stops, seed=5)
        engine.extend(sids[1], _prompt(5, 300))  # a second turn on the caches the first one left
        runs.append((sids, first, engine.generate(sids, 6, temperature, 0.95, stop_ids=(), seed=6)))
    (psids, p1, p2), (osids, o1, o2) = runs
    assert len({len(g.token_ids) for g in p1}) > 1  # rows did stop at different steps
    assert over.stats["rows_rolled_back"] >= 4 and plain.stats["rows_rolled_back"] == 0
    _same_generations(p1, o1)
    _same_generations(p2, o2)
    _same_caches(plain, over, psids, osids)


def test_overlapped_joins_and_finish_reports(template):
    model = _model()
    prompts = [_prompt(n, 220 + n) for n in (5, 12, 19)]
    results = []
    for engine in _pair(model, template):
        first = [engine.start(p) for p in prompts[:2]]
        polls, finished = [], []

        def admit(engine=engine, polls=polls):
            polls.append(1)
            return [(engine.start(prompts[2]), 33)] if len(polls) == 3 else []

        gens = engine.generate(first, 8, temperature=0.9, stop_ids=(), seed=[31, 32], admit=admit,
                               on_finish=lambda sid, g, f=finished: f.append((sid, len(g.token_ids))))  # fmt: skip
        results.append((gens, finished, [engine.tokens(s) for s in range(3)]))
    (pg, pf, pt), (og, of, ot) = results
    _same_generations(pg, og)
    assert pf == of and pt == ot


@pytest.mark.parametrize("mode", ["full", "ced"])
def test_overlapped_ced_packed_and_model_hasher(template, mode):
    hasher = EngramHasher(ARGS, template.tokenizer)
    for model, packed in ((_model(ARGS, hasher), False), (_model(QAT_ARGS), True)):
        prompts = [_prompt(n, 240 + n) for n in (6, 11, 23)]
        runs, engines = [], _pair(model, template, prefill_mode=mode, packed_cache=packed)
        for engine in engines:
            sids = [engine.start(p) for p in prompts]
            a = engine.generate(sids, 7, temperature=0.9, stop_ids=(), seed=[1, 2, 3])
            engine.extend(sids[0], _prompt(4, 9))
            runs.append(a + engine.generate(sids, 5, temperature=0.9, stop_ids=(), seed=[4, 5, 6]))
        _same_generations(*runs)
        # rows that all stop at their length limit are not fed ahead: no step is wasted
        assert engines[0].stats["decode_steps"] == engines[1].stats["decode_steps"]
        assert engines[1].stats["rows_rolled_back"] == 0


def test_speculative_engine_overlaps_its_plain_steps(template):
    """A speculative engine's plain decode steps overlap too: a row fed ahead and rolled back also
    drops that step's DSpark context, so every session keeps the drafter context a plain engine's
    steps leave, and speculation continuing from it drafts and accepts alike."""
    from model.speculative import CostModel, SpeculativeConfig

    hasher = EngramHasher(ARGS, template.tokenizer)
    m = Transformer(ARGS, engram_hasher=hasher)
    m.init_weights(seed=0, std=0.2)
    always_k = CostModel([1.0] * (ARGS.dspark_block_size + 1), 0.0, t_plain=64.0)  # speculation always pays
    prompts = [_prompt(n, 260 + n) for n in (7, 12, 21)]
    engines = [InferenceEngine(m, template, max_sessions=8, overlap_decode=o,
                               speculative=SpeculativeConfig(cost=always_k)) for o in (False, True)]  # fmt: skip
    free = engines[0].generate([engines[0].start(p) for p in prompts], 6, stop_ids=())
    stop = free[0].token_ids[2]  # the first row stops at its third token, the others go on
    runs = []
    for engine in engines:
        sids = [engine.start(p) for p in prompts]
        first = engine.generate(sids, 6, stop_ids=(stop,))
        context = [engine._get(s).main_hidden for s in sids]
        rest = engine.generate_speculative(sids, 8, stop_ids=())
        runs.append((first + rest, context, [engine.speculation_stats(s) for s in sids]))
    assert engines[1].stats["rows_rolled_back"] >= 1
    (pg, pc, ps), (og, oc, os_) = runs
    _same_generations(pg, og, atol=1e-3)  # verification sums k+1 positions per matmul (test_engine_ragged)
    for a, b in zip(pc, oc):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=0, atol=ATOL)
    assert ps == os_ and all(x["drafted"] > 0 for x in ps)


def test_overlap_defaults_and_refusals(template):
    model = _model()
    assert not InferenceEngine(model, template).overlap_decode  # CPU: no graphs, nothing to overlap
    with pytest.raises(ValueError, match="overlap_decode"):
        InferenceEngine(model, template, overlap_decode=True, record_routing=True)
