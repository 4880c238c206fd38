"""Ragged CED prefill on the debug model (window 16): sessions at different positions feeding different
counts (multi-turn episodes after their observations) prefill in ONE `ced_prefill_ragged` call, and
each session gets what its own `ced_prefill` + `forward_incremental` loop gives it, greedy and seeded,
over two turns, with prompt chunks that end at different steps per row."""

import pytest
import torch

from model.ced import ced_prefill
from model.engine import InferenceEngine
from model.sampling import sample
from model.transformer import ModelCache

# `models` (debug for the default tokenizer, QAT on/off, hashing with it): tests/model/conftest.py.
# QAT off for the equality checks: rows batched and padded differently round the fp32 sums in another
# order (~3e-6 on the logits, test_engine_ragged), which FP8/FP4 rounding would amplify; the log-probs
# (~-8) then agree far inside 1e-4, and far below the gaps between the top tokens.
LP_ATOL = 1e-4
W = 16
# before, at and beyond a window, odd and even; the observations make positions and counts diverge
PROMPTS = (1, 9, 16, 17, 30)
OBSERVATIONS = (3, 20, 1, 11, 7)


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(32, 4096, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.inference_mode()
def _turns(model, turns: list[list[int]], n_new: int, temperature: float, seed: int, chunk: int):
    """One session's episode alone: each turn's tokens (with the last generated token not fed yet)
    through `ced_prefill`, then `forward_incremental` one token at a time, a fresh generator per turn."""
    cache = ModelCache(encoder_out_len=W)
    pending, out = [], []
    for given in turns:
        ids = pending + given
        logits, _, _ = ced_prefill(model, torch.tensor([ids]), cache.seq_len, cache, chunk=chunk)
        logits = logits[0]
        gen = torch.Generator().manual_seed(seed)
        toks, lps = [], []
        for k in range(n_new):
            tok, lp = sample(logits[None], temperature, 0.95, [gen])
            toks.append(int(tok[0]))
            lps.append(float(lp[0]))
            if k < n_new - 1:
                logits = model.forward_incremental(torch.tensor([[toks[-1]]]), cache.seq_len, cache)[0, -1]
        pending = [toks[-1]]
        out.append((toks, lps))
    return out


@pytest.mark.numerics
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_ragged_ced_prefill_equals_per_session(models, temperature):
    model, chunk, n_new = models[False], 8, 5
    prompts = [_ids(n, 200 + n) for n in PROMPTS]
    observations = [_ids(n, 300 + n) for n in OBSERVATIONS]
    seeds = [11 + k for k in range(len(prompts))]
    engine = InferenceEngine(model, max_sessions=8, prefill_mode="ced", prefill_chunk=chunk)
    sids = [engine.start(p) for p in prompts]
    first = engine.generate(sids, n_new, temperature=temperature, top_p=0.95, stop_ids=(), seed=seeds)
    for sid, obs in zip(sids, observations):
        engine.extend(sid, obs)
    calls = engine.stats["forward_calls"]
    second = engine.generate(sids, n_new, temperature=temperature, top_p=0.95, stop_ids=(), seed=seeds)
    # the second turn's rows sit at 5 positions and feed 5 counts: one CED prefill, then the decode steps
    assert engine.stats["forward_calls"] - calls == 1 + (n_new - 1)
    assert engine.stats["forward_calls"] == 2 * (1 + (n_new - 1))
    assert engine.stats["replay_tokens"] == sum(min(n, W) for n in PROMPTS) + sum(
        min(n + n_new + o, W) for n, o in zip(PROMPTS, OBSERVATIONS)
    )  # fmt: skip
    for k, (p, obs, seed) in enumerate(zip(prompts, observations, seeds)):
        want = _turns(model, [p, obs], n_new, temperature, seed, chunk)
        for got, (toks, lps) in zip((first[k], second[k]), want):
            assert got.token_ids == toks
            torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(lps), rtol=0, atol=LP_ATOL)


@pytest.mark.numerics
def test_ragged_ced_prefill_with_qat_agrees(models, assert_qat_paths_agree):
    """QAT on: the batched prefill's next-token logits agree with each session's own CED prefill
    within the quantiser's rounding-flip budget (conftest), measured against QAT off."""
    prompts = [_ids(n, 400 + n) for n in PROMPTS]
    got, want, plain = [], [], []
    engine = InferenceEngine(models[True], max_sessions=8, prefill_mode="ced", prefill_chunk=8)
    sids = [engine.start(p) for p in prompts]
    engine.prefill(sids)
    assert engine.stats["forward_calls"] == 1
    with torch.inference_mode():
        for sid, p in zip(sids, prompts):
            got.append(engine._sessions[sid].next_logits)
            for qat, dst in ((True, want), (False, plain)):
                cache = ModelCache(encoder_out_len=W)
                dst.append(ced_prefill(models[qat], torch.tensor([p]), 0, cache, chunk=8)[0][0])
    assert_qat_paths_agree(torch.stack(got), torch.stack(want), torch.stack(plain))
