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
