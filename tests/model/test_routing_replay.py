"""MoE routing record/replay (model.moe.routing_record / routing_replay / stack_routing) through the
whole Transformer on `debug` (fp32, QAT off): replaying a sequence's own routing reproduces its
logits bit for bit; after the weights change, replay forces the recorded experts while the gate still
gets its gradient; unrecorded (-1) tokens route as usual; the record context sees what the forward's
router stats say. The engine's record (`record_routing=True`, `InferenceEngine.routing`) over ragged
prefill, decode steps, speculative verification and CED prefill is what a training forward routes."""

import copy
import functools

import pytest
import torch
from tokenizers import Tokenizer as Backend
from tokenizers import models

from model.config import get_flavor
from model.engine import InferenceEngine
from model.engram import EngramHasher
from model.moe import routing_record, routing_replay, stack_routing
from model.speculative import CostModel, SpeculativeConfig
from model.transformer import Transformer

ARGS = get_flavor("debug", qat=False)
LAYERS = range(ARGS.n_layers)


@functools.cache
def _model() -> Transformer:
    vocab = {f"<t{i}>": i for i in range(ARGS.vocab_size)}
    m = Transformer(ARGS, engram_hasher=EngramHasher(ARGS, Backend(models.WordLevel(vocab, unk_token="<t0>"))))
    m.init_weights(seed=0, std=0.1)
    return m.eval()


def _ids() -> torch.Tensor:
    return torch.randint(0, 500, (2, 20), generator=torch.Generator().manual_seed(1))


def test_replaying_own_routing_reproduces_the_logits():
    model, ids = _model(), _ids()
    with torch.no_grad(), routing_record() as record:
        out = model(ids)
    routing = stack_routing(out.router_stats)
    assert routing.shape == (2, 20, ARGS.n_layers, ARGS.n_activated_experts)
    assert sorted(record) == list(LAYERS)
    assert torch.equal(torch.stack([record[i][0] for i in LAYERS], -2), routing)
    with torch.no_grad(), routing_replay(routing, LAYERS):
        again = model(ids)
    assert torch.equal(again.logits, out.logits)
    assert torch.equal(stack_routing(again.router_stats), routing)


def test_replay_forces_the_recorded_experts_after_the_weights_change():
    model, ids = _model(), _ids()
    with torch.no_grad():
        routing = stack_routing(model(ids).router_stats)
    changed = copy.deepcopy(model)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for layer in changed.layers:
            layer.ffn.gate.weight.add_(torch.randn(layer.ffn.gate.weight.shape, generator=g))
        own = changed(ids)
    assert not torch.equal(stack_routing(own.router_stats), routing)  # the new weights route elsewhere
    with routing_replay(routing, LAYERS):
        forced = changed(ids)
    assert torch.equal(stack_routing(forced.router_stats), routing)
    assert not torch.equal(forced.logits, own.logits)
    forced.logits.float().square().mean().backward()
    assert all(layer.ffn.gate.weight.grad.abs().sum() > 0 for layer in changed.layers)  # the gate still trains
    # tokens 0..4 unrecorded: they route as the changed model does (causal: positions < 5 see only
    # positions < 5, all routed by the changed model), the rest as recorded
    partial = routing.clone()
    partial[:, :5] = -1
    with torch.no_grad(), routing_replay(partial, LAYERS):
        mixed = stack_routing(changed(ids).router_stats)
    assert torch.equal(mixed[:, :5], stack_routing(own.router_stats)[:, :5])
    assert torch.equal(mixed[:, 5:], routing[:, 5:])


def test_replay_checks_the_routing_shape():
    model, ids = _model(), _ids()
    with torch.no_grad():
        routing = stack_routing(model(ids).router_stats)
    with (
        pytest.raises(ValueError, match="does not match tokens"),
        torch.no_grad(),
        routing_replay(routing[:, :7], LAYERS),
    ):
        model(ids)


# ---------------------------------------------------------------------------- the engine's record
# The engine's forwards (ragged prefill, decode steps, verification) and one full forward compute the
# same gate scores up to fp32 summation order (~1e-6); debug's top-k gaps are ~1e-2, so they pick the
# same experts.
def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(32, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _full_routing(model: Transformer, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return stack_routing(model(torch.tensor([tokens])).router_stats)[0].to(torch.int32)


@pytest.mark.parametrize("speculative", [False, True])
def test_engine_records_what_a_training_forward_routes(speculative):
    model = _model()
    kw = {"speculative": SpeculativeConfig(cost=CostModel([1.0] * 3, 0.0, t_plain=64.0))} if speculative else {}
    engine = InferenceEngine(model, max_sessions=4, record_routing=True, **kw)
    sids = [engine.start(_prompt(n, n)) for n in (9, 20)]
    gen = engine.generate_speculative if speculative else engine.generate
    gen(sids, 7, stop_ids=())
    engine.extend(sids[0], _prompt(4, 99))  # a tool result, fed by the next turn
    gen(sids[:1], 5, stop_ids=())
    for sid in sids:
        tokens, routing = engine.tokens(sid), engine.routing(sid)
        assert routing.shape == (len(tokens), ARGS.n_layers, ARGS.n_activated_experts)
        assert bool((routing[-1] == -1).all())  # the newest token is not fed yet
        fed = tokens[:-1]
        assert torch.equal(routing[:-1], _full_routing(model, fed))
        with torch.no_grad(), routing_replay(routing[None, :-1], LAYERS):
            replayed = model(torch.tensor([fed])).logits
        with torch.no_grad():
            assert torch.equal(replayed, model(torch.tensor([fed])).logits)
    with pytest.raises(ValueError, match="record_routing=True"):
        InferenceEngine(model).routing(0)


def test_ced_engine_records_the_decoder_only_where_it_ran():
    model, W, E = _model(), ARGS.window_size, ARGS.n_encoder_layers
    engine = InferenceEngine(model, prefill_mode="ced", record_routing=True)
    prompt = _prompt(2 * W + 3, 5)
    sid = engine.start(prompt)
    engine.generate([sid], 4, stop_ids=())
    routing, tokens = engine.routing(sid), engine.tokens(sid)
    R = len(prompt) - W  # the decoder replay segment of the prompt
    assert bool((routing[:R, E:] == -1).all()) and bool((routing[R:-1] >= 0).all())
    assert torch.equal(routing[:-1, :E], _full_routing(model, tokens[:-1])[:, :E])  # the encoder ran everywhere


def test_compiled_moe_layer_reads_no_routing_context():
    """Under torch.compile (the engine's compiled decode step) the MoE layer neither records nor
    replays, so dynamo breaks no graph at the ContextVar reads; eager calls inside the contexts do."""
    moe = _model().layers[0].ffn
    x = torch.randn(1, 3, ARGS.dim, generator=torch.Generator().manual_seed(4))
    explained = torch._dynamo.explain(moe)(x)
    assert not any("ContextVar" in str(b.reason) for b in explained.break_reasons), explained.break_reasons
