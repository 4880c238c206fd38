"""What an `InferenceEngine` (model/engine.py) keeps per session and returns per `generate` call:
`Session` (a conversation's token list, its `ModelCache`, the next token's logits, per-token policy
versions, speculative statistics and DSpark context, recorded routing) and `Generation` (one session's
output of one call). Plain records with the few helpers that keep the DSpark context; not here: feeding,
batching or sampling (model/engine.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from model.speculative import SpecStats
from model.transformer import ModelCache

FinishReason = Literal["stop", "length"]


@dataclass
class Generation:
    """One session's output of one `generate` call.

    token_ids/logprobs/policy_versions: one entry per generated token (the stop token included);
    logprobs are under the distribution the token was drawn from (see `model.sampling.sample`).
    finish_reason: "stop" (a stop id or stop string, given in `stop`) or "length" (max_new_tokens
    or the engine's max_seq_len). text: the decoded generated ids, special tokens kept ("" without a
    tokenizer); it is never re-encoded. prompt_len: the session's length before this generation
    (the turn boundary a trajectory records)."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    text: str
    policy_versions: list[int]
    prompt_len: int
    stop: int | str | None = None


@dataclass
class Session:
    """One conversation in an engine: its tokens (prompt, generated, extended, in order) and cache."""

    token_ids: list[int]
    cache: ModelCache
    # logits [V] fp32 of the next token, valid when every token has been fed (cache.seq_len == len)
    next_logits: torch.Tensor | None = None
    next_version: int = 0  # policy version of the weights that computed next_logits
    versions: list[int | None] = field(default_factory=list)  # per token; None = not generated
    # speculative engines: the session's acceptance statistics, and (`main_hidden`) the DSpark context
    # [1,n,X] of the newest fed tokens (ends at cache.seq_len) that the drafter has not consumed yet:
    # `_hidden`, then the decode steps' rows `_steps` ((step output [B,1,X], row) each) not joined yet
    spec: SpecStats = field(default_factory=SpecStats)
    # record_routing engines: [n, n_layers, K] int32 blocks of the fed tokens' experts, in token order
    routing: list[torch.Tensor] = field(default_factory=list)
    _hidden: torch.Tensor | None = None
    _steps: list[tuple[torch.Tensor, int]] = field(default_factory=list)
    _keep: int = 0

    @property
    def n_unfed(self) -> int:
        return len(self.token_ids) - self.cache.seq_len

    @property
    def main_hidden(self) -> torch.Tensor | None:
        if self._steps:  # joined when read: one cat per session then, not one per decode step
            parts = [] if self._hidden is None else [self._hidden]
            h = torch.cat(parts + [out[b : b + 1] for out, b in self._steps], dim=1)
            self._hidden, self._steps = h[:, max(0, h.size(1) - self._keep) :], []
        return self._hidden

    @main_hidden.setter
    def main_hidden(self, value: torch.Tensor | None) -> None:
        self._hidden, self._steps = value, []

    def drop_step(self) -> None:
        """Forget the newest decode step's DSpark context (a step rolled back), if it was stashed (a
        speculative engine's steps; nothing reads main_hidden between a step and its rollback, so the
        step is still in `_steps`)."""
        if self._steps:
            self._steps.pop()

    def stash_step(self, out_BSX: torch.Tensor, row: int, keep: int) -> None:
        """A decode step's context (row `row` of its [B,1,X] output) appended, kept to `keep` tokens."""
        self._steps.append((out_BSX, row))
        self._keep = keep
        if len(self._steps) >= keep:  # the steps alone fill the context: older entries are gone
            del self._steps[: len(self._steps) - keep]
            self._hidden = None
