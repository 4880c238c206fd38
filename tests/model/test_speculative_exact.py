"""Speculative rejection sampling (model.speculative.accept_sampling) checked exactly, no statistics:

1. The rule is lossless: for fixed target p and drafter q, the law of the first emitted token under
   "draft d ~ q, keep d with probability min(1, p(d)/q(d)), else draw from max(0, p - q)/Σ" is p
   itself, computed in float64 over the whole vocabulary for many fixed (p, q) pairs (including q
   with zeros where p has mass, and q == p).
2. accept_sampling implements that rule: replaying each row's generator stream (its k uniforms, then
   its Exp(1) race vector, in that order) by hand gives the same accept decisions, the same
   corrections and bonus tokens, and the target log-probs.
With 1 and 2, every token accept_sampling emits is distributed exactly as p (the exponential race
argmax(r / Exp(1)) draws from r, as model.sampling.sample does). Exact: integer equality of tokens,
float64 law to 1e-12; log-probs are the same fp32 ops on both sides."""

import torch

from model.sampling import sampling_logprobs
from model.speculative import accept_sampling


def _dists(n: int, V: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(3 * torch.randn(n, V, generator=g, dtype=torch.float64), -1)
    q = torch.softmax(3 * torch.randn(n, V, generator=g, dtype=torch.float64), -1)
    q[: n // 4, : V // 3] = 0  # the drafter never proposes some tokens the target likes
    q = q / q.sum(-1, keepdim=True)
    q[-2] = p[-2]  # a perfect drafter
    return p, q


def test_the_rule_emits_exactly_p():
    p, q = _dists(64, 12, 0)
    accept = torch.where(q > 0, torch.minimum(torch.ones_like(p), p / q.clamp_min(1e-300)), torch.zeros_like(p))
    resid = (p - q).clamp_min(0)
    mass = resid.sum(-1, keepdim=True)
    resid = torch.where(mass > 0, resid / mass.clamp_min(1e-300), p)
    reject = (q * (1 - accept)).sum(-1, keepdim=True)  # P(the draft is rejected)
    law = q * accept + reject * resid
    torch.testing.assert_close(law, p, rtol=0, atol=1e-12)
    torch.testing.assert_close(reject.squeeze(-1), 1 - torch.minimum(p, q).sum(-1), rtol=0, atol=1e-12)


def test_accept_sampling_is_the_rule_draw_for_draw():
    B, k, V = 300, 3, 12
    g = torch.Generator().manual_seed(1)
    target = 2 * torch.randn(B, k + 1, V, generator=g)
    draft_logits = 2 * torch.randn(B, k, V, generator=g)
    draft_logits[:50, :, :4] = -torch.inf  # tokens the drafter never proposes
    q = torch.softmax(draft_logits, -1)
    draft_ids = torch.multinomial(q.flatten(0, 1), 1, generator=g).view(B, k)
    draft_ids[:40] = target[:40, :k].argmax(-1)  # rows that pass more drafts
    seeds = list(range(100, 100 + B))
    tokens, logprobs, n_acc = accept_sampling(
        target, draft_ids, draft_logits, 1.0, 1.0, [torch.Generator().manual_seed(s) for s in seeds]
    )
    logp = sampling_logprobs(target, 1.0, 1.0)
    p = logp.exp()
    tiny = torch.finfo(torch.float32).tiny
    for b, seed in enumerate(seeds):
        gb = torch.Generator().manual_seed(seed)
        u = torch.rand(k, generator=gb)
        noise = torch.empty(V).exponential_(generator=gb)
        n = 0
        while n < k and u[n] * q[b, n, draft_ids[b, n]] < p[b, n, draft_ids[b, n]]:
            n += 1
        q_last = q[b, n] if n < k else torch.zeros(V)
        resid = (p[b, n] - q_last).clamp_min(0)
        mass = resid.sum()
        resid = resid / mass.clamp_min(tiny) if mass > 0 else p[b, n]
        last = int((resid / noise.clamp_min(tiny)).argmax())
        want = draft_ids[b, :n].tolist() + [last]
        assert int(n_acc[b]) == n, f"row {b}"
        assert tokens[b, : n + 1].tolist() == want, f"row {b}"
        assert bool((tokens[b, n + 1 :] == -1).all())
        assert torch.equal(logprobs[b, : n + 1], logp[b, torch.arange(n + 1), torch.tensor(want)])
    assert 0 < int((n_acc == 0).sum()) and 0 < int((n_acc == k).sum())  # both ends were exercised
