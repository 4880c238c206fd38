"""Shared set-up of the model tests."""

import dataclasses

import pytest
import torch

from model.config import get_flavor
from model.engram import EngramHasher
from model.tokenizer import Tokenizer
from model.transformer import Transformer

# Comparing two paths with QAT on. Both paths sum in their own order (other row counts per matmul), so a
# value on an FP8/FP4/MXFP4 rounding boundary can round apart, and everything downstream of it moves
# (later layers at that position, later positions through its KV, further flips there); whether an init
# holds such a value depends on the CPU's summation order, not the code (teacher-forced vs decode of
# test_transformer.py: 0 to 25% of the logits outside 1e-4, by init and ISA). What survives flips is their
# size: a flip moves one element by one quantization step, the quantizers move every element by up to
# half a step, so the RMS gap between the two QAT paths stays a small fraction of the RMS gap QAT on vs
# off on the same weights (teacher-forced vs decode: <= 0.014 over 8 inits x 4 CPU kernel paths, 7x
# below the bound). A path that skipped a quantizer or applied it elsewhere sits a whole quantization
# gap away (ratio ~1).
QAT_FLIP_RATIO = 0.1


def _rms(x: torch.Tensor) -> float:
    return x.double().square().mean().sqrt().item()


@pytest.fixture(scope="session")
def assert_qat_paths_agree():
    """check(got, want, unquantized): `got` and `want` are two QAT-on paths' outputs, `unquantized` the
    output of `want`'s path with QAT off on the same weights (test modules cannot import each other)."""

    def check(got: torch.Tensor, want: torch.Tensor, unquantized: torch.Tensor) -> None:
        gap, quant = _rms(got - want), _rms(unquantized - want)
        assert gap < QAT_FLIP_RATIO * quant, f"RMS gap {gap:.2e} between the QAT paths, {quant:.2e} QAT on vs off"

    return check


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
        out[qat].init_weights(seed=0, std=0.1)
    return out


class SettableClock:
    """A clock for the prefix cache's window-tier TTL that moves only when a test sets `now` (time is a
    boundary we do not own)."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> SettableClock:
    return SettableClock()
