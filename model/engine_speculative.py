"""DSpark speculative decoding for `InferenceEngine` (model/engine.py): `generate_speculative`, its
cost model per graph bucket and the switch that turns speculation off where it cannot win.

A mixin of the engine: its methods run on the engine's sessions, caches and plain decode path
(`generate`, `_feed`, `_scan`, `_commit`). The draft-verify-accept step itself, the cost model and the
drafter's context are model/speculative.py. Verification batches the sessions at one position and cache
layout: their caches are stacked field by field for the verify forward and split back after it.
Not here: plain decoding, prefill, sessions (model/engine.py).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from model.attention import LayerCache
from model.dspark import DSparkCache
from model.ragged_cache import GRAPH_BUCKETS, RaggedBatch, engram_rows
from model.sampling import sample
from model.speculative import CostModel, grouped_speedup, measure_cost_model, speculative_step, sync_drafter
from model.transformer import ModelCache, make_engram_inputs

if TYPE_CHECKING:
    from model.engine_session import Generation


class SpeculativeDecoding:
    """`InferenceEngine.generate_speculative` and what it needs beyond the plain engine."""

    def generate_speculative(
        self,
        session_ids: Sequence[int],
        max_new_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        stop_ids: Sequence[int] | None = None,
        stop_strings: Sequence[str] = (),
        seed: int | Sequence[int] | None = None,
        admit: Callable[[], Sequence[tuple[int, int | None]]] | None = None,
        on_finish: Callable[[int, Generation], None] | None = None,
    ) -> list[Generation]:
        """`generate` with DSpark speculative decoding (model/speculative.py): same arguments, same
        contract, except that `admit` and `on_finish` (continuous batching) apply only to a call that
        runs as plain `generate` (speculation off, below): a speculative call admits no session and
        returns every result at its end. Greedy output is token for token `generate`'s; sampled output has the same
        distribution and log-probs under it, but not the same draws (speculation consumes randomness
        differently, and a row's draws depend on the rows it is batched with).

        The first token of a call is sampled from the prefill logits as in `generate`. Then each step
        takes the sessions at one position (one batch), drafts, verifies anchor + k drafts in one
        forward and accepts; every row that goes on keeps the shortest emitted length among the rows
        that go on (rows of one forward share start_pos), so a group stays one batch. Rows that stop
        keep their tokens up to the stop. Statistics: `speculation_stats`.

        Speculation switches itself off for the call when it cannot win: if the batch's cost model
        (`speculation_cost`, which times the engine's plain decode, CUDA graphs included) says that
        even with every draft accepted a speculative step emits fewer tokens per second than a plain
        decode step (`grouped_speedup` below `min_speedup`: verification runs one forward per position
        among the sessions, plain decoding one for all), or the last speculative call lost
        to plain decoding within the last `off_calls` calls (`SpeculativeConfig.off_calls`), the call
        is `generate` with the same arguments (counted in stats["speculation_off_calls"]). Inside a
        call, once no session drafts (each one's own switch is off, `SpecStats.off_for`) and no stop
        strings are given, the call's remaining tokens come from `generate` (the engine's plain
        decode, CUDA graphs included, not the speculative path's eager one-token forwards)."""
        if self.speculative is None:
            raise ValueError("build the engine with speculative=SpeculativeConfig() to decode speculatively")
        if len(set(session_ids)) != len(session_ids):
            raise ValueError("a session may appear only once per generate call")
        live = [len(self._get(i).token_ids) for i in session_ids if len(self._get(i).token_ids) < self.max_seq_len]
        if live and max_new_tokens > 1 and not self._speculation_pays(len(live), len(set(live))):
            self.stats["speculation_off_calls"] += 1
            for i in session_ids:
                self._get(i).spec.off_calls += 1
            return self.generate(session_ids, max_new_tokens, temperature, top_p, stop_ids, stop_strings, seed,
                                 admit=admit, on_finish=on_finish)  # fmt: skip
        self._spec_call = [0.0, 0.0]
        if stop_strings and self.tokenizer is None:
            raise ValueError("stop_strings need a tokenizer")
        sessions = [self._get(i) for i in session_ids]
        stops = set(self.default_stop_ids if stop_ids is None else stop_ids)
        gens = self._generators(seed, len(sessions))
        outs = [self._new_generation(s) for s in sessions]
        active = [i for i, s in enumerate(sessions) if len(s.token_ids) < self.max_seq_len and max_new_tokens > 0]
        self._feed([sessions[i] for i in active])
        limits = (stops, tuple(stop_strings), max_new_tokens)
        if active:  # first token: from the prefill logits, as `generate`
            logits_BV = torch.stack([sessions[i].next_logits for i in active])
            token_B, logprob_B = sample(logits_BV, temperature, top_p, [gens[i] for i in active])
            self.stats["tokens_generated"] += len(active)
            still = []
            for i, tok, lp in zip(active, token_B.tolist(), logprob_B.tolist()):
                _, finish = self._scan(sessions[i], outs[i], [tok], *limits)
                self._commit(sessions[i], outs[i], [tok], [lp], sessions[i].next_version, finish)
                still += [] if finish else [i]
            active = still
        while active:
            if not stop_strings and all(sessions[i].spec.off_for > 0 for i in active):
                self._finish_plain(session_ids, sessions, outs, gens, active, max_new_tokens, temperature, top_p,
                                   stops)  # fmt: skip
                break
            groups: dict[tuple, list[int]] = {}
            for i in active:
                s = sessions[i]
                n_hidden = None if s.main_hidden is None else s.main_hidden.size(1)
                groups.setdefault((s.cache.seq_len, _signature(s.cache), n_hidden), []).append(i)
            active = []
            for idx in groups.values():
                active += self._speculative_group(idx, sessions, outs, gens, temperature, top_p, limits)
        kept, plain_equiv = self._spec_call
        if plain_equiv and kept < self.speculative.min_speedup * plain_equiv:
            self._spec_calls_off = self.speculative.off_calls
        if self.tokenizer is not None:
            for out in outs:
                out.text = self.tokenizer.decode(out.token_ids)
        return outs

    def _speculation_pays(self, batch: int, n_positions: int = 1) -> bool:
        """Whether a call of `batch` rows at `n_positions` different positions speculates: fully accepted
        drafts can beat the plain decode step (the cost model; verification runs one forward per
        position, plain decoding one for all rows: `grouped_speedup`), and no recent speculative call
        lost to plain decoding."""
        cost = self.speculation_cost(batch)
        one_row = self.speculation_cost(1) if n_positions > 1 else cost
        if grouped_speedup(cost, one_row, n_positions) < self.speculative.min_speedup:
            return False
        if self._spec_calls_off > 0:
            self._spec_calls_off -= 1
            return False
        return True

    def _finish_plain(self, session_ids, sessions, outs, gens, active, max_new_tokens, temperature, top_p,
                      stops) -> None:  # fmt: skip
        """The remaining tokens of a speculative call's `active` sessions, none of which drafts, from
        `generate` (one call per count of tokens left), appended to their Generations. Their drafting
        switches are reset: the plain tokens stand for the plain steps they were waiting out. Each
        session's generator seeds its part, so the call stays a function of its seeds."""
        by_left: dict[int, list[int]] = {}
        for i in active:
            by_left.setdefault(max_new_tokens - len(outs[i].token_ids), []).append(i)
        for left, idx in by_left.items():
            seeds = [int(torch.randint(2**62, (1,), generator=gens[i], device=gens[i].device)) for i in idx]
            # the turn goes on: each session lacks only a token it generated, which `generate` feeds with a
            # decode step, not a CED replay segment in mid-turn (the learner's simulated replay has one per turn)
            rest = self.generate([session_ids[i] for i in idx], left, temperature, top_p, tuple(stops), (), seeds)
            for i, g in zip(idx, rest):
                out = outs[i]
                out.token_ids += g.token_ids
                out.logprobs += g.logprobs
                out.policy_versions += g.policy_versions
                out.finish_reason, out.stop = g.finish_reason, g.stop
                sessions[i].spec.off_for = 0

    def speculation_stats(self, session_id: int) -> dict:
        """The session's acceptance statistics (model.speculative.SpecStats.as_dict)."""
        return self._get(session_id).spec.as_dict()

    def speculation_cost(self, batch: int) -> CostModel:
        """The cost model of `batch` rows: the config's, else measured on this device once and cached.
        One model, measured at a graph bucket's rows, serves every batch of the bucket: a measurement
        takes seconds of eager forwards (on CPU too, where rollouts' batch sizes change every call);
        with CUDA graphs t_plain is a graph decode step of the bucket (`_plain_step_time`), which runs
        the padded bucket."""
        if self.speculative.cost is not None:
            return self.speculative.cost
        buckets = GRAPH_BUCKETS if self.graphs is None else self.graphs.buckets
        batch = next((b for b in buckets if b >= batch), batch)
        if batch not in self._spec_costs:
            cost = measure_cost_model(self.model, self._verify_forward, batch, self._max_rollback, device=self.device)
            if self.graphs is not None:
                cost.t_plain = self._plain_step_time(batch)
            self._spec_costs[batch] = cost
        return self._spec_costs[batch]

    @torch.no_grad()
    def _plain_step_time(self, batch: int, repeats: int = 5) -> float:
        """Seconds of one `RaggedBatch.decode` step of `batch` rows on this engine's decode path (its
        CUDA graphs and compiled forward) after a window of random context: the median of `repeats`
        steps after one that captures (and compiles) the bucket. Not under inference_mode: the timed
        batch's tensors become the GraphPool storage of its layout, and a later `generate` batch of
        that layout copies into them outside inference mode, which inference tensors refuse."""
        a, dev = self.model.args, self.device
        n = a.window_size + self._max_rollback + 1
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, a.vocab_size, (batch, n + repeats + 1), generator=g).tolist()
        max_tokens = self._bank_tokens(n + repeats + 1)  # as the engine's own decode batches size them
        hasher = self.ngram_hasher

        def engram(pos: list[int], step: list[list[int]]) -> dict | None:
            if not a.engram_layer_ids:
                return None
            return engram_rows(hasher, ids, pos, step, a.engram_max_ngram_size - 1, dev)

        pre = RaggedBatch(self.model, [self._new_cache() for _ in range(batch)], max_tokens)
        pre.step([row[:n] for row in ids], engram(pre.pos, [row[:n] for row in ids]))
        caches = pre.split()
        rows = RaggedBatch(self.model, caches, max_tokens, pool=self.graphs, forward=self._decode_forward,
                           hasher=hasher)  # fmt: skip
        times = []
        try:
            for r in range(repeats + 1):
                step = [row[n + r] for row in ids]
                _sync(dev)
                t0 = time.perf_counter()
                rows.decode(step, return_main_hidden=True)
                _sync(dev)
                times.append(time.perf_counter() - t0)
        finally:
            rows.split()
        return sorted(times[1:])[repeats // 2]

    @torch.inference_mode()
    def _speculative_group(self, idx, sessions, outs, gens, temperature, top_p, limits) -> list[int]:
        """One draft-verify-accept step of sessions `idx` (same position and cache layout); returns
        the indices that go on."""
        cfg, group = self.speculative, [sessions[i] for i in idx]
        p, B = group[0].cache.seq_len, len(group)
        max_new = limits[2]
        room = min(min(max_new - len(outs[i].token_ids), self.max_seq_len - len(sessions[i].token_ids)) for i in idx)
        drafting = any(s.spec.off_for == 0 for s in group) and group[0].main_hidden is not None
        k_max = min(self._max_rollback, room - 1) if drafting else 0
        cache = group[0].cache if B == 1 else _stack([s.cache for s in group])
        hidden = None
        if k_max > 0:
            hidden = sync_drafter(cache, torch.cat([s.main_hidden for s in group]))
        cost = self.speculation_cost(B)
        c = min(p, self.model.args.engram_max_ngram_size - 1) if self._hasher is not None else 0
        with self._recording() as record:
            res = speculative_step(
                self.model, self._verify_forward, cache,
            torch.tensor([s.token_ids[p] for s in group], device=self.device),
                torch.tensor([s.token_ids[p - c : p] for s in group], dtype=torch.long),
                hidden, k_max=k_max, cost=cost, temperature=temperature, top_p=top_p,
                generators=[gens[i] for i in idx],
            )  # fmt: skip
        # the verify forward's routing (the drafter's MoE stages have other layer ids)
        routing = None if record is None else self._routing_BSLK(record, range(self.model.args.n_layers))
        if B > 1:
            for b, s in enumerate(group):
                s.cache = _row(cache, b)
        tokens, logprobs = res.tokens.tolist(), res.logprobs.tolist()
        emitted = [tokens[b][: int(res.n_accepted[b]) + 1] for b in range(B)]
        scans = [self._scan(sessions[i], outs[i], emitted[b], *limits) for b, i in enumerate(idx)]
        going_on = [n for n, finish in scans if finish is None]
        m = min(going_on) if going_on else 0
        still, t_plain, n_kept = [], cost.plain_time, 0  # against the engine's plain decode
        step_time = cost.t_verify[res.k] + (cost.t_draft if k_max > 0 else 0.0)  # a draft is paid even for k = 0
        for b, (i, s) in enumerate(zip(idx, group)):
            n, finish = scans[b]
            keep = m if finish is None else n
            n_kept += keep
            self._commit(s, outs[i], emitted[b][:keep], logprobs[b][:keep], self.policy_version, finish)
            s.cache.truncate(p + keep)
            if routing is not None:  # the anchor and the kept tokens were fed; the rest is rolled back
                s.routing.append(routing[b, :keep])
            if k_max > 0:  # the drafter consumed the pending context; the kept tokens' is next
                s.main_hidden = None
            self._stash_hidden(s, res.main_hidden[b : b + 1, :keep])
            s.spec.record(res.k, k_max > 0, int(res.n_accepted[b]), keep, keep * t_plain / step_time, cfg)
            still += [] if finish else [i]
        self._spec_call[0] += n_kept
        self._spec_call[1] += B * step_time / t_plain  # tokens B plain steps would emit in this step's time
        self.stats["forward_calls"] += 1
        self.stats["tokens_fed"] += B * (res.k + 1)
        self.stats["tokens_generated"] += n_kept
        return still

    def _verify_forward(self, ids: torch.Tensor, cache: ModelCache, context_ids: torch.Tensor):
        """speculative.Forward: forward_incremental at cache.seq_len with the Engram context."""
        engram_inputs = None
        if self._hasher is not None:
            ctx = context_ids.cpu() if context_ids.size(1) else None
            engram_inputs = make_engram_inputs(self._hasher, ids, context_ids=ctx)
        return self.model.forward_incremental(
            ids, cache.seq_len, cache, engram_inputs=engram_inputs, return_main_hidden=True
        )  # fmt: skip

    def _stash_hidden(self, s, hidden: torch.Tensor) -> None:
        """Append the DSpark context of newly fed tokens to the session's pending context, keeping
        what an exact draft needs (model.speculative.sync_drafter)."""
        if s.main_hidden is not None:
            hidden = torch.cat([s.main_hidden, hidden], dim=1)
        keep = self.model.args.window_size + self._max_rollback
        s.main_hidden = hidden[:, max(0, hidden.size(1) - keep) :]


# Caches are dataclasses (ModelCache, LayerCache, ...) whose tensors all have the batch dim first.
# Rows of equal signature stack field by field; a field of a type not known here makes the cache
# unique, so it is never batched, only stepped alone.
_STACKABLE = (ModelCache, LayerCache, DSparkCache)


def _fields(obj) -> dict:
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


def _signature(v) -> object:
    """Everything but the batch dim: equal signatures (and seq_len) can be the rows of one call."""
    if isinstance(v, torch.Tensor):
        return ("tensor", v.dtype, tuple(v.shape[1:]))
    if isinstance(v, list):
        return ("list", *(_signature(x) for x in v))
    if dataclasses.is_dataclass(v) and type(v) in _STACKABLE:
        return (type(v).__name__, *((k, _signature(x)) for k, x in _fields(v).items()))
    if v is None or isinstance(v, (int, float, str, bool)):
        return v
    return ("unique", id(v))


def _stack(values: list):
    v = values[0]
    if isinstance(v, torch.Tensor):
        return torch.cat(values, dim=0)
    if isinstance(v, list):
        return [_stack([x[j] for x in values]) for j in range(len(v))]
    if dataclasses.is_dataclass(v):
        return type(v)(**{k: _stack([getattr(x, k) for x in values]) for k in _fields(v)})
    return v


def _row(v, row: int):
    """Row `row` of a batched value, owning its memory (a view would pin the whole batch)."""
    if isinstance(v, torch.Tensor):
        return v[row : row + 1].clone()
    if isinstance(v, list):
        return [_row(x, row) for x in v]
    if dataclasses.is_dataclass(v):
        return type(v)(**{k: _row(x, row) for k, x in _fields(v).items()})
    return v


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


__all__ = ["SpeculativeDecoding"]
