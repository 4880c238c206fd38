"""Next-token sampling from fp32 logits: greedy, temperature and top-p, with the log-prob of the draw.

The log-prob returned with a sampled token is taken under the distribution it was ACTUALLY drawn
from (temperature-scaled, top-p-truncated and renormalised), because RL's behaviour log-probs μ must
be the sampler's, not the model's (DESIGN §3.1). Draws are deterministic given torch.Generators; with
one generator per row, a row's draw does not depend on which other rows share the batch.
Not here: the decode loop and stop conditions (model/engine.py), speculative verification.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

Generators = torch.Generator | Sequence[torch.Generator] | None


def _check(temperature: float, top_p: float) -> None:
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


def sampling_logprobs(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """log q [B,V] fp32 of the distribution `sample` draws from at temperature > 0.

    q = softmax(logits / T) restricted to the nucleus and renormalised. The nucleus is the shortest
    prefix of the tokens sorted by probability (descending; equal probabilities in ascending id
    order, a stable sort) whose mass reaches `top_p`: token i of that order is kept iff the mass of
    the tokens before it is < top_p, so the most likely token is always kept. Tokens outside get
    -inf. top_p = 1 keeps every token (no sort is done).
    """
    _check(temperature, top_p)
    if temperature == 0:
        raise ValueError("temperature 0 is greedy: there is no sampling distribution to return")
    z_BV = logits.float() / temperature
    if top_p < 1.0:
        p_BV = torch.softmax(z_BV, dim=-1)
        p_sorted, order = torch.sort(p_BV, dim=-1, descending=True, stable=True)
        mass_before = torch.cumsum(p_sorted, dim=-1) - p_sorted
        drop_sorted = mass_before >= top_p
        drop_sorted[..., 0] = False
        drop_BV = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        z_BV = z_BV.masked_fill(drop_BV, -torch.inf)
    return torch.log_softmax(z_BV, dim=-1)


def _exponential_noise(shape: torch.Size, device: torch.device, generator: Generators) -> torch.Tensor:
    """i.i.d. Exp(1) [B,V]; row b from generator[b] when a sequence is given."""
    if generator is None or isinstance(generator, torch.Generator):
        return torch.empty(shape, device=device).exponential_(generator=generator)
    if len(generator) != shape[0]:
        raise ValueError(f"{len(generator)} generators for {shape[0]} rows")
    # each row filled in place from its own generator: a contiguous row of V draws consumes the
    # generator as a fresh [V] tensor would (same numel, same kernel), without a [B,V] stack copy. The
    # B draws stay B calls: torch has no op drawing rows from several generators' streams.
    out = torch.empty(shape, device=device)
    for row, g in zip(out, generator):
        row.exponential_(generator=g)
    return out


def sample(
    logits: torch.Tensor,
    temperature: float,
    top_p: float = 1.0,
    generator: Generators = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row of `logits` [B,V]. Returns (token_ids [B] int64, logprobs [B] fp32).

    temperature == 0: greedy argmax (lowest id on ties), nothing is drawn and `top_p` is ignored.
      The sampling distribution is then a point mass, so the returned log-prob is instead the
      MODEL's log-prob `log_softmax(logits)[token]` (temperature 1, no truncation): what evaluation
      and teacher-forcing comparisons need. Greedy draws are not for importance-weighted RL.
    temperature > 0: token ~ q = exp(sampling_logprobs(logits, temperature, top_p)), drawn as
      argmax(q / E) with E ~ i.i.d. Exp(1) (the exponential race, equivalent to Gumbel-max: the
      reference `sample`, model_reference §3.13); the returned log-prob is log q[token], i.e. under
      the temperature-scaled, nucleus-renormalised distribution the token was actually drawn from.
    `generator`: one torch.Generator for the whole batch, or one per row (row b's noise then comes
    from generator[b] alone, so it is the same whatever other rows are in the batch).
    """
    _check(temperature, top_p)
    if temperature == 0:
        logp_BV = torch.log_softmax(logits.float(), dim=-1)
        token_B = logits.argmax(dim=-1)
        return token_B, logp_BV.gather(-1, token_B[:, None]).squeeze(-1)
    logq_BV = sampling_logprobs(logits, temperature, top_p)
    noise_BV = _exponential_noise(logq_BV.shape, logq_BV.device, generator)
    # q / E, with E floored so an exact 0 draw cannot make 0/0; excluded tokens have q = 0 and
    # can never win against a kept token (q > 0).
    token_B = (logq_BV.exp() / noise_BV.clamp_min(torch.finfo(torch.float32).tiny)).argmax(dim=-1)
    return token_B, logq_BV.gather(-1, token_B[:, None]).squeeze(-1)


__all__ = ["sample", "sampling_logprobs"]
