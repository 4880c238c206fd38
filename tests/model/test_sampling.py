"""Sampling: greedy is argmax, draws follow the (tempered, nucleus-renormalised) distribution, the
tail outside top-p never appears, and returned log-probs are those of the distribution sampled."""

import math

import pytest
import torch

from model.sampling import sample, sampling_logprobs

torch.set_num_threads(1)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_greedy_is_argmax_with_model_logprob():
    logits = torch.randn(5, 50, generator=_gen(0)) * 3
    tok, lp = sample(logits, 0.0, top_p=0.1)
    assert torch.equal(tok, logits.argmax(-1))
    expected = torch.log_softmax(logits, -1).gather(-1, tok[:, None]).squeeze(-1)
    torch.testing.assert_close(lp, expected, rtol=0, atol=1e-6)
    # a tie goes to the lowest id
    tied = torch.tensor([[1.0, 3.0, 3.0, 0.0]])
    assert sample(tied, 0.0)[0].item() == 1


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum()
    expected = probs * n
    keep = expected > 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def test_empirical_frequencies_match_the_tempered_distribution():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    T, n = 0.7, 40_000
    tok, lp = sample(logits.expand(n, -1), T, generator=_gen(1))
    counts = torch.bincount(tok, minlength=6).float()
    probs = torch.softmax(logits / T, -1)
    # 5 degrees of freedom: P(chi2 > 30) ~ 1.5e-5, so a correct sampler passes; a wrong temperature
    # (e.g. T = 1) gives chi2 in the thousands at this n.
    assert _chi_square(counts, probs) < 30
    assert _chi_square(counts, torch.softmax(logits, -1)) > 300
    torch.testing.assert_close(lp, probs.log()[tok], rtol=0, atol=1e-5)


def test_top_p_excludes_the_tail_and_renormalises():
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])  # sorted: 1 (0.5), 3 (0.3), 2 (0.15), 0 (0.05)
    logits = probs.log()
    # mass before id 3 is 0.5 < 0.7: kept; mass before id 2 is 0.8 >= 0.7: dropped
    logq = sampling_logprobs(logits[None], 1.0, top_p=0.7)[0]
    assert torch.isinf(logq[[0, 2]]).all()
    torch.testing.assert_close(logq[[1, 3]].exp(), torch.tensor([0.625, 0.375]))
    n = 20_000
    tok, lp = sample(logits.expand(n, -1), 1.0, top_p=0.7, generator=_gen(2))
    counts = torch.bincount(tok, minlength=4).float()
    assert counts[0] == 0 and counts[2] == 0
    assert _chi_square(counts, logq.exp()) < 20
    torch.testing.assert_close(lp, logq[tok])
    assert (lp > math.log(0.375) - 1e-5).all()


def test_top_p_always_keeps_the_most_likely_token_and_breaks_ties_by_id():
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0]])
    logq = sampling_logprobs(logits, 1.0, top_p=1e-6)
    assert torch.isfinite(logq).sum() == 1 and logq[0, 1] == 0.0
    tok, lp = sample(logits, 0.5, top_p=1e-6, generator=_gen(0))
    assert tok.item() == 1 and lp.item() == 0.0


def test_top_p_with_temperature_renormalises_the_tempered_distribution():
    logits = torch.randn(3, 40, generator=_gen(5)) * 2
    T, p = 1.3, 0.8
    logq = sampling_logprobs(logits, T, p)
    q = logq.exp()
    torch.testing.assert_close(q.sum(-1), torch.ones(3))
    tempered = torch.softmax(logits / T, -1)
    kept = torch.isfinite(logq)
    # kept tokens keep their relative tempered probabilities, and the kept set is the nucleus:
    # every kept token is at least as likely as every dropped one, and the kept mass reaches p
    torch.testing.assert_close(q[kept], (tempered * kept / (tempered * kept).sum(-1, keepdim=True))[kept])
    for b in range(3):
        assert tempered[b][kept[b]].min() >= tempered[b][~kept[b]].max()
        assert tempered[b][kept[b]].sum() >= p
        assert tempered[b][kept[b]].sum() - tempered[b][kept[b]].min() < p


def test_deterministic_and_per_row_generators_are_batch_independent():
    logits = torch.randn(4, 100, generator=_gen(3))
    a = sample(logits, 0.9, 0.95, [_gen(s) for s in (10, 11, 12, 13)])
    b = sample(logits, 0.9, 0.95, [_gen(s) for s in (10, 11, 12, 13)])
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    alone = sample(logits[2:3], 0.9, 0.95, [_gen(12)])
    assert alone[0].item() == a[0][2].item() and alone[1].item() == a[1][2].item()
    # different seeds draw differently (on a flat distribution 4 rows would all agree w.p. 1e-6)
    flat = torch.zeros(4, 1000)
    tok = sample(flat, 1.0, generator=[_gen(s) for s in range(4)])[0]
    assert len(set(tok.tolist())) > 1
    with pytest.raises(ValueError):
        sample(logits, 1.0, generator=[_gen(0)])


def test_invalid_arguments():
    logits = torch.zeros(1, 4)
    for t, p in ((-0.1, 1.0), (1.0, 0.0), (1.0, 1.5)):
        with pytest.raises(ValueError):
            sample(logits, t, p)
    with pytest.raises(ValueError):
        sampling_logprobs(logits, 0.0)
