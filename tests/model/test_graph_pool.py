"""GraphPool's storage key on CPU: where the model's weights are, read per batch without walking the
module tree, and changed whenever a parameter is replaced or moved (the graphs read the addresses
they captured), not by in-place loads (the engine's weight updates)."""

from model.config import get_flavor
from model.ragged_cache import GraphPool
from model.transformer import Transformer


def test_weight_key_follows_replaced_parameters_not_in_place_loads():
    model = Transformer(get_flavor("debug"))
    model.init_weights(seed=0, std=0.1)
    pool = GraphPool()
    key = pool._weights(model)
    assert len(key) == sum(1 for m in model.modules() for p in m._parameters.values() if p is not None)
    assert set(key) == {p.data_ptr() for p in model.parameters()}
    state = {k: v.clone() + 1 for k, v in model.state_dict().items()}
    model.load_state_dict(state)  # copies into the same tensors
    assert pool._weights(model) == key
    model.load_state_dict(state, assign=True)  # new parameter objects at new addresses
    assert pool._weights(model) != key
    moved = pool._weights(model)
    model.head.weight.data = model.head.weight.data.clone()  # one tensor moved
    assert pool._weights(model) != moved
