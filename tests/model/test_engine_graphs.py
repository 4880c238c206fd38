"""CUDA-graph decode (model/ragged_cache.py GraphPool), with and without the inductor-compiled step
(compile_decode), against the eager engine on the GPU: sessions of mixed lengths get token for token
what the eager decode gives them (greedy and seeded), also while sessions leave the batch and when a
later call replays the graphs of an earlier one, and when sessions join a running call in place."""

import dataclasses

import pytest
import torch
from torch._dynamo.utils import counters

from model.chat_template import ChatTemplate
from model.config import get_flavor
from model.engine import InferenceEngine
from model.tokenizer import Tokenizer
from model.transformer import Transformer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# fp32 and QAT off, as tests/model/test_engine_ragged.py: a padded graph batch routes other token
# sets through the experts than the eager one, which moves fp32 logits by ~1e-6, far below the gaps
# between the top tokens of this model (std 0.1 weights)
ARGS = dataclasses.replace(
    get_flavor("debug", vocab_size=4096, engram_compressed_vocab_size=2742, impl="triton"), qat=False
)
LENGTHS = (1, 4, 9, 16, 17, 30)
ATOL = 1e-4


def _run(graphs: bool, temperature: float, stop_ids=(), compiled: bool = False, qat: bool = False,
         packed: bool = False) -> tuple[list, InferenceEngine]:  # fmt: skip
    model = Transformer(dataclasses.replace(ARGS, qat=qat))
    model.init_weights(seed=0, std=0.1)
    engine = InferenceEngine(model, ChatTemplate(Tokenizer.default()), device="cuda", cuda_graphs=graphs,
                             compile_decode=compiled, packed_cache=packed)  # fmt: skip
    g = torch.Generator().manual_seed(1)
    sids = [engine.start(torch.randint(32, ARGS.vocab_size, (n,), generator=g).tolist()) for n in LENGTHS]
    first = engine.generate(sids, 12, temperature=temperature, stop_ids=stop_ids, seed=3)
    captured = engine.graphs.captures if graphs else 0
    # a later call over five of the sessions (the same bucket of 8 rows): fed by a decode step, it
    # replays the graphs of the first call
    again = engine.generate(sids[1:], 6, temperature=temperature, stop_ids=(), seed=4)
    if graphs:
        assert captured >= 1, "the decode steps did not run on CUDA graphs"
        assert engine.graphs.captures == captured, "the second call captured again instead of replaying"
    return [(o.token_ids, o.logprobs) for o in first + again], engine


# the compiled step fuses fp32 chains and reorders reductions: rounding of ~1e-6, as batching
@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_graph_decode_equals_eager(temperature, compiled):
    eager, _ = _run(False, temperature)
    # stop the first session at its third token: rows then leave a graph batch
    stop = (eager[0][0][2],)
    eager, _ = _run(False, temperature, stop)
    counters.clear()
    graphed, engine = _run(True, temperature, stop, compiled)
    assert len(graphed[0][0]) < 12, "the stop id did not end the first session early"
    # graph engines overlap their decode steps: the stopped row was fed ahead and rolled back
    assert engine.overlap_decode and engine.stats["rows_rolled_back"] >= 1
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])  # each layer one graph
    for (toks_e, lps_e), (toks_g, lps_g) in zip(eager, graphed):
        assert toks_g == toks_e
        torch.testing.assert_close(torch.tensor(lps_g), torch.tensor(lps_e), atol=ATOL, rtol=0)


# packed live caches (the rollout default) under CUDA graphs: the same graph batches as dense QAT caches,
# whose values sit on the fake-quant grid that packing stores exactly (model/packed_cache.py), so the two
# runs compute the same numbers; the tolerance only allows the sparse-attention kernel's packed read
# (it decodes the picked rows in registers) to sum in another order
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_packed_graph_decode_equals_dense(temperature):
    (dense, _), (packed, _) = (_run(True, temperature, qat=True, packed=p) for p in (False, True))
    for (toks_d, lps_d), (toks_p, lps_p) in zip(dense, packed):
        assert toks_p == toks_d
        torch.testing.assert_close(torch.tensor(lps_p), torch.tensor(lps_d), atol=ATOL, rtol=0)


def _run_joins(graphs: bool) -> tuple[list, InferenceEngine]:
    """Five sessions decode (a bucket of 8 rows); two more join the running call (`admit`) at the third
    and sixth polls, short enough for the batch's banks: on graph storage they go into its padding rows."""
    model = Transformer(ARGS)
    model.init_weights(seed=0, std=0.1)
    engine = InferenceEngine(model, ChatTemplate(Tokenizer.default()), device="cuda", cuda_graphs=graphs,
                             compile_decode=False)  # fmt: skip
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(32, ARGS.vocab_size, (n,), generator=g).tolist() for n in (30, 17, 9, 4, 1, 6, 2)]
    first = [engine.start(p) for p in prompts[:5]]
    polls = []

    def admit():
        polls.append(1)
        k = {3: 5, 6: 6}.get(len(polls))
        return [(engine.start(prompts[k]), 10 + k)] if k is not None else []

    outs = engine.generate(first, 10, temperature=1.0, stop_ids=(), seed=[10, 11, 12, 13, 14], admit=admit)
    return [(o.token_ids, o.logprobs) for o in outs], engine


def test_sessions_join_graph_storage_in_place():
    eager, _ = _run_joins(False)
    graphed, engine = _run_joins(True)
    assert engine.stats["rows_joined_in_place"] == 2 and engine.graphs.captures >= 1
    for (toks_e, lps_e), (toks_g, lps_g) in zip(eager, graphed, strict=True):
        assert toks_g == toks_e
        torch.testing.assert_close(torch.tensor(lps_g), torch.tensor(lps_e), atol=ATOL, rtol=0)
