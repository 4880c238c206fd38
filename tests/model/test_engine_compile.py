"""The compiled decode switch (model/ragged_cache.py compile_decode) on CPU: decode steps, and only
they, run their layers through the compiled `run_layer`; prefill steps stay eager; it is off unless
asked for. The real compile (inductor, impl=torch) gives the eager engine's greedy tokens with no graph
break and one graph per kind of layer; the GPU tests (tests/model/test_engine_graphs.py) check it
captured in CUDA graphs with the Triton kernels."""

import dataclasses

import pytest
import torch
from torch._dynamo.utils import counters

from model import ragged_cache
from model.attention import build_ragged_layout
from model.chat_template import ChatTemplate
from model.config import get_flavor
from model.engine import InferenceEngine
from model.engram import EngramHasher
from model.tokenizer import Tokenizer
from model.transformer import Transformer, ragged_head, run_layer

torch.set_num_threads(1)

ARGS = dataclasses.replace(get_flavor("debug", vocab_size=4096, engram_compressed_vocab_size=2742), qat=False)
LENGTHS = (1, 9, 17)


class FakeCompile:
    """torch.compile at the boundary: records what it compiled with which arguments, and the calls of
    what it returns (a layer's: its id and the rows and tokens it ran; the glue's: the function)."""

    def __init__(self):
        self.kwargs: dict = {}
        self.calls: list[tuple] = []

    def __call__(self, fn, **kwargs):
        self.kwargs[fn] = kwargs

        def compiled(first, *args):
            self.calls.append((first.layer_id, *args[0].shape[:2]) if fn is run_layer else fn)
            return fn(first, *args)

        return compiled


def _generate(compile_decode: bool, temperature: float = 1.0, lengths: tuple[int, ...] = LENGTHS, n: int = 5):
    model = Transformer(ARGS)
    model.init_weights(seed=0, std=0.1)
    engine = InferenceEngine(model, ChatTemplate(Tokenizer.default()), compile_decode=compile_decode)
    g = torch.Generator().manual_seed(1)
    sids = [engine.start(torch.randint(32, ARGS.vocab_size, (n,), generator=g).tolist()) for n in lengths]
    outs = engine.generate(sids, n, temperature=temperature, stop_ids=(), seed=3)
    return [(o.token_ids, o.logprobs) for o in outs], engine


def test_decode_steps_call_the_compiled_layers(monkeypatch):
    fake = FakeCompile()
    monkeypatch.setattr(ragged_cache.torch, "compile", fake)
    got, engine = _generate(True)
    # the per-layer call and the glue around the layers, not the whole forward
    assert set(fake.kwargs) == {run_layer, build_ragged_layout, ragged_head, EngramHasher.step_hashes}
    # one compile per bucket shape (ragged_cache.compile_decode: why)
    assert all(kw["dynamic"] is False for kw in fake.kwargs.values())
    # every decode step: its n-gram hash and layout, every layer (one token per row), its head; and
    # nothing else: the ragged prefill is eager
    step = [EngramHasher.step_hashes, build_ragged_layout, *[(i, len(LENGTHS), 1) for i in range(ARGS.n_layers)],
            ragged_head]  # fmt: skip
    assert fake.calls == step * engine.stats["decode_steps"]
    assert engine.stats["decode_steps"] == 4  # 5 tokens: the first from the prefill logits
    want, _ = _generate(False)
    assert got == want


# debug's 8 layers are 7 kinds (SWA + Engram; Full r2; Reuse r2; Full r2 + Engram; Full r1 candidate
# source; Reuse r1, twice; Reindex r1): one graph each, the second Reuse r1 layer reusing its kind's;
# and one each for the layout, the head and the n-gram hash.
# aot_eager traces the graphs inductor gets (functionalised, decomposed) and runs them without
# inductor's kernels; inductor's CPU compile of the 7 graphs takes minutes on one core
@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_compiled_decode_gives_eager_tokens(backend, monkeypatch):
    monkeypatch.setattr(ragged_cache, "COMPILE_BACKEND", backend)
    counters.clear()
    torch._dynamo.reset()
    lengths = (1, 6, 17, 30)
    got, engine = _generate(True, temperature=0.0, lengths=lengths, n=6)
    assert engine.stats["decode_steps"] == 5
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 7 + 3
    want, _ = _generate(False, temperature=0.0, lengths=lengths, n=6)
    assert [t for t, _ in got] == [t for t, _ in want]
    torch.testing.assert_close(torch.tensor([lp for _, lp in got]), torch.tensor([lp for _, lp in want]),
                               atol=1e-4, rtol=0)  # fmt: skip


# dynamo's "eager" backend: the same frames and guards as inductor's without its compile, which is
# what decides whether a kind of layer compiles again
def test_engines_of_one_process_share_the_compiled_layers(monkeypatch):
    monkeypatch.setattr(ragged_cache, "COMPILE_BACKEND", "eager")
    counters.clear()
    torch._dynamo.reset()
    got, first = _generate(True, temperature=0.0)
    graphs = counters["stats"]["unique_graphs"]
    assert graphs == 7 + 3  # one per kind of layer, the layout, the head and the hash (above)
    # a second engine of the process (its own torch.compile of run_layer) replays the first one's graphs
    again, second = _generate(True, temperature=0.0)
    assert second._decode_forward is not first._decode_forward
    assert counters["stats"]["unique_graphs"] == graphs
    assert again == got
    want, _ = _generate(False, temperature=0.0)
    assert [t for t, _ in got] == [t for t, _ in want]


def test_compile_follows_the_cuda_graphs():
    model = Transformer(ARGS)
    engine = InferenceEngine(model, ChatTemplate(Tokenizer.default()))
    assert engine._decode_forward is None  # CPU: no graphs, no compile unless asked for
    with pytest.raises(ValueError, match="compile_decode=False"):
        InferenceEngine(model, ChatTemplate(Tokenizer.default()), compile_decode=True, record_routing=True)


def test_bank_sizes_come_from_a_short_ladder():
    sizes = [ragged_cache.bank_tokens(n, 16384) for n in range(1, 16385)]
    assert sorted(set(sizes)) == [1024, 1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384]  # 16 in 1,024 steps
    assert all(n <= s <= max(1024, 1.5 * n) for n, s in enumerate(sizes, 1))
    assert ragged_cache.bank_tokens(5000, 4500) == 4500  # never past max_seq_len


def test_calls_within_a_bank_rung_reuse_the_compiled_layers(monkeypatch):
    """A compiled engine sizes a decode batch's banks by bank_tokens' rungs (here from 8 tokens): a later
    call whose longest row stays in the rung compiles nothing, one past it compiles again."""
    monkeypatch.setattr(ragged_cache, "COMPILE_BACKEND", "eager")
    monkeypatch.setattr(ragged_cache, "GRAPH_TOKENS", 8)
    counters.clear()
    torch._dynamo.reset()
    model = Transformer(ARGS)
    model.init_weights(seed=0, std=0.1)
    engine = InferenceEngine(model, ChatTemplate(Tokenizer.default()), compile_decode=True)
    graphs = []
    for lengths, n in (((3, 5), 3), ((2, 5), 2), ((9, 3), 3)):  # longest + new tokens: 8, 7, 12
        sids = [engine.start(list(range(40, 40 + k))) for k in lengths]
        engine.generate(sids, n, temperature=0.0, stop_ids=())
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] > 0 and graphs[1] == graphs[0] and graphs[2] > graphs[1], graphs
    cfg = torch._dynamo.config  # room for every (kind of layer, bucket, rung) the engine may meet
    assert cfg.recompile_limit >= ARGS.n_layers * len(ragged_cache.GRAPH_BUCKETS) * 9  # 8..128: 9 rungs
