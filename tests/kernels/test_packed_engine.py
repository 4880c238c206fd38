"""The inference engine on a packed cache with impl="triton" (debug model, QAT on): each layer's
attention reads the packed FP4 main-KV entries it picks as bytes (kernels/sparse_attn.py `ckv=`),
so the bank is never unpacked whole, and generation equals the same model on a dense cache (token
for token, log-probs to rounding: the packed cache reads its rows by another route, staged or
decoded inside the kernel, with tiles of its own), in the prompt's prefill (many queries) and in decode.
Here rather than in tests/model because the Triton kernels run under this folder's interpreter."""

import pytest
import torch


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_packed_cache_is_read_as_bytes_and_generates_as_dense(device, monkeypatch, debug_model):
    from model import attention
    from model.engine import InferenceEngine

    model = debug_model("triton", device=device)
    assert model.args.qat  # a packed cache is lossless only on the fake-quant grid
    prompt = _prompt(10, 0)  # several complete groups of ratio 2 and 4: a bank to read
    runs = {}
    for packed in (False, True):
        if packed:  # the bank's main KV must never be unpacked whole
            monkeypatch.setattr(attention, "unpack_main_kv", lambda *a, **k: pytest.fail("bank unpacked"))
        engine = InferenceEngine(model, None, max_sessions=1, device=device, packed_cache=packed)
        sid = engine.start(prompt)
        # the prompt's own prefill already reads packed entries (the bank is appended, then read)
        gens = engine.generate([sid], 2, stop_ids=())
        runs[packed] = gens, engine.cache(sid)
    (dense, _), (packed, packed_cache) = runs[False], runs[True]
    assert any(c.compress_kv is not None and c.compress_kv.dtype == torch.uint8 for c in packed_cache.layers)
    for g, w in zip(packed, dense):
        assert g.token_ids == w.token_ids
        atol = 1e-4 if device == "cpu" else 2e-2  # fp32 under the interpreter; bf16-rounded p on the GPU
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), rtol=0, atol=atol)


def test_packed_cache_refuses_gradients(device, debug_model):
    """Packed caches are inference storage: a grad-enabled forward through one is an error."""
    from model.engine import InferenceEngine

    model = debug_model("triton", device=device)
    engine = InferenceEngine(model, None, max_sessions=1, device=device, packed_cache=True)
    sid = engine.start(_prompt(9, 3))
    cache = engine.cache(sid)
    ids = torch.tensor([[5]], device=device)
    with pytest.raises(ValueError, match="inference storage"):
        model.forward_incremental(ids, cache.seq_len, cache)
