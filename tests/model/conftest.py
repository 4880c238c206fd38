"""Shared set-up of the model tests."""

import dataclasses

import pytest
import torch

from model.config import get_flavor
from model.engram import EngramHasher
from model.tokenizer import Tokenizer
from model.transformer import Transformer

# An init without FP8/FP4 rounding-boundary values for the exact tests (see test_transformer.QAT_EXACT_SEED).
QAT_EXACT_SEED = 1


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    # The debug model is tiny: thread hand-offs cost more than they save on shared CPU runners.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def models() -> dict[bool, Transformer]:
    """`debug` sized for the default tokenizer, with QAT on and off, hashing Engram n-grams with that
    tokenizer (the CED and replay-simulation tests)."""
    base = get_flavor("debug", vocab_size=4096, engram_compressed_vocab_size=2742)
    tok, out = Tokenizer.default(), {}
    for qat in (True, False):
        args = dataclasses.replace(base, qat=qat)
        out[qat] = Transformer(args, engram_hasher=EngramHasher(args, tok))
        out[qat].init_weights(seed=QAT_EXACT_SEED, std=0.1)
    return out
