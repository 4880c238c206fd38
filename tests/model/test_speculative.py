"""DSpark speculative decoding (model/speculative.py, InferenceEngine.generate_speculative) on `debug`.

Greedy: speculative output equals plain greedy token for token, with the same log-probs, batched,
with stop ids and stop strings, for a random drafter (rejections) and a briefly trained one
(multi-token acceptance), also with CED prefill. Sampling: the first three tokens' empirical joint
matches the exact model distribution (chi-square, enumerated over the top-p support) for both
drafters, per row (the step as the model defines it) and through the engine's batched step, and
matches plain sampling; emitted log-probs are the target's. Also the acceptance rules by hand, the
k chooser, and the cost model.

QAT is off throughout: these tests compare the verify forward (k+1 positions per matmul) with plain
decode (one) and with batched forwards, whose fp32 sums differ in order (~1e-6 relative); under QAT a
value on an FP8/FP4 rounding boundary turns that into a whole quantization step (up to ~1e-3 in a
log-prob, seen on Intel and AMD hosts), so whether two paths agree would depend on the CPU. They are
about drafting, verification and rollback, which run the same with the quantizers on; the quantizers
and the packed caches built on them have their own tests (test_quant.py, test_packed_storage.py).
"""

import copy
import dataclasses
import functools

import pytest
import torch

from model.chat_template import ChatTemplate
from model.config import get_flavor
from model.engine import InferenceEngine
from model.engram import EngramHasher
from model.sampling import sampling_logprobs
from model.speculative import (
    CostModel,
    SpeculativeConfig,
    accept_greedy,
    accept_sampling,
    align_drafter,
    choose_k,
    measure_cost_model,
    prefix_survival,
    speculative_step,
    sync_drafter,
)
from model.tokenizer import Tokenizer
from model.transformer import ModelCache, Transformer

# Debug sizes on the default tokenizer (its Engram hasher applies), dspark_block_size 2, QAT off (docstring).
ARGS = get_flavor("debug", vocab_size=4096, engram_compressed_vocab_size=2742, qat=False)
K = ARGS.dspark_block_size
# Sampling test: a prompt and settings whose top-p support of the first three tokens is small enough to
# enumerate (2 x 35 x 345 sequences) and to fill a chi-square table with N samples.
STAT_T, STAT_TOP_P, N_STAT = 0.4, 0.9, 1200
# A cost model under which verifying more is never slower, so every step verifies all K drafts; a plain
# decode step modelled PLAIN_S long, so speculation pays however many positions its sessions sit at
# (one verification forward per position: model/speculative.py grouped_speedup).
PLAIN_S = 64.0
ALWAYS_K = CostModel([1.0] * (K + 1), 0.0, t_plain=PLAIN_S)
FORCE_K = CostModel([1.0 - 0.1 * k for k in range(K + 1)], 0.0, t_plain=PLAIN_S)  # also when survival underflows to 0
# Greedy log-probs, speculative vs plain. Both run the same ops on the same weights; the verify forward's
# matmuls have k+1 rows, plain decode's one, so MKL/oneDNN/ATen pick other kernels and sum in another
# order: each fp32 dot product of length <= 4 x dim moves by a few ulp (~1e-6 relative), and the 8 debug
# layers carry that to ~1e-5 on log-probs of magnitude <= ~10 (measured <= 2e-5 under
# ATEN_CPU_CAPABILITY=default/avx2/avx512 and MKL AVX2). 1e-4 leaves 5x over that.
LOGPROB_ATOL = 1e-4


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(32, ARGS.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


STAT_PROMPT = _prompt(10, 3)


@functools.cache
def _template() -> ChatTemplate:
    return ChatTemplate(Tokenizer.default())


@functools.cache
def _random_model() -> Transformer:
    m = Transformer(ARGS, engram_hasher=EngramHasher(ARGS, _template().tokenizer))
    m.init_weights(seed=0, std=0.2)
    return m.eval()


@functools.cache
def _trained_model() -> Transformer:
    """The random model with its drafter aligned to the frozen backbone: on greedy continuations of
    random prompts and sampled continuations of STAT_PROMPT, soft targets at STAT_T."""
    m = copy.deepcopy(_random_model())
    engine = InferenceEngine(m, _template(), max_sessions=64)
    sids = [engine.start(_prompt(12, 100 + i)) for i in range(8)]
    engine.generate(sids, 24, stop_ids=())
    stat = [engine.start(STAT_PROMPT) for _ in range(24)]
    engine.generate(stat, 26, temperature=STAT_T, top_p=STAT_TOP_P, stop_ids=(), seed=5)
    seqs = torch.tensor([engine.tokens(s) for s in sids + stat])
    with torch.enable_grad():
        align_drafter(m, seqs, 80, temperature=STAT_T, top_p=STAT_TOP_P, batch=16, lr=1e-2)
    return m.eval()


def _models(numerics: bool = False):
    """The two drafters; with `numerics`, the random one carries the marker (the trained one costs its
    training again under every CPU kernel path of `make test-isa`)."""
    marks = [pytest.mark.numerics] if numerics else []
    return [pytest.param(_random_model, id="random_drafter", marks=marks),
            pytest.param(_trained_model, id="trained_drafter")]  # fmt: skip


# ---------------------------------------------------------------------------- acceptance by hand
def test_accept_greedy_by_hand():
    logits = torch.full((2, 3, 5), -1.0)
    logits[:, 0, 1] = logits[:, 1, 2] = logits[:, 2, 3] = 1.0  # argmax 1, 2, 3
    tokens, logprobs, n_acc = accept_greedy(logits, torch.tensor([[1, 2], [1, 4]]))
    assert n_acc.tolist() == [2, 1]
    assert tokens.tolist() == [[1, 2, 3], [1, 2, -1]]  # row 1: draft 4 rejected, correction 2
    want = torch.log_softmax(logits[0, 0], -1)[1]
    assert torch.isclose(logprobs[0, 0], want) and torch.isnan(logprobs[1, 2])


def test_accept_sampling_keeps_p_whatever_q():
    """One position, p fixed, q far from p: the emitted first token is distributed as p (a
    chi-square over N rows, one generator each), accepted drafts are exactly min(1, p/q)-thinned,
    and with q == p every draft is accepted."""
    torch.manual_seed(0)
    V, N = 6, 20000
    p_logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    q = torch.tensor([0.02, 0.08, 0.1, 0.5, 0.2, 0.1])
    gens = [torch.Generator().manual_seed(i) for i in range(N)]
    draft = torch.multinomial(q, N, replacement=True, generator=torch.Generator().manual_seed(1))[:, None]
    target = p_logits.expand(N, 2, V)
    tokens, logprobs, n_acc = accept_sampling(target, draft, q.log().expand(N, 1, V), 1.0, 1.0, gens)
    p = torch.softmax(p_logits, -1)
    counts = torch.bincount(tokens[:, 0], minlength=V).double()
    assert _chi2_pvalue(counts, p.double() * N) > 1e-3
    assert abs(n_acc.float().mean().item() - torch.minimum(p, q).sum().item()) < 0.01  # Σ min(p, q)
    torch.testing.assert_close(logprobs[:, 0], p.log()[tokens[:, 0]])
    _, _, all_acc = accept_sampling(target, draft, p_logits.expand(N, 1, V), 1.0, 1.0, gens)
    assert bool((all_acc == 1).all())
    # no drafts (k = 0): a plain draw from p
    plain, _, none = accept_sampling(target[:, :1], draft[:, :0], target[:, :0], 1.0, 1.0, gens)
    assert bool((none == 0).all())
    assert _chi2_pvalue(torch.bincount(plain[:, 0], minlength=V).double(), p.double() * N) > 1e-3
    # wrong "exact" distributions are rejected: the test has power
    assert _chi2_pvalue(counts, q.double() * N) < 1e-6


def test_choose_k_from_survival_and_cost():
    conf = torch.tensor([[4.0, 4.0], [4.0, -4.0]])
    s = prefix_survival(conf)
    torch.testing.assert_close(s[:, 0], torch.sigmoid(torch.tensor([4.0, 4.0])))
    cheap = CostModel([1.0, 1.1, 1.2], 0.1)
    assert choose_k(s[:1], cheap, 2) == 2  # both drafts likely: verify both
    assert choose_k(s[1:], cheap, 2) == 1  # second draft unlikely: not worth its cost
    assert choose_k(s, cheap, 2) == 1  # a batch keeps one length: joint survival
    assert choose_k(s[:1], CostModel([1.0, 3.0, 4.0], 1.0), 2) == 0  # drafting does not pay: plain step
    assert choose_k(s[:1], cheap, 1) == 1  # capped


def test_cost_model_is_measured_for_every_k():
    model = _random_model()
    engine = InferenceEngine(model, _template(), speculative=SpeculativeConfig())
    cost = engine.speculation_cost(2)
    assert len(cost.t_verify) == K + 1 and cost.t_draft > 0 and all(t > 0 for t in cost.t_verify)
    assert engine.speculation_cost(2) is cost  # measured once per batch size
    assert cost.relative()[0] == 1.0
    direct = measure_cost_model(model, engine._verify_forward, 1, K, repeats=1)
    assert len(direct.t_verify) == K + 1


# ---------------------------------------------------------------------------- greedy equality
@pytest.mark.parametrize("make_model", _models(numerics=True))
def test_greedy_speculative_equals_plain_greedy(make_model):
    model, template = make_model(), _template()
    plain = InferenceEngine(model, template, max_sessions=8)
    spec = InferenceEngine(model, template, max_sessions=8, speculative=SpeculativeConfig(cost=ALWAYS_K))
    # two sessions of equal length (one batch), one of another length, one past the window (16)
    prompts = [_prompt(12, 100), _prompt(12, 101), _prompt(7, 3), _prompt(21, 4)]
    a = [plain.start(p) for p in prompts]
    b = [spec.start(p) for p in prompts]
    ga, gb = plain.generate(a, 18, stop_ids=()), spec.generate_speculative(b, 18, stop_ids=())
    for x, y in zip(ga, gb):
        assert y.token_ids == x.token_ids and y.finish_reason == x.finish_reason == "length"
        torch.testing.assert_close(torch.tensor(y.logprobs), torch.tensor(x.logprobs), rtol=0, atol=LOGPROB_ATOL)
        assert y.policy_versions == x.policy_versions and y.text == x.text
    assert [spec.tokens(s) for s in b] == [plain.tokens(s) for s in a]
    stats = [spec.speculation_stats(s) for s in b]
    assert all(s["drafted"] > 0 for s in stats)
    if make_model is _trained_model:  # on the prompts it was trained on, multi-token acceptance happens
        assert sum(s["accepted"] for s in stats[:2]) / sum(s["drafted"] for s in stats[:2]) > 0.5
        # and fewer forwards per session than plain decoding's steps (which batch every session)
        assert all(s["steps"] + s["plain_steps"] < plain.stats["decode_steps"] for s in stats[:2])
    # continuing the sessions after a tool result stays equal (rollback left the caches consistent)
    for x, y in zip(a, b):
        plain.extend(x, _prompt(3, 9))
        spec.extend(y, _prompt(3, 9))
    ga, gb = plain.generate(a, 6, stop_ids=()), spec.generate_speculative(b, 6, stop_ids=())
    assert [g.token_ids for g in gb] == [g.token_ids for g in ga]


@pytest.mark.parametrize("make_model", _models())
def test_greedy_speculative_equals_plain_over_many_prompts(make_model):
    """32 prompts of 1..48 tokens (some of equal length, so groups of several rows verify together,
    some past the window), 24 tokens each, every step verifying K drafts: token for token plain
    greedy, log-probs within LOGPROB_ATOL. In fp32 with
    QAT off the two paths differ by fp32 summation order only (~1e-6 of a logit, LOGPROB_ATOL), far
    below the top-2 gaps of these prompts' continuations."""
    model, template = make_model(), _template()
    plain = InferenceEngine(model, template, max_sessions=32)
    spec = InferenceEngine(model, template, max_sessions=32, speculative=SpeculativeConfig(cost=ALWAYS_K))
    g = torch.Generator().manual_seed(17)
    lengths = [1 + int(x) for x in torch.randint(0, 48, (24,), generator=g)] + [12] * 8
    prompts = [_prompt(n, 1000 + i) for i, n in enumerate(lengths)]
    ga = plain.generate([plain.start(p) for p in prompts], 24, stop_ids=())
    sids = [spec.start(p) for p in prompts]
    gb = spec.generate_speculative(sids, 24, stop_ids=())
    for i, (x, y) in enumerate(zip(ga, gb)):
        assert y.token_ids == x.token_ids, f"prompt {i} (length {lengths[i]})"
        torch.testing.assert_close(torch.tensor(y.logprobs), torch.tensor(x.logprobs), rtol=0, atol=LOGPROB_ATOL)
    stats = [spec.speculation_stats(s) for s in sids]
    assert sum(s["drafted"] for s in stats) > 0


@pytest.mark.parametrize("make_model", _models(numerics=True))
def test_greedy_stops_identically(make_model):
    model, template = make_model(), _template()
    plain = InferenceEngine(model, template, max_sessions=9)
    spec = InferenceEngine(model, template, max_sessions=9, speculative=SpeculativeConfig(cost=ALWAYS_K))
    prompts = [_prompt(12, 100), _prompt(12, 101), _prompt(9, 7)]
    ref = plain.generate([plain.start(p) for p in prompts], 20, stop_ids=())
    # a stop id that occurs mid-way in the first continuation; a stop string from the second's text
    stop_id = ref[0].token_ids[9]
    tail = template.tokenizer.decode(ref[1].token_ids[11:13])
    for kwargs in ({"stop_ids": [stop_id]}, {"stop_ids": (), "stop_strings": [tail]}):
        ga = plain.generate([plain.start(p) for p in prompts], 20, **kwargs)
        gb = spec.generate_speculative([spec.start(p) for p in prompts], 20, **kwargs)
        for x, y in zip(ga, gb):
            assert (y.token_ids, y.finish_reason, y.stop) == (x.token_ids, x.finish_reason, x.stop)
            torch.testing.assert_close(torch.tensor(y.logprobs), torch.tensor(x.logprobs), rtol=0, atol=LOGPROB_ATOL)
        assert ga[0].finish_reason == "stop" or ga[1].finish_reason == "stop"


@pytest.mark.numerics
def test_greedy_speculative_with_ced_prefill():
    """With CED prefill (the drafter's context then comes from the replayed positions only) speculative
    greedy equals plain greedy of the same engine mode, also after a tool result."""
    model, template = _random_model(), _template()
    plain = InferenceEngine(model, template, max_sessions=4, prefill_mode="ced")
    spec = InferenceEngine(
        model, template, max_sessions=4, prefill_mode="ced", speculative=SpeculativeConfig(cost=ALWAYS_K)
    )
    prompts = [_prompt(40, 0), _prompt(40, 1), _prompt(13, 2)]  # 40 > the debug window: a real replay
    a, b = [plain.start(p) for p in prompts], [spec.start(p) for p in prompts]
    for turn in range(2):
        ga, gb = plain.generate(a, 10, stop_ids=()), spec.generate_speculative(b, 10, stop_ids=())
        assert [g.token_ids for g in gb] == [g.token_ids for g in ga], f"turn {turn}"
        torch.testing.assert_close(torch.tensor([g.logprobs for g in gb]), torch.tensor([g.logprobs for g in ga]),
                                   rtol=0, atol=LOGPROB_ATOL)  # fmt: skip
        for x, y in zip(a, b):
            plain.extend(x, _prompt(5, 9))
            spec.extend(y, _prompt(5, 9))
    assert all(spec.speculation_stats(s)["drafted"] > 0 for s in b)


# ---------------------------------------------------------------------------- distribution
@functools.cache
def _exact_joint() -> dict[tuple[int, int, int], float]:
    """P(x1, x2, x3 | STAT_PROMPT) under the sampling distribution, enumerated over its support."""
    model = _random_model()
    prompt = torch.tensor([STAT_PROMPT])
    with torch.no_grad():
        lp1 = sampling_logprobs(model(prompt).logits[0, -1], STAT_T, STAT_TOP_P)
        s1 = torch.nonzero(lp1 > -torch.inf).flatten()
        rows2 = torch.cat([prompt.expand(len(s1), -1), s1[:, None]], 1)
        lp2 = sampling_logprobs(model(rows2).logits[:, -1], STAT_T, STAT_TOP_P)
        pairs = torch.nonzero(lp2 > -torch.inf)
        rows3 = torch.cat([rows2[pairs[:, 0]], pairs[:, 1:]], 1)
        lp3 = sampling_logprobs(model(rows3).logits[:, -1], STAT_T, STAT_TOP_P)
    out = {}
    for r, (i, x2) in enumerate(pairs.tolist()):
        head = lp1[s1[i]] + lp2[i, x2]
        for x3 in torch.nonzero(lp3[r] > -torch.inf).flatten().tolist():
            out[(int(s1[i]), x2, x3)] = (head + lp3[r, x3]).exp().item()
    return out


def _chi2_pvalue(counts: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit; cells expecting < 5 are pooled into one."""
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    df = int(keep.sum()) - 1
    return torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat.double() / 2).item()


def _chi2_two_sample(c1: torch.Tensor, c2: torch.Tensor) -> float:
    """Chi-square test that two equal-size samples share a distribution; cells with < 10 draws in
    both samples together are pooled into one."""
    small = (c1 + c2) < 10
    a = torch.cat([c1[~small], c1[small].sum()[None]])
    b = torch.cat([c2[~small], c2[small].sum()[None]])
    keep = (a + b) > 0
    stat = ((a[keep] - b[keep]) ** 2 / (a[keep] + b[keep])).sum()
    df = int(keep.sum()) - 1
    return torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat.double() / 2).item()


def _table(samples: list[tuple[int, ...]], exact: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Counts and expected counts over the exact support plus one cell for anything outside it."""
    keys = list(exact)
    index = {key: i for i, key in enumerate(keys)}
    counts = torch.zeros(len(keys) + 1, dtype=torch.float64)
    for s in samples:
        counts[index.get(s, len(keys))] += 1
    expected = torch.tensor([*exact.values(), 0.0], dtype=torch.float64) * len(samples)
    return counts, expected


def _speculative_samples_per_row(model: Transformer, n: int, seed: int):
    """(x1, x2, x3) of n independent rows decoded with `speculative_step` row by row as the model
    defines it (every row keeps all it emits), batched: x1 from the prefill logits, then a step with
    K drafts; rows that emitted only one token take a second step. Returns samples, the target
    log-probs emitted with x2/x3, and counts (drafted, accepted, rows whose first step accepted all K)."""
    engine = InferenceEngine(model, _template(), speculative=SpeculativeConfig())  # for its forward
    gens = [torch.Generator().manual_seed(seed * 1_000_003 + i) for i in range(n)]
    cache = ModelCache(max_rollback=K)
    ids = torch.tensor([STAT_PROMPT] * n)
    logits, hidden = engine._verify_forward(ids, cache, ids[:, :0])
    x1 = torch.stack([torch.empty(ARGS.vocab_size).exponential_(generator=g) for g in gens])
    x1 = (sampling_logprobs(logits[:, -1], STAT_T, STAT_TOP_P).exp() / x1).argmax(-1)
    ctx = ids[:, len(STAT_PROMPT) - (ARGS.engram_max_ngram_size - 1) :]
    step = dict(temperature=STAT_T, top_p=STAT_TOP_P, k_max=K, cost=FORCE_K)
    res = speculative_step(model, engine._verify_forward, cache, x1, ctx, sync_drafter(cache, hidden),
                           generators=gens, **step)  # fmt: skip
    assert res.k == K
    drafted, accepted, all_k = n * K, int(res.n_accepted.sum()), int((res.n_accepted == K).sum())
    x2, lp2 = res.tokens[:, 0], res.logprobs[:, 0]
    x3, lp3 = res.tokens[:, 1].clone(), res.logprobs[:, 1].clone()
    short = torch.nonzero(res.n_accepted == 0).flatten()  # emitted only x2: one more step for x3
    if len(short):
        sub = _rows(cache, short)
        sub.truncate(len(STAT_PROMPT) + 1)
        more_hidden = res.main_hidden[short, :1]
        ctx2 = torch.cat([ctx[short], x1[short, None]], 1)[:, 1:]
        res2 = speculative_step(model, engine._verify_forward, sub, x2[short], ctx2, more_hidden,
                                generators=[gens[i] for i in short.tolist()], **step)  # fmt: skip
        x3[short], lp3[short] = res2.tokens[:, 0], res2.logprobs[:, 0]
        drafted, accepted = drafted + len(short) * K, accepted + int(res2.n_accepted.sum())
    samples = list(zip(x1.tolist(), x2.tolist(), x3.tolist()))
    return samples, lp2, lp3, (drafted, accepted, all_k)


def _rows(cache: ModelCache, rows: torch.Tensor) -> ModelCache:
    """The given batch rows of a ModelCache (tensors index the batch dim first)."""

    def pick(v):
        if isinstance(v, torch.Tensor):
            return v[rows]
        if isinstance(v, list):
            return [pick(x) for x in v]
        if dataclasses.is_dataclass(v):
            return type(v)(**{f.name: pick(getattr(v, f.name)) for f in dataclasses.fields(v)})
        return v

    return pick(cache)


@pytest.mark.slow  # thousands of samples
@pytest.mark.parametrize("make_model", _models())
def test_sampling_keeps_the_model_distribution_per_row(make_model):
    model, exact = make_model(), _exact_joint()
    samples, lp2, lp3, (drafted, accepted, all_k) = _speculative_samples_per_row(model, N_STAT, seed=11)
    counts, expected = _table(samples, exact)
    p_value = _chi2_pvalue(counts, expected)
    assert p_value > 1e-3, f"chi-square p = {p_value:.2e}"
    assert counts[-1] == 0 and abs(1 - sum(exact.values())) < 1e-4  # the enumeration is the whole support
    # emitted log-probs are the target's log p(x2 | x1), log p(x3 | x1, x2) under the sampling distribution
    marg12: dict[tuple[int, int], float] = {}
    for (a, b, _), pr in exact.items():
        marg12[(a, b)] = marg12.get((a, b), 0.0) + pr
    marg1: dict[int, float] = {}
    for (a, _), pr in marg12.items():
        marg1[a] = marg1.get(a, 0.0) + pr
    # fp32 on both sides: the enumeration's batched forwards and the verify forward sum in other orders
    # (~1e-5 on a log-prob, LOGPROB_ATOL) and the marginals sum <= 345 probabilities (~1e-6 relative)
    for i, (a, b, c) in enumerate(samples[:200]):
        want2 = torch.tensor(marg12[(a, b)] / marg1[a]).log()
        want3 = torch.tensor(exact[(a, b, c)] / marg12[(a, b)]).log()
        torch.testing.assert_close(lp2[i], want2, rtol=0, atol=2e-4)
        torch.testing.assert_close(lp3[i], want3, rtol=0, atol=2e-4)
    rate = accepted / drafted
    if make_model is _random_model:
        assert rate < 0.2 and all_k < 0.05 * N_STAT  # the rejection path carries most tokens
    else:
        assert rate > 0.3 and all_k > 0.2 * N_STAT  # multi-token acceptance carries many


@pytest.mark.slow  # thousands of samples
def test_sampling_through_the_engine_keeps_the_distribution():
    """The engine's batched step (rows of one group keep one common length) with the trained drafter,
    against the exact joint and against plain sampling of the same sessions."""
    model, exact = _trained_model(), _exact_joint()
    n = 800
    spec = InferenceEngine(model, _template(), max_sessions=n, speculative=SpeculativeConfig(cost=FORCE_K))
    plain = InferenceEngine(model, _template(), max_sessions=n)
    kw = dict(temperature=STAT_T, top_p=STAT_TOP_P, stop_ids=(), seed=3)
    sids = [spec.start(STAT_PROMPT) for _ in range(n)]
    gs = spec.generate_speculative(sids, 3, **kw)
    gp = plain.generate([plain.start(STAT_PROMPT) for _ in range(n)], 3, **kw)
    cs, expected = _table([tuple(g.token_ids) for g in gs], exact)
    cp, _ = _table([tuple(g.token_ids) for g in gp], exact)
    assert _chi2_pvalue(cs, expected) > 1e-3
    assert _chi2_pvalue(cp, expected) > 1e-3
    assert _chi2_two_sample(cs, cp) > 1e-3  # speculative vs plain samples
    stats = [spec.speculation_stats(s) for s in sids]
    assert sum(s["drafted"] for s in stats) > 0 and sum(s["accepted"] for s in stats) > 0
    for g in gs[:50]:
        assert len(g.logprobs) == 3 and all(lp <= 0 for lp in g.logprobs)
