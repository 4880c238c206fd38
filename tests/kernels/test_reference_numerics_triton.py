"""numerics="reference" on impl="triton" computes what it computes on impl="torch" (debug model):
the Triton attention runs the released kernel's 64-index blocks over the same reference index
list (`sparse_attn(..., reference=True)`), the indexer scores in bf16 through torch on both impls.
Here rather than in tests/model because the Triton kernels run under this folder's interpreter."""

import torch


def _model(impl: str, device: str):
    from tokenizers import Tokenizer as Backend
    from tokenizers import models

    from model.config import get_flavor
    from model.engram import EngramHasher
    from model.transformer import Transformer

    args = get_flavor("debug", impl=impl, numerics="reference")
    vocab = {f"<t{i}>": i for i in range(args.vocab_size)}
    hasher = EngramHasher(args, Backend(models.WordLevel(vocab, unk_token="<t0>")))
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # as the released code builds it: bf16 activations
    try:
        model = Transformer(args, engram_hasher=hasher)
    finally:
        torch.set_default_dtype(prev)
    model.init_weights(seed=0, std=0.1)
    return model.to(device)


def test_triton_follows_the_reference_switch(device):
    from model.transformer import ModelCache

    ids = torch.randint(0, 512, (1, 14), generator=torch.Generator().manual_seed(0)).to(device)
    out = {}
    with torch.no_grad():
        for impl in ("torch", "triton"):
            model, cache = _model(impl, device), ModelCache()
            logits = [model.forward_incremental(ids[:, :10], 0, cache)[:, -1]]
            for i in range(10, 14):
                logits.append(model.forward_incremental(ids[:, i : i + 1], i, cache)[:, -1])
            out[impl] = torch.stack(logits, 1)
    # fp32 dots under the interpreter; the other fused kernels (mHC, MoE) sum in their own order
    atol = 1e-3 if device == "cpu" else 5e-2
    torch.testing.assert_close(out["triton"], out["torch"], rtol=0, atol=atol)
