"""CED prefill with decoder bounded replay on the debug model (window 16): equal to full-stack prefill
for prompts of at most a window (logits and greedy decode, QAT on and off), bounded work and a real
difference beyond it, extend + generate equal to a cold prefill of the whole transcript, batched and
rollback-capable caches, and the config check."""

import dataclasses

import pytest
import torch

from model.ced import ced_prefill, check_ced, decoder_work, full_prefill, replay_start
from model.config import get_flavor
from model.engine import InferenceEngine
from model.transformer import ModelCache

# Debug sizes on the default tokenizer, so that its Engram hasher applies (as in test_engine).
ARGS = get_flavor("debug", vocab_size=4096, engram_compressed_vocab_size=2742)
W = ARGS.window_size
# `models` (debug for the default tokenizer, QAT on/off): tests/model/conftest.py


def _ids(b: int, n: int, seed: int) -> torch.Tensor:
    return torch.randint(32, ARGS.vocab_size, (b, n), generator=torch.Generator().manual_seed(seed))


def _prefill_both(model, ids, chunk=7, max_rollback=0):
    with torch.no_grad():
        full_cache = ModelCache(max_rollback=max_rollback)
        full = model.forward_incremental(ids, 0, full_cache)[:, -1]
        ced_cache = ModelCache(max_rollback=max_rollback, encoder_out_len=W)
        ced, _, n = ced_prefill(model, ids, 0, ced_cache, chunk=chunk)
    return full, full_cache, ced, ced_cache, n


def _greedy(model, logits, cache, steps):
    toks, out = [], []
    with torch.no_grad():
        for _ in range(steps):
            t = logits.argmax(-1)
            toks.append(t)
            logits = model.forward_incremental(t[:, None], cache.seq_len, cache)[:, -1]
            out.append(logits)
    return torch.stack(toks, 1), torch.stack(out, 1)


def _decode(model, toks, cache):
    """Logits of decoding the given tokens [B,T] one at a time into `cache`."""
    with torch.no_grad():
        return torch.stack([model.forward_incremental(t[:, None], cache.seq_len, cache)[:, -1] for t in toks.T], 1)


def test_layer_split_and_bank_rule():
    check_ced(ARGS)  # debug: encoder 0-3 (SWA, ratio 2), decoder 4-7 with the ratio-1 bank at 4
    assert ARGS.n_encoder_layers == 4 and ARGS.compress_ratio(4) == 1 and ARGS.kv_source_layers[-1] == 4
    bad = dataclasses.replace(ARGS, kv_source_layers=(*ARGS.kv_source_layers, 6))
    with pytest.raises(ValueError, match="decoder layer after the first"):
        check_ced(bad)
    with pytest.raises(ValueError, match="Engram"):
        check_ced(dataclasses.replace(ARGS, engram_layer_ids=(0, 5)))
    assert replay_start(10, 16) == 0 and replay_start(40, 16) == 24
    w = decoder_work(1024, 128, 20, 20)
    assert w["ratio"] == pytest.approx((20 * 1024 + 20 * 128) / (40 * 1024))


# CED vs full prefill (and the decode after), QAT off: the same ops on the same weights in other chunks
# (7 rows vs the whole prompt per matmul), so the fp32 sums differ in order, ~1e-6 relative, carried by 8
# layers to ~1e-5 on logits of magnitude ~5 (measured <= 2e-5 over ATEN_CPU_CAPABILITY=default/avx2/avx512
# and MKL AVX2); 1e-4 leaves 5x. With QAT on, rounding-boundary flips: `assert_qat_paths_agree`.
PATH_TOL = dict(rtol=1e-4, atol=1e-4)
LP_TOL = dict(rtol=0, atol=1e-4)  # log-probs of the same computations


@pytest.mark.numerics
@pytest.mark.parametrize("qat", [True, False])
@pytest.mark.parametrize("n", [1, 9, W])
def test_ced_equals_full_prefill_up_to_a_window(models, qat, n, assert_qat_paths_agree):
    model = models[qat]
    ids = _ids(2, n, seed=n)
    full, full_cache, ced, ced_cache, n_replay = _prefill_both(model, ids)
    assert n_replay == n  # the replay segment is the whole prompt
    if qat:  # a flip may move a near-tie argmax, so both caches decode the full path's greedy tokens
        toks_full, logits_full = _greedy(model, full, full_cache, 8)
        plain, plain_cache, *_ = _prefill_both(models[False], ids)
        unquantized = torch.cat([plain[:, None], _decode(models[False], toks_full, plain_cache)], 1)
        got = torch.cat([ced[:, None], _decode(model, toks_full, ced_cache)], 1)
        assert_qat_paths_agree(got, torch.cat([full[:, None], logits_full], 1), unquantized)
        return
    torch.testing.assert_close(ced, full, **PATH_TOL)
    toks_full, logits_full = _greedy(model, full, full_cache, 8)
    toks_ced, logits_ced = _greedy(model, ced, ced_cache, 8)
    assert torch.equal(toks_full, toks_ced)
    torch.testing.assert_close(logits_ced, logits_full, **PATH_TOL)


@pytest.mark.numerics
def test_long_prompt_replays_one_window_and_differs_by_truncation(models):
    model = models[False]  # truncation and caches, not the quantizer; the baseline check needs PATH_TOL
    ids = _ids(2, 3 * W + 5, seed=3)
    full, _, ced, ced_cache, n_replay = _prefill_both(model, ids)
    assert n_replay == W
    diff = (ced - full).abs()
    # the truncation is real (decoder windows lost their left context) but bounded
    assert 1e-3 < diff.max().item() < 1.0
    # decoder caches hold only the replayed segment's window rows
    E = ARGS.n_encoder_layers
    assert ced_cache.layers[E].compress_kv.size(1) == ids.size(1)  # the bank covers every position
    assert ced_cache.layers[E + 1].window_kv.size(1) == W - 1
    assert ced_cache.encoder_h.size(1) == W
    with torch.no_grad():  # the benchmark's full-stack baseline is forward_incremental's last position
        base, _, n_dec = full_prefill(model, ids, 0, ModelCache(), chunk=20)
    torch.testing.assert_close(base, full, **PATH_TOL)
    assert n_dec == ids.size(1)


@pytest.mark.numerics
def test_rollback_capable_cache_decodes_like_a_plain_one(models):
    model = models[True]
    ids = _ids(1, 2 * W + 3, seed=4)
    _, _, ced0, cache0, _ = _prefill_both(model, ids)
    _, _, ced3, cache3, _ = _prefill_both(model, ids, max_rollback=3)
    # the same prefill chunks through the same kernels: bit-identical, QAT on or off; decoding then reads
    # KV tensors of another length (the rollback rows), an fp32 reordering of the attention sums at most
    torch.testing.assert_close(ced3, ced0, rtol=0, atol=0)
    _, l0 = _greedy(model, ced0, cache0, 6)
    _, l3 = _greedy(model, ced3, cache3, 6)
    torch.testing.assert_close(l3, l0, rtol=1e-5, atol=1e-5)


def _prompt(n: int, seed: int) -> list[int]:
    return _ids(1, n, seed)[0].tolist()


@pytest.mark.numerics
@pytest.mark.parametrize("tool_len", [5, W + 9])  # shorter than a window: the replay reaches back into turn 1
def test_extend_after_tool_result_equals_cold_prefill(models, tool_len):
    model = models[False]  # warm and cold sessions chunk differently: QAT off, PATH_TOL
    warm = InferenceEngine(model, prefill_mode="ced", prefill_chunk=8)
    sid = warm.start(_prompt(W + 7, 10))
    first = warm.generate([sid], 6, stop_ids=())[0]
    warm.extend(sid, _prompt(tool_len, 11))
    second = warm.generate([sid], 6, stop_ids=())[0]
    transcript = warm.tokens(sid)[: second.prompt_len]

    cold = InferenceEngine(model, prefill_mode="ced", prefill_chunk=8)
    cid = cold.start(transcript)
    again = cold.generate([cid], 6, stop_ids=())[0]
    assert again.token_ids == second.token_ids
    torch.testing.assert_close(torch.tensor(again.logprobs), torch.tensor(second.logprobs), **LP_TOL)
    assert len(first.token_ids) == 6
    assert warm.stats["replay_tokens"] == W + W  # one window per prompt


@pytest.mark.numerics
def test_engine_ced_equals_full_for_short_prompts_and_batches(models):
    model = models[False]  # CED vs full, batched vs alone: other chunks and batch rows, QAT off, PATH_TOL
    prompts = [_prompt(12, 20), _prompt(12, 21), _prompt(W - 1, 22)]
    outs = {}
    for mode in ("ced", "full"):
        eng = InferenceEngine(model, prefill_mode=mode)
        sids = [eng.start(p) for p in prompts]
        outs[mode] = eng.generate(sids, 8, stop_ids=())
    for c, f in zip(outs["ced"], outs["full"]):
        assert c.token_ids == f.token_ids
        torch.testing.assert_close(torch.tensor(c.logprobs), torch.tensor(f.logprobs), **LP_TOL)
    alone = InferenceEngine(model, prefill_mode="ced")
    g = alone.generate([alone.start(prompts[1])], 8, stop_ids=())[0]
    assert g.token_ids == outs["ced"][1].token_ids
    # long prompts of equal length replay as one batch, and each row equals its session run alone
    long = [_prompt(2 * W + 3, 23), _prompt(2 * W + 3, 24)]
    eng = InferenceEngine(model, prefill_mode="ced")
    batched = eng.generate([eng.start(p) for p in long], 8, stop_ids=())
    assert eng.stats["replay_tokens"] == 2 * W
    for p, b in zip(long, batched):
        one = InferenceEngine(model, prefill_mode="ced")
        a = one.generate([one.start(p)], 8, stop_ids=())[0]
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), **LP_TOL)
    with pytest.raises(ValueError, match="prefill_mode"):
        InferenceEngine(model, prefill_mode="half")
