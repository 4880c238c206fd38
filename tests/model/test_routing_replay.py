"""MoE routing record/replay (model.moe.routing_record / routing_replay / stack_routing) through the
whole Transformer on `debug` (fp32, QAT off): replaying a sequence's own routing reproduces its
logits bit for bit; after the weights change, replay forces the recorded experts while the gate still
gets its gradient; unrecorded (-1) tokens route as usual; the record context sees what the forward's
router stats say."""

import copy
import functools

import pytest
import torch
from tokenizers import Tokenizer as Backend
from tokenizers import models

from model.config import get_flavor
from model.engram import EngramHasher
from model.moe import routing_record, routing_replay, stack_routing
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
