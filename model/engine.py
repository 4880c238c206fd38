"""Session-based inference over `Transformer.forward_incremental`: token ids in, token ids out.

A session is one conversation's token list and its `ModelCache`. Its tokens are exactly what it was
given and what it generated (`start` prompt + generated + `extend`ed ids, in order): the engine never
re-tokenises text, and every generated token carries its sampling log-prob (model/sampling.py) and
the policy version of the weights that produced it (DESIGN §3.1).

Batching policy (correctness first). `forward_incremental` takes rows that share `start_pos`, so
every prefill or decode step groups the sessions it advances by (tokens already cached, tokens fed
now, cache tensor shapes); each group is one batched call (session caches concatenated on the batch
dim and split back afterwards), and a session alone in its group steps alone. Sessions started from
prompts of equal length (a GRPO group) thus prefill and decode as one batch until they finish.
Results do not depend on the grouping (each session samples from its own generator).

Feeding is lazy: `start`/`extend` only record tokens; the next `prefill`/`generate` feeds them (in
chunks of `prefill_chunk`). The last generated token is fed when the session next advances.
Not here: CED prefill, prefix-cache tiers, DSpark speculation, packed cache storage (the caches hold
the dense fake-quantised tensors of attention.py; `cache_bytes` reports their packed size).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from model.attention import LayerCache
from model.chat_template import ChatTemplate
from model.engram import EngramHasher
from model.packed_cache import model_cache_bytes
from model.sampling import sample
from model.tokenizer import Tokenizer
from model.transformer import ModelCache, Transformer, make_engram_inputs

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
class _Session:
    token_ids: list[int]
    cache: ModelCache
    # logits [V] fp32 of the next token, valid when every token has been fed (cache.seq_len == len)
    next_logits: torch.Tensor | None = None
    next_version: int = 0  # policy version of the weights that computed next_logits
    versions: list[int | None] = field(default_factory=list)  # per token; None = not generated

    @property
    def n_unfed(self) -> int:
        return len(self.token_ids) - self.cache.seq_len


class InferenceEngine:
    """Sessions over one model. `template` (or a bare Tokenizer) supplies the default stop ids
    (`ChatTemplate.stop_ids`) and the decoder of `Generation.text`; None disables both."""

    def __init__(
        self,
        model: Transformer,
        template: ChatTemplate | Tokenizer | None = None,
        *,
        max_sessions: int = 64,
        device: str | torch.device = "cpu",
        max_seq_len: int | None = None,
        prefill_chunk: int = 512,
    ):
        self.device = torch.device(device)
        self.model = model.to(self.device).eval()
        self.tokenizer = template.tokenizer if isinstance(template, ChatTemplate) else template
        self.default_stop_ids: tuple[int, ...] = template.stop_ids if isinstance(template, ChatTemplate) else ()
        self.max_sessions = max_sessions
        self.max_seq_len = max_seq_len or model.args.max_seq_len
        self.prefill_chunk = prefill_chunk
        self.policy_version = 0
        # Engram layers hash n-grams of token ids: the model's own hasher reads the context from the
        # cache; without one, the engine hashes with its tokenizer, context from the session's tokens.
        self._hasher = None
        if model.args.engram_layer_ids and model.engram_hasher is None:
            if self.tokenizer is None:
                raise ValueError("a model with Engram layers needs an engram_hasher or a tokenizer to build one")
            self._hasher = EngramHasher(model.args, self.tokenizer)
        self._sessions: dict[int, _Session] = {}
        # model calls made, tokens fed (rows x positions), tokens generated: for benches and tests
        self.stats = {"forward_calls": 0, "tokens_fed": 0, "tokens_generated": 0}
        self._next_id = 0

    # ------------------------------------------------------------------ weights
    def load_state_dict(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        """Load new policy weights (strict); tokens sampled from logits computed after this call carry
        `version`. Open sessions keep the caches computed under earlier versions (in-flight generation
        continues, AReaL-style), and a session whose next-token logits were already computed samples
        that one token from them, stamped with their older version; close and restart a session to
        recompute its prompt under the new weights."""
        self.model.load_state_dict(weights)
        self.policy_version = version

    # ------------------------------------------------------------------ sessions
    def start(self, prompt_ids: Sequence[int]) -> int:
        """Open a session on `prompt_ids` (fed lazily, by the next prefill/generate)."""
        if len(self._sessions) >= self.max_sessions:
            raise RuntimeError(f"max_sessions ({self.max_sessions}) sessions are open; close one first")
        if not prompt_ids:
            raise ValueError("a session needs at least one prompt token")
        sid, self._next_id = self._next_id, self._next_id + 1
        self._sessions[sid] = _Session([], ModelCache())
        self.extend(sid, prompt_ids)
        return sid

    def extend(self, session_id: int, new_ids: Sequence[int]) -> None:
        """Append ids (tool results, a new user turn) to a session; they are prefilled into its
        cache by the next prefill/generate, after any generated token not fed yet."""
        s = self._get(session_id)
        ids = [int(t) for t in new_ids]
        if len(s.token_ids) + len(ids) > self.max_seq_len:
            raise ValueError(f"session {session_id} would exceed max_seq_len {self.max_seq_len}")
        if any(not 0 <= t < self.model.args.vocab_size for t in ids):
            raise ValueError(f"token ids outside the vocabulary (size {self.model.args.vocab_size})")
        s.token_ids += ids
        s.versions += [None] * len(ids)
        s.next_logits = None

    def close(self, session_id: int) -> None:
        del self._sessions[self._check_id(session_id)]

    def tokens(self, session_id: int) -> list[int]:
        """The session's full token list: prompt + generated + extended ids, in order."""
        return list(self._get(session_id).token_ids)

    def token_versions(self, session_id: int) -> list[int | None]:
        """Per token of `tokens`: the policy version that generated it, None for given tokens."""
        return list(self._get(session_id).versions)

    def cache_bytes(self, session_id: int) -> dict[str, int]:
        """Bytes of the session's caches in the packed format (model.packed_cache.model_cache_bytes)."""
        return model_cache_bytes(self._get(session_id).cache, self.model.args)

    def cache(self, session_id: int) -> ModelCache:
        """The session's ModelCache, for inspection only (the engine replaces it when batching)."""
        return self._get(session_id).cache

    @property
    def session_ids(self) -> list[int]:
        return list(self._sessions)

    def _check_id(self, session_id: int) -> int:
        if session_id not in self._sessions:
            raise KeyError(f"no open session {session_id}")
        return session_id

    def _get(self, session_id: int) -> _Session:
        return self._sessions[self._check_id(session_id)]

    # ------------------------------------------------------------------ prefill / forward
    def prefill(self, session_ids: Sequence[int] | None = None) -> int:
        """Feed every recorded but unfed token of the sessions (all by default); returns how many."""
        sessions = [self._get(i) for i in (self.session_ids if session_ids is None else session_ids)]
        n = sum(s.n_unfed for s in sessions)
        self._feed(sessions)
        return n

    def _feed(self, sessions: Sequence[_Session]) -> None:
        todo = [s for s in sessions if s.n_unfed > 0]
        while todo:
            groups: dict[tuple, list[_Session]] = {}
            for s in todo:
                n = min(s.n_unfed, self.prefill_chunk)
                groups.setdefault((s.cache.seq_len, n, _signature(s.cache)), []).append(s)
            for (_, n, _), group in groups.items():
                self._forward(group, n)
            todo = [s for s in todo if s.n_unfed > 0]

    @torch.inference_mode()
    def _forward(self, group: list[_Session], n: int) -> None:
        """Feed the next `n` unfed tokens of every session of `group` (all at one position)."""
        start = group[0].cache.seq_len
        ids = torch.tensor([s.token_ids[start : start + n] for s in group], dtype=torch.long, device=self.device)
        cache = group[0].cache if len(group) == 1 else _stack([s.cache for s in group])
        engram_inputs = None
        if self._hasher is not None:
            c = min(start, self.model.args.engram_max_ngram_size - 1)
            context_ids = torch.tensor([s.token_ids[start - c : start] for s in group]) if c else None
            engram_inputs = make_engram_inputs(self._hasher, ids, context_ids=context_ids)
        logits_BSV = self.model.forward_incremental(ids, start, cache, engram_inputs=engram_inputs)
        self.stats["forward_calls"] += 1
        self.stats["tokens_fed"] += ids.numel()
        if len(group) > 1:
            for i, s in enumerate(group):
                s.cache = _row(cache, i)
        for i, s in enumerate(group):
            s.next_logits = logits_BSV[i, -1].clone() if s.n_unfed == 0 else None
            s.next_version = self.policy_version

    # ------------------------------------------------------------------ generation
    def generate(
        self,
        session_ids: Sequence[int],
        max_new_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        stop_ids: Sequence[int] | None = None,
        stop_strings: Sequence[str] = (),
        seed: int | Sequence[int] | None = None,
    ) -> list[Generation]:
        """Generate up to `max_new_tokens` per session, all sessions advancing together.

        A session stops at the first generated id in `stop_ids` (default: the template's stop ids;
        pass () for none) or once its decoded generated text contains a stop string; the stopping
        token is kept. Sampling per `model.sampling.sample`; `seed` is one int per session or one int
        from which session k of this call derives its own generator, so a session's draws do not
        depend on which other sessions share the call (None: seeds from torch's global RNG).
        """
        if len(set(session_ids)) != len(session_ids):
            raise ValueError("a session may appear only once per generate call")
        if stop_strings and self.tokenizer is None:
            raise ValueError("stop_strings need a tokenizer")
        sessions = [self._get(i) for i in session_ids]
        stops = set(self.default_stop_ids if stop_ids is None else stop_ids)
        gens = self._generators(seed, len(sessions))
        outs = [Generation([], [], "length", "", [], len(s.token_ids)) for s in sessions]
        active = [i for i, s in enumerate(sessions) if len(s.token_ids) < self.max_seq_len and max_new_tokens > 0]
        self._feed([sessions[i] for i in active])
        while active:
            logits_BV = torch.stack([sessions[i].next_logits for i in active])
            token_B, logprob_B = sample(logits_BV, temperature, top_p, [gens[i] for i in active])
            self.stats["tokens_generated"] += len(active)
            still = []
            for i, tok, lp in zip(active, token_B.tolist(), logprob_B.tolist()):
                s, out = sessions[i], outs[i]
                s.token_ids.append(tok)
                s.versions.append(s.next_version)
                s.next_logits = None
                out.token_ids.append(tok)
                out.logprobs.append(lp)
                out.policy_versions.append(s.next_version)
                if stop_strings:
                    out.text = self.tokenizer.decode(out.token_ids)
                hit = tok if tok in stops else next((x for x in stop_strings if x in out.text), None)
                if hit is not None:
                    out.finish_reason, out.stop = "stop", hit
                elif len(out.token_ids) < max_new_tokens and len(s.token_ids) < self.max_seq_len:
                    still.append(i)
            active = still
            self._feed([sessions[i] for i in active])
        if self.tokenizer is not None:
            for out in outs:
                out.text = self.tokenizer.decode(out.token_ids)
        return outs

    def _generators(self, seed: int | Sequence[int] | None, n: int) -> list[torch.Generator]:
        if seed is None:
            seeds = torch.randint(2**62, (n,)).tolist()
        elif isinstance(seed, int):
            seeds = [(seed * 1_000_003 + k) % 2**63 for k in range(n)]
        else:
            seeds = [int(x) for x in seed]
            if len(seeds) != n:
                raise ValueError(f"{len(seeds)} seeds for {n} sessions")
        return [torch.Generator(device=self.device).manual_seed(x) for x in seeds]


# ---------------------------------------------------------------------------- batching caches
# Caches are dataclasses (ModelCache, LayerCache, ...) whose tensors all have the batch dim first.
# Rows of equal signature stack field by field; a field of a type not known here (e.g. a DSpark
# cache once allocated) makes the cache unique, so it is never batched, only stepped alone.
_STACKABLE = (ModelCache, LayerCache)


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


__all__ = ["FinishReason", "Generation", "InferenceEngine"]
