"""Shared set-up of the kernel parity tests: where kernels run and the `device` parameter.

On a CPU-only machine the kernels run under TRITON_INTERPRET=1, set here because pytest imports
this file before the test modules import triton; with a GPU the `gpu`-marked variants run compiled.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.fixture(
    params=[
        pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRET, reason="CPU runs need TRITON_INTERPRET=1")),
        pytest.param(
            "cuda",
            marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")],
        ),
    ]
)
def device(request) -> str:
    return request.param


@pytest.fixture(scope="session")
def debug_model():
    """Factory of the `debug` Transformer for the model-level kernel tests: `debug_model(impl, seed,
    device, qat)` builds it with `init_weights(seed, std=0.1)`, its Engram hashed over a word-level
    tokenizer of its own vocabulary (no tokenizer files)."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import models

    from model.config import get_flavor
    from model.engram import EngramHasher
    from model.transformer import Transformer

    def make(impl: str = "torch", seed: int = 0, device: str = "cpu", qat: bool = True) -> Transformer:
        args = get_flavor("debug", impl=impl, qat=qat)
        vocab = {f"<t{i}>": i for i in range(args.vocab_size)}
        model = Transformer(args, engram_hasher=EngramHasher(args, Backend(models.WordLevel(vocab, unk_token="<t0>"))))
        model.init_weights(seed=seed, std=0.1)
        return model.to(device)

    return make
