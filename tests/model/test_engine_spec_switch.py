"""Speculation switching itself off (InferenceEngine.generate_speculative): a call whose cost model
says that even fully accepted drafts lose to the engine's plain decode step (`CostModel.t_plain`:
on CUDA the graph decode step, which the eager speculative path cannot match; sessions at several
positions: one verification forward per position) is the plain `generate` call, token for token;
with a cost model under which drafts can win it speculates."""

import pytest
import torch

from model.chat_template import ChatTemplate
from model.config import get_flavor
from model.engine import InferenceEngine
from model.engram import EngramHasher
from model.speculative import CostModel, SpeculativeConfig, grouped_speedup
from model.tokenizer import Tokenizer
from model.transformer import Transformer

torch.set_num_threads(1)

ARGS = get_flavor("debug", vocab_size=4096, engram_compressed_vocab_size=2742, qat=False)
K = ARGS.dspark_block_size
PROMPTS = [(7, 1), (12, 2), (21, 3)]


@pytest.fixture(scope="module")
def setup():
    template = ChatTemplate(Tokenizer.default())
    m = Transformer(ARGS, engram_hasher=EngramHasher(ARGS, template.tokenizer))
    m.init_weights(seed=0, std=0.2)
    prompts = [torch.randint(32, ARGS.vocab_size, (n,), generator=torch.Generator().manual_seed(s)).tolist()
               for n, s in PROMPTS]  # fmt: skip
    return m.eval(), template, prompts


def test_cost_model_break_even():
    # verify of k+1 tokens: 10, 11, 12 ms; a draft 4 ms; graph decode 5 ms
    cost = CostModel([0.010, 0.011, 0.012], 0.004, t_plain=0.005)
    assert cost.break_even() == pytest.approx([2.0, 3.0, 3.2])
    assert cost.best_speedup() == pytest.approx(3 / 3.2)  # k = 2, all accepted: still slower
    assert CostModel([0.010, 0.011, 0.012], 0.004).best_speedup() == pytest.approx(3 / 1.6)  # vs eager plain


def test_grouped_speedup_counts_a_verification_forward_per_position():
    cost = CostModel([1.0] * (K + 1), 0.0, t_plain=0.4)  # K+1 tokens per 1 s against 1 per 0.4 s
    assert grouped_speedup(cost, cost, 1) == pytest.approx(cost.best_speedup()) == pytest.approx((K + 1) * 0.4)
    assert grouped_speedup(cost, cost, 3) == pytest.approx((K + 1) * 0.4 / 3)
    cheap_row = CostModel([0.1] * (K + 1), 0.0)  # one row verifies fast: the batch's own bound still caps it
    assert grouped_speedup(cost, cheap_row, 2) == pytest.approx(cost.best_speedup())


# wins at one position ((K+1) * 0.4 = 2.4 tokens per plain step), loses at three (0.8)
ONE_POSITION_WINS = CostModel([1.0] * (K + 1), 0.0, t_plain=0.4)


def test_sessions_at_different_positions_decode_plain(setup):
    """Multi-turn sessions diverge: at three positions verification takes three forwards against plain
    decoding's one, so the call is plain `generate`; the same sessions at one position speculate."""
    m, template, prompts = setup
    spec = InferenceEngine(m, template, max_sessions=8, speculative=SpeculativeConfig(cost=ONE_POSITION_WINS))
    spec.generate_speculative([spec.start(p) for p in prompts], 8, stop_ids=())
    assert spec.stats["speculation_off_calls"] == 1
    sids = [spec.start(p[:7]) for p in prompts]  # same length, different tokens
    spec.generate_speculative(sids, 8, stop_ids=())
    assert spec.stats["speculation_off_calls"] == 1
    assert all(spec.speculation_stats(s)["drafted"] > 0 for s in sids)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_losing_speculation_is_plain_generate(setup, temperature):
    m, template, prompts = setup
    losing = CostModel([1.0] * (K + 1), 1.0, t_plain=0.1)  # K+1 tokens per 2 s against 1 per 0.1 s
    spec = InferenceEngine(m, template, max_sessions=4, speculative=SpeculativeConfig(cost=losing))
    plain = InferenceEngine(m, template, max_sessions=4)
    got = spec.generate_speculative([spec.start(p) for p in prompts], 8, temperature, stop_ids=(), seed=5)
    want = plain.generate([plain.start(p) for p in prompts], 8, temperature, stop_ids=(), seed=5)
    assert spec.stats["speculation_off_calls"] == 1
    assert all(spec.speculation_stats(s)["drafted"] == 0 for s in spec.session_ids)
    assert all(spec.speculation_stats(s)["off_calls"] == 1 for s in spec.session_ids)
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids and g.logprobs == w.logprobs


def test_winning_speculation_drafts(setup):
    m, template, prompts = setup
    winning = CostModel([1.0] * (K + 1), 0.0, t_plain=1.0)  # every draft is free
    spec = InferenceEngine(m, template, max_sessions=4, speculative=SpeculativeConfig(cost=winning))
    sids = [spec.start(p) for p in prompts]
    spec.generate_speculative(sids, 8, stop_ids=())
    assert spec.stats["speculation_off_calls"] == 0
    assert all(spec.speculation_stats(s)["off_calls"] == 0 for s in sids)
    assert all(spec.speculation_stats(s)["drafted"] > 0 for s in sids)


def test_plain_step_time_leaves_no_trace(setup):
    """The plain-step measurement (on CUDA: graph decode steps) on the eager path here: a positive
    time, no session opened, the engine's counters untouched."""
    m, template, _ = setup
    engine = InferenceEngine(m, template, max_sessions=4, speculative=SpeculativeConfig())
    before = dict(engine.stats)
    assert engine._plain_step_time(2, repeats=2) > 0
    assert engine.session_ids == [] and engine.stats == before


# fully accepted drafts would just beat plain decoding (best_speedup 1.01), but a draft costs a whole
# step, so each session's own switch turns off after a few steps of the random drafter
MARGINAL = CostModel([1.0] * (K + 1), 1.0, t_plain=2 / (K + 1) * 1.01)


def test_call_whose_sessions_stop_drafting_finishes_plain(setup):
    """Once no session drafts, the call's remaining tokens are `generate`'s (plain decode steps):
    greedy output stays token for token the plain engine's, and the next calls run plain."""
    m, template, prompts = setup
    prompts = [p[:7] for p in prompts]  # one position: verification batches every session
    assert MARGINAL.best_speedup() > 1.0
    spec = InferenceEngine(m, template, max_sessions=4,
                           speculative=SpeculativeConfig(cost=MARGINAL, off_calls=2))  # fmt: skip
    plain = InferenceEngine(m, template, max_sessions=4)
    sids, pids = [spec.start(p) for p in prompts], [plain.start(p) for p in prompts]
    got = spec.generate_speculative(sids, 12, 0.0, stop_ids=())
    want = plain.generate(pids, 12, 0.0, stop_ids=())
    assert spec.stats["speculation_off_calls"] == 0 and spec.stats["decode_steps"] > 0  # handed to generate
    assert all(spec.speculation_stats(s)["steps"] + spec.speculation_stats(s)["plain_steps"] < 11 for s in sids)
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids and len(g.token_ids) == 12
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=1e-5, rtol=0)
    # the call lost to plain decoding: the next off_calls = 2 calls are plain, the one after probes
    for n_off in (1, 2, 2):
        spec.generate_speculative(sids, 4, 0.0, stop_ids=())
        assert spec.stats["speculation_off_calls"] == n_off


def test_plain_finish_is_a_function_of_the_seeds(setup):
    m, template, prompts = setup
    prompts = [p[:7] for p in prompts]  # one position, so the call speculates before it finishes plain

    def run():
        spec = InferenceEngine(m, template, max_sessions=4, speculative=SpeculativeConfig(cost=MARGINAL))
        outs = spec.generate_speculative([spec.start(p) for p in prompts], 12, 1.0, stop_ids=(), seed=7)
        assert spec.stats["decode_steps"] > 0
        return [(o.token_ids, o.logprobs) for o in outs]

    assert run() == run()


def test_plain_step_time_leaves_no_inference_tensors(setup, monkeypatch):
    """The timed batch's tensors become its layout's CUDA-graph storage, which later generate calls
    copy into outside inference mode: they must not be inference tensors (seen on the H200: the first
    generate batch of a measured layout failed mid-call with 'Inplace update to inference tensor')."""
    from model import engine_speculative

    built = []

    class Recording(engine_speculative.RaggedBatch):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            if "pool" in kwargs:  # the timed batch (the prefill batch before it takes no pool)
                built.append([getattr(o, name).is_inference() for o, name in self.fields()])

    monkeypatch.setattr(engine_speculative, "RaggedBatch", Recording)
    m, template, _ = setup
    InferenceEngine(m, template, max_sessions=4, speculative=SpeculativeConfig())._plain_step_time(2, repeats=1)
    assert built and built[0] and not any(built[0])
