"""The training-side simulation of CED decoder replay on the debug model: per-token log-probs of a
multi-turn rollout from the CED engine are reproduced by `simulated_forward` (and not by the plain
full forward), a single short turn equals the plain forward, packed rows equal rows alone, gradients
reach every backbone parameter, and decoder work is bounded per turn."""


import pytest
import torch

from model.config import get_flavor
from model.engine import InferenceEngine
from model.replay import replay_forward, simulated_forward, turn_spans
from model.transformer import INTENTIONALLY_FROZEN, Transformer

ARGS = get_flavor("debug", vocab_size=4096, engram_compressed_vocab_size=2742)
W = ARGS.window_size
# `models` (debug for the default tokenizer, QAT on/off): tests/model/conftest.py
# Simulation vs engine or plain forward, QAT off: the same ops on the same weights in other chunks and
# batch rows, so fp32 sums in another order, ~1e-6 relative, ~1e-5 on logits and log-probs after 8 layers
# (measured <= 2e-5 under ATEN_CPU_CAPABILITY=default/avx2/avx512 and MKL AVX2); 1e-4 leaves 5x. With QAT
# on, rounding-boundary flips make equality CPU-dependent: `assert_qat_paths_agree` (conftest.py).
PATH_TOL = dict(rtol=1e-4, atol=1e-4)


def _rand(n: int, g: torch.Generator) -> list[int]:
    return torch.randint(32, ARGS.vocab_size, (n,), generator=g).tolist()


def rollout(model: Transformer, mode: str, prompt_len: int, tool_lens: list[int], new_tokens: int, seed: int = 0):
    """A sampled (temperature 1) multi-turn session: (token ids [1,T], turns [(N_k, T_k)], engine log-probs)."""
    g = torch.Generator().manual_seed(seed)
    eng = InferenceEngine(model, prefill_mode=mode)
    sid = eng.start(_rand(prompt_len, g))
    turns, logprobs = [], []
    for k, tool in enumerate([*tool_lens, 0]):
        gen = eng.generate([sid], new_tokens, temperature=1.0, stop_ids=(), seed=seed * 100 + k)[0]
        turns.append((gen.prompt_len, gen.prompt_len + len(gen.token_ids)))
        logprobs += gen.logprobs
        if tool:
            eng.extend(sid, _rand(tool, g))
    return torch.tensor([eng.tokens(sid)]), turns, torch.tensor(logprobs)


def generated_logprobs(logits: torch.Tensor, ids: torch.Tensor, turns) -> torch.Tensor:
    """log p of every generated token of row 0 from logits [1,T,V] (position p predicts p+1)."""
    pos = torch.cat([torch.arange(n - 1, t - 1) for n, t in turns])
    logp = torch.log_softmax(logits[0, pos].float(), -1)
    return logp.gather(-1, ids[0, pos + 1, None]).squeeze(-1)


@pytest.mark.numerics
@pytest.mark.parametrize("qat", [True, False])
def test_simulation_matches_ced_engine_logprobs(models, qat, assert_qat_paths_agree):
    model = models[qat]
    ids, turns, engine_lp = rollout(model, "ced", W + 11, [5, W + 7], 6)  # every prompt exceeds the window
    with torch.no_grad():
        sim = simulated_forward(model, ids, [turns])
        plain = model(ids)
    sim_lp = generated_logprobs(sim.logits, ids, turns)
    sim_err = (sim_lp - engine_lp).abs().mean().item()
    plain_err = (generated_logprobs(plain.logits, ids, turns) - engine_lp).abs().mean().item()
    if qat:  # the size of the gap; the same tokens through the simulation without the quantizers
        with torch.no_grad():
            unquantized = generated_logprobs(simulated_forward(models[False], ids, [turns]).logits, ids, turns)
        assert_qat_paths_agree(sim_lp, engine_lp, unquantized)
    else:
        assert sim_err < PATH_TOL["atol"]
    assert plain_err > 10 * sim_err and plain_err > 1e-3
    # the decoder ran one window per turn plus the generated tokens, not the whole row
    assert sim.decoder_tokens == sum(t - max(0, n - W) for n, t in turns) < len(turns) * ids.size(1)
    assert sim.covered[0, torch.cat([torch.arange(n - 1, t) for n, t in turns])].all()
    assert not sim.covered[0, : turns[0][0] - W].any()


@pytest.mark.numerics
def test_full_engine_matches_plain_forward_not_the_simulation(models):
    model = models[False]  # engine vs plain forward: other chunks, QAT off (PATH_TOL)
    ids, turns, engine_lp = rollout(model, "full", W + 11, [5], 6, seed=1)
    with torch.no_grad():
        plain = model(ids)
        sim = simulated_forward(model, ids, [turns])
    assert (generated_logprobs(plain.logits, ids, turns) - engine_lp).abs().mean() < PATH_TOL["atol"]
    assert (generated_logprobs(sim.logits, ids, turns) - engine_lp).abs().mean() > 1e-3


@pytest.mark.numerics
def test_one_short_turn_equals_the_plain_forward(models):
    model = models[False]  # the replay's chunks vs one forward: QAT off (PATH_TOL)
    ids = torch.randint(32, ARGS.vocab_size, (2, 30), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        plain = model(ids)
        sim = simulated_forward(model, ids, [[(W, 30)], [(W - 4, 30)]])  # replay from 0: no truncation
    assert sim.covered.all()
    torch.testing.assert_close(sim.logits, plain.logits, **PATH_TOL)
    torch.testing.assert_close(sim.main_hidden, plain.main_hidden, **PATH_TOL)


@pytest.mark.numerics
def test_packed_rows_equal_rows_alone(models):
    model = models[False]
    g = torch.Generator().manual_seed(3)
    a = torch.randint(32, ARGS.vocab_size, (1, 50), generator=g)
    b = torch.randint(32, ARGS.vocab_size, (1, 41), generator=g)
    ta, tb = [(20, 26), (40, 50)], [(30, 41)]
    with torch.no_grad():
        alone_a = simulated_forward(model, a, [ta])
        alone_b = simulated_forward(model, b, [tb])
        doc_ids = torch.tensor([[0] * 50 + [1] * 41])
        packed = simulated_forward(model, torch.cat([a, b], 1), [ta + [(n + 50, t + 50) for n, t in tb]], doc_ids)
    torch.testing.assert_close(packed.logits[:, :50], alone_a.logits, **PATH_TOL)
    torch.testing.assert_close(packed.logits[:, 50:], alone_b.logits, **PATH_TOL)
    assert torch.equal(packed.covered, torch.cat([alone_a.covered, alone_b.covered], 1))
    with pytest.raises(ValueError, match="one document"):
        simulated_forward(model, torch.cat([a, b], 1), [[(45, 60)]], doc_ids)


def test_gradients_reach_encoder_decoder_and_bank(models):
    model = models[True]
    ids = torch.randint(32, ARGS.vocab_size, (1, 48), generator=torch.Generator().manual_seed(4))
    turns = turn_spans([20, 36], [False] * 20 + [True] * 8 + [False] * 8 + [True] * 12)
    assert turns == [(20, 28), (36, 48)]
    out = simulated_forward(model, ids, [turns])
    logp = torch.log_softmax(out.logits, -1)
    loss = -(logp[0, :-1].gather(-1, ids[0, 1:, None]).squeeze(-1) * out.covered[0, :-1]).sum() + out.indexer_loss
    model.zero_grad()
    loss.backward()
    missing = [
        n for n, p in model.named_parameters()
        if p.requires_grad and not n.startswith("mtp.") and not n.endswith(INTENTIONALLY_FROZEN)
        and (p.grad is None or not p.grad.abs().sum() > 0)
    ]  # fmt: skip
    assert not missing, missing
    assert out.indexer_loss > 0
    assert len(out.router_stats) == ARGS.n_layers
    assert out.router_stats[-1].scores.shape[:2] == ids.shape


def test_replay_forward_takes_a_packed_learner_batch(models):
    """rl.payloads.TrainBatch layout: per-document turn starts, doc ids 0,1,.. then -1 padding."""
    model = models[False]
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(32, ARGS.vocab_size, (1, 100), generator=g)
    doc_ids = torch.tensor([[0] * 50 + [1] * 41 + [-1] * 9])
    loss_mask = torch.zeros(1, 100, dtype=torch.bool)
    loss_mask[0, 20:26] = loss_mask[0, 40:50] = loss_mask[0, 80:91] = True
    turn_starts = [[[20, 40], [30]]]  # document 1 starts at 50: its turn starts at row position 80
    with torch.no_grad():
        want = simulated_forward(model, ids, [[(20, 26), (40, 50), (80, 91)]], doc_ids)
        got = replay_forward(model, ids, doc_ids, turn_starts, loss_mask=loss_mask)
        unmasked = replay_forward(model, ids, doc_ids, turn_starts)  # turns run to the next start
        none = replay_forward(model, ids, doc_ids, [[[], []]])
    torch.testing.assert_close(got.logits, want.logits, rtol=0, atol=0)  # the same call underneath: bit-identical
    assert got.decoder_tokens == want.decoder_tokens < unmasked.decoder_tokens
    gen = loss_mask[0].nonzero().squeeze(-1) - 1  # the positions predicting generated tokens
    # longer turns change the decoder's chunks, not what a generated position sees: fp32 reordering only
    torch.testing.assert_close(unmasked.logits[0, gen], want.logits[0, gen], rtol=1e-5, atol=1e-5)
    assert none.decoder_tokens == 0 and not none.covered.any()
    assert none.router_stats[-1].counts.sum() == 0
