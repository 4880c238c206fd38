"""The compiled decode switch (model/ragged_cache.py compile_decode) on CPU: decode steps, and only
they, call the compiled forward; prefill steps stay eager; it is off unless asked for. The compiled
step itself (inductor, captured in CUDA graphs) is checked against eager token for token on the GPU
(tests/model/test_engine_graphs.py): inductor's CPU compile of a model takes minutes here."""

import dataclasses

import pytest
import torch

from model import ragged_cache
from model.chat_template import ChatTemplate
from model.config import get_flavor
from model.engine import InferenceEngine
from model.tokenizer import Tokenizer
from model.transformer import Transformer

torch.set_num_threads(1)

ARGS = dataclasses.replace(get_flavor("debug", vocab_size=4096, engram_compressed_vocab_size=2742), qat=False)
LENGTHS = (1, 9, 17)


class FakeCompile:
    """torch.compile at the boundary: records its arguments and the calls of what it returns."""

    def __init__(self):
        self.kwargs: dict = {}
        self.calls: list[tuple[int, ...]] = []

    def __call__(self, fn, **kwargs):
        self.kwargs = kwargs

        def compiled(input_ids, *args, **kw):
            self.calls.append(tuple(input_ids.shape))
            return fn(input_ids, *args, **kw)

        return compiled


def _generate(compile_decode: bool):
    model = Transformer(ARGS)
    model.init_weights(seed=0, std=0.1)
    engine = InferenceEngine(model, ChatTemplate(Tokenizer.default()), compile_decode=compile_decode)
    g = torch.Generator().manual_seed(1)
    sids = [engine.start(torch.randint(32, ARGS.vocab_size, (n,), generator=g).tolist()) for n in LENGTHS]
    outs = engine.generate(sids, 5, temperature=1.0, stop_ids=(), seed=3)
    return [(o.token_ids, o.logprobs) for o in outs], engine


def test_decode_steps_call_the_compiled_forward(monkeypatch):
    fake = FakeCompile()
    monkeypatch.setattr(ragged_cache.torch, "compile", fake)
    got, engine = _generate(True)
    assert fake.kwargs["dynamic"] is False  # one compile per bucket shape, never a dynamic graph
    # every decode step (one token per row) and nothing else; the prompts' ragged prefill is eager
    assert fake.calls == [(len(LENGTHS), 1)] * engine.stats["decode_steps"]
    assert engine.stats["decode_steps"] == 4  # 5 tokens: the first from the prefill logits
    want, _ = _generate(False)
    assert got == want


def test_compile_is_opt_in():
    model = Transformer(ARGS)
    engine = InferenceEngine(model, ChatTemplate(Tokenizer.default()))
    assert engine._decode_forward is None  # off unless asked for (docs/engine_throughput.md: why)
    with pytest.raises(ValueError, match="compile_decode=False"):
        InferenceEngine(model, ChatTemplate(Tokenizer.default()), compile_decode=True, record_routing=True)
