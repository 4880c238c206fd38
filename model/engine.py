"""Session-based inference over `Transformer.forward_ragged` (`forward_incremental` for CED prefill
and speculative verification): token ids in, token ids out.

A session (`Session`, model/engine_session.py) is one conversation's token list and its `ModelCache`.
Its tokens are exactly what it was given and what it generated (`start` prompt + generated +
`extend`ed ids, in order): the engine never re-tokenises text, and every generated token carries its
sampling log-prob (model/sampling.py) and the policy version of the weights that produced it
(DESIGN §3.1).

Batching policy: one forward for all sessions, each at its own position. Prompts (what a prefill or
the start of a generate call feeds) are fed in ragged steps of up to `prefill_chunk` tokens per row
over every session with tokens to feed (shorter rows padded, model/ragged_cache.py); the sessions a
`generate` call decodes are then the rows of one `RaggedBatch` from their first decode step to their
last, each step feeding every row's newest token in ONE forward (`RaggedBatch.decode`: fixed shapes,
replayed as CUDA graphs on CUDA unless `cuda_graphs=False`, its layers then compiled by inductor
unless `compile_decode=False`, one device-to-host copy of the sampled tokens per step), and a session that
stops leaves the batch between steps with its cache. A generate call whose sessions lack only their
newest token starts with such a decode step. CED prefill (model/ced.py `ced_prefill_ragged`) is
ragged too: every session's unfed tokens, whatever their positions and counts, in ragged encoder
steps and one decoder replay. Speculative verification
runs per group of sessions at the same position (caches stacked and split back). Results do not
depend on the batching beyond fp32 rounding (each session samples from its own generator).

Feeding is lazy: `start`/`extend` only record tokens; the next `prefill`/`generate` feeds them (in
chunks of `prefill_chunk`). The last generated token is fed when the session next advances.
DSpark speculative decoding: `generate_speculative` (engine built with `speculative=`), in
model/engine_speculative.py (a mixin of the engine), the step itself in model/speculative.py.
CED prefill (`prefill_mode="ced"`): each prompt (what a prefill or the start of a generate call feeds)
goes through model/ced.py, all sessions' at once; decode steps are the ragged steps above.
Prefix-cache tiers (`prefix_cache=`, CED only): `start` restores the longest stored prefix, in the
sessions' storage format (dense or packed).
Routing record (`record_routing=True`): every fed token's MoE experts per backbone layer, for routing
replay in training (`routing`, model.moe.routing_replay).
Packed cache storage (`packed_cache=True`, QAT models): the sessions' LayerCaches hold the byte entries
of model/packed_cache.py (attention.py packs on write, unpacks on read); by default they hold the dense
fake-quantised tensors. `cache_bytes` reports the packed size either way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Literal

import torch

from model import ragged_cache
from model.attention import LayerCache
from model.ced import EngramFn, ced_prefill_ragged, check_ced
from model.chat_template import ChatTemplate
from model.engine_session import FinishReason, Generation, Session
from model.engine_speculative import SpeculativeDecoding
from model.engram import EngramHasher
from model.moe import routing_record
from model.packed_cache import model_cache_bytes
from model.prefix_cache import PrefixCache
from model.ragged_cache import COMPILED_BUCKETS, GRAPH_BUCKETS, GraphPool, RaggedBatch, bank_tokens, engram_rows
from model.sampling import sample
from model.speculative import CostModel, SpeculativeConfig
from model.tokenizer import Tokenizer
from model.transformer import ModelCache, Transformer, make_engram_inputs

# padded tokens per prefill forward at most (rows x chunk): bounds a ragged prefill's activations
_PREFILL_TOKENS = 32768


class InferenceEngine(SpeculativeDecoding):
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
        prefill_mode: Literal["ced", "full"] = "full",
        prefix_cache: PrefixCache | None = None,
        speculative: SpeculativeConfig | None = None,
        packed_cache: bool = False,
        cuda_graphs: bool | None = None,
        compile_decode: bool | None = None,
        overlap_decode: bool | None = None,
        record_routing: bool = False,
    ):
        self.device = torch.device(device)
        # decode steps replay CUDA graphs (model/ragged_cache.py GraphPool): on by default on CUDA with
        # impl=triton, where an eager step of `small` is ~100 ms of kernel launches; the eager path is
        # the same forward (CPU, impl=torch, or cuda_graphs=False)
        if cuda_graphs is None:  # a graph replay runs no Python, so routing recording takes the eager path
            cuda_graphs = self.device.type == "cuda" and model.args.impl == "triton" and not record_routing
        if cuda_graphs and record_routing:
            raise ValueError("record_routing records in Python, a CUDA graph replay runs none: pass cuda_graphs=False")
        if cuda_graphs and self.device.type != "cuda":
            raise ValueError(f"cuda_graphs needs a CUDA device, got {self.device}: pass cuda_graphs=False")
        if cuda_graphs and model.args.impl != "triton":
            raise ValueError("cuda_graphs needs impl='triton' (the torch MoE loop syncs with the host every layer)")
        # compile_decode: decode steps run model.forward_ragged with its layers, its layout and head and
        # the n-gram hash compiled by inductor (model/ragged_cache.py compile_decode, compile_step_hashes:
        # one compile per kind of layer and graph bucket, fewer buckets, shared by the process's engines),
        # captured by the graphs. On wherever the graphs are: on an H100, 64 `small` sessions decode at
        # 10,515 tok/s compiled (docs/engine_throughput.md); the price is a compile the first time a bucket runs with
        # a bank size (ragged_cache.bank_tokens of its longest row plus the call's new tokens): on an H100 ~100 s
        # for 1 row, ~150-240 s for 64
        if compile_decode is None:
            compile_decode = cuda_graphs
        if compile_decode and record_routing:
            raise ValueError("record_routing records in Python, which a compiled step skips: pass compile_decode=False")
        self.graphs = GraphPool(COMPILED_BUCKETS if compile_decode else GRAPH_BUCKETS) if cuda_graphs else None
        # overlap_decode: the next decode step is launched from the sampled tokens on the device before
        # the host reads them, so the host's work of a step (the token copy, stop checks, bookkeeping,
        # the next step's inputs) runs while the device computes the next one; a row that turns out to
        # have stopped is rolled back by the token it was fed (its cache keeps one token of rollback).
        # On with the graphs (the host work would otherwise leave the device idle between replays); on
        # CPU the forward runs in the host thread, so the step fed to a stopped row would be pure waste.
        # A speculative engine overlaps its plain decode steps (verification steps are eager)
        if overlap_decode is None:
            overlap_decode = cuda_graphs
        if overlap_decode and record_routing:
            raise ValueError("overlap_decode feeds rows ahead, which routing recording would record: not with "
                             "record_routing")  # fmt: skip
        self.overlap_decode = overlap_decode
        self._decode_forward = ragged_cache.compile_decode(model) if compile_decode else None
        # packed_cache: sessions' LayerCaches store the window rings as FP8 and the global banks as
        # FP4/MXFP4 bytes (model/packed_cache.py), unpacked on read (impl=triton reads the compressed KV
        # entries it gathers as bytes); the prefix cache stores and restores them in this format. Off by
        # default here (QAT-off models cannot use it; rollouts turn it on, rl/actors.py build_engine):
        # without the kernel, each step unpacks the whole bank in torch (memory for compute).
        if packed_cache and not model.args.qat:
            raise ValueError("packed_cache is lossless only with qat on (values on the fake-quant grid)")
        self.packed_cache = packed_cache
        self.record_routing = record_routing
        self.model = model.to(self.device).eval()
        self.tokenizer = template.tokenizer if isinstance(template, ChatTemplate) else template
        self.default_stop_ids: tuple[int, ...] = template.stop_ids if isinstance(template, ChatTemplate) else ()
        self.max_sessions = max_sessions
        self.max_seq_len = max_seq_len or model.args.max_seq_len
        self.prefill_chunk = prefill_chunk
        # "ced": prompts are prefilled with CED decoder bounded replay (model/ced.py; train on such
        # rollouts with model.replay.simulated_forward); "full": the whole stack over every position.
        if prefill_mode not in ("ced", "full"):
            raise ValueError(f"prefill_mode must be 'ced' or 'full', got {prefill_mode!r}")
        if prefill_mode == "ced":
            check_ced(model.args)
        self.prefill_mode = prefill_mode
        # prefix-cache tiers (model/prefix_cache.py): sessions start from the longest stored prefix of
        # their prompt, and every CED prefill stores the state it reached
        if prefix_cache is not None and prefill_mode != "ced":
            raise ValueError("a prefix cache needs prefill_mode='ced'")
        if prefix_cache is not None and prefix_cache.packed and not model.args.qat:
            raise ValueError("packed banks are exact only for QAT caches: use PrefixCache(packed=False) with qat off")
        self.prefix_cache = prefix_cache
        self.policy_version = 0
        # Engram layers hash n-grams of token ids: the model's own hasher reads the context from the
        # cache; without one, the engine hashes with its tokenizer, context from the session's tokens.
        # `_hasher` is that engine-built hasher (None: the model's own, or no Engram layers)
        self._hasher = None
        if model.args.engram_layer_ids and model.engram_hasher is None:
            if self.tokenizer is None:
                raise ValueError("a model with Engram layers needs an engram_hasher or a tokenizer to build one")
            self._hasher = EngramHasher(model.args, self.tokenizer)
        # compiled decode steps hash their n-grams compiled too (None: the hasher's own step_hashes)
        hasher = self.ngram_hasher
        self._decode_hashes = ragged_cache.compile_step_hashes(hasher) if compile_decode and hasher else None
        self._sessions: dict[int, Session] = {}
        # model calls made (a CED prefill, encoder steps and replay, counts as one), tokens fed (rows x
        # positions), tokens generated, tokens the decoder replayed in CED prefills, rows of overlapped
        # steps that had stopped (fed ahead, rolled back): for benches and tests
        self.stats = {"forward_calls": 0, "tokens_fed": 0, "tokens_generated": 0, "replay_tokens": 0,
                      "decode_steps": 0, "speculation_off_calls": 0, "rows_rolled_back": 0,
                      "rows_joined_in_place": 0}  # fmt: skip
        self._next_id = 0
        # DSpark speculation: caches keep max_draft tokens of rollback, fed tokens keep their DSpark context
        self.speculative = speculative
        self._max_rollback = 1 if overlap_decode else 0  # the step a stopped row was fed ahead
        self._spec_costs: dict[int, CostModel] = {}
        # calls left to run plain after a speculative call that lost to plain decoding (off_calls), and
        # the running call's emitted tokens against the tokens plain steps would emit in its time
        self._spec_calls_off = 0
        self._spec_call = [0.0, 0.0]
        if speculative is not None:
            if model.mtp is None:
                raise ValueError("speculative decoding needs a DSpark drafter (dspark_block_size > 0)")
            self._max_rollback = speculative.max_draft or model.args.dspark_block_size
            if not 1 <= self._max_rollback <= model.args.dspark_block_size:
                raise ValueError(f"max_draft must be in 1..dspark_block_size={model.args.dspark_block_size}")

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
    @property
    def ngram_hasher(self) -> EngramHasher | None:
        """The hasher of the Engram inputs: the engine's own, else the model's (None: no Engram layers)."""
        return self._hasher or self.model.engram_hasher

    def start(self, prompt_ids: Sequence[int]) -> int:
        """Open a session on `prompt_ids` (fed lazily, by the next prefill/generate)."""
        if len(self._sessions) >= self.max_sessions:
            raise RuntimeError(f"max_sessions ({self.max_sessions}) sessions are open; close one first")
        if not prompt_ids:
            raise ValueError("a session needs at least one prompt token")
        sid, self._next_id = self._next_id, self._next_id + 1
        self._sessions[sid] = Session([], self._new_cache())
        self.extend(sid, prompt_ids)
        if self.prefix_cache is not None:
            s = self._sessions[sid]
            cache, _ = self.prefix_cache.lookup(
                self.model, s.token_ids, max_rollback=self._max_rollback,
                engram_inputs=self._engram_fn([s.token_ids]), device=self.device, packed_cache=self.packed_cache,
            )  # fmt: skip
            if cache is not None:
                s.cache = cache
                if self.record_routing:  # the prefix cache does not keep routing: not recorded
                    s.routing.append(self._unrecorded(cache.seq_len))
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

    def routing(self, session_id: int) -> torch.Tensor:
        """int32 [len(tokens), n_layers, K] (engine built with record_routing=True): row t holds the experts
        (ascending) each backbone MoE layer chose for token t when the engine fed it, for
        model.moe.routing_replay. -1 rows: not recorded, routed afresh on replay: tokens not fed yet
        (the newest generated one), tokens restored from the prefix cache, and under CED prefill the
        decoder layers of prompt tokens before the replay segment (the decoder never ran on them)."""
        if not self.record_routing:
            raise ValueError("build the engine with record_routing=True to record routing")
        s = self._get(session_id)
        fed = torch.cat(s.routing) if s.routing else self._unrecorded(0)
        return torch.cat([fed, self._unrecorded(len(s.token_ids) - fed.size(0)).to(fed.device)])

    def _unrecorded(self, n: int) -> torch.Tensor:
        return torch.full((n, self.model.args.n_layers, self.model.args.n_activated_experts), -1,
                          dtype=torch.int32, device=self.device)  # fmt: skip

    @contextmanager
    def _recording(self) -> Iterator[dict[int, list[torch.Tensor]] | None]:
        """model.moe.routing_record around one forward when recording routing (else None)."""
        if not self.record_routing:
            yield None
            return
        with routing_record() as record:
            yield record

    def _routing_BSLK(self, record: dict[int, list[torch.Tensor]], layers: range) -> torch.Tensor:
        """[B,S,len(layers),K] int32 from one forward's record: each layer's calls joined along S."""
        return torch.stack([torch.cat(record[i], dim=1) for i in layers], dim=-2).to(torch.int32)

    @property
    def session_ids(self) -> list[int]:
        return list(self._sessions)

    def _check_id(self, session_id: int) -> int:
        if session_id not in self._sessions:
            raise KeyError(f"no open session {session_id}")
        return session_id

    def _get(self, session_id: int) -> Session:
        return self._sessions[self._check_id(session_id)]

    # ------------------------------------------------------------------ prefill / forward
    def prefill(self, session_ids: Sequence[int] | None = None) -> int:
        """Feed every recorded but unfed token of the sessions (all by default); returns how many."""
        sessions = [self._get(i) for i in (self.session_ids if session_ids is None else session_ids)]
        n = sum(s.n_unfed for s in sessions)
        self._feed(sessions)
        return n

    def _new_cache(self) -> ModelCache:
        # CED sessions remember the last window of encoder output: the next prompt's replay reaches back
        enc = self.model.args.window_size if self.prefill_mode == "ced" else 0
        cache = ModelCache(max_rollback=self._max_rollback, encoder_out_len=enc)
        if self.packed_cache:  # allocated here, not by the model, to carry the flag
            cache.layers = [LayerCache(max_rollback=self._max_rollback, packed=True) for _ in self.model.layers]
        return cache

    def _feed(self, sessions: Sequence[Session]) -> None:
        """Feed every recorded but unfed token of the sessions (each ends a prompt: a prefill, or the
        first feed of a generate call), all of them at once whatever their positions and counts:
        ragged steps of up to prefill_chunk tokens per row (CED: the encoder steps, then one decoder
        replay for all rows), as many rows per batch as _PREFILL_TOKENS padded tokens allow."""
        todo = [s for s in sessions if s.n_unfed > 0]
        prefill = self._prefill_ced if self.prefill_mode == "ced" else self._prefill_ragged
        while todo:
            S = min(self.prefill_chunk, max(s.n_unfed for s in todo))
            if self.prefill_mode == "ced":  # the replay pads every row to the longest segment
                S = max(S, min(self.model.args.window_size, max(len(s.token_ids) for s in todo)))
            n_rows = max(1, _PREFILL_TOKENS // S)
            prefill(todo[:n_rows])
            todo = todo[n_rows:]

    @torch.inference_mode()
    def _prefill_ragged(self, group: list[Session]) -> None:
        """Feed every unfed token of the sessions of `group`, each row at its own position, in steps
        of up to prefill_chunk tokens per row (one forward per step for all rows)."""
        chunk = min(self.prefill_chunk, max(s.n_unfed for s in group))
        batch = RaggedBatch(self.model, [s.cache for s in group], max(len(s.token_ids) for s in group), chunk)
        keep_hidden = self.speculative is not None
        try:
            while True:
                ids = [s.token_ids[p : min(len(s.token_ids), p + chunk)] for s, p in zip(group, batch.pos)]
                if not any(ids):
                    break
                with self._recording() as record:
                    out = batch.step(ids, self._engram_rows(group, batch.pos, ids), return_main_hidden=keep_hidden)
                logits_BV, main_hidden = out if keep_hidden else (out, None)
                routing = None if record is None else self._routing_BSLK(record, range(self.model.args.n_layers))
                self.stats["forward_calls"] += 1
                self.stats["tokens_fed"] += sum(map(len, ids))
                for b, (s, fed) in enumerate(zip(group, ids)):
                    if not fed:
                        continue
                    if routing is not None:
                        s.routing.append(routing[b, : len(fed)])
                    if batch.pos[b] == len(s.token_ids):
                        s.next_logits, s.next_version = logits_BV[b], self.policy_version
                    if main_hidden is not None:
                        self._stash_hidden(s, main_hidden[b : b + 1, : len(fed)])
        finally:
            for s, cache in zip(group, batch.split()):
                s.cache = cache

    def _engram_rows(self, group: list[Session], pos: list[int], ids: list[list[int]]) -> dict | None:
        """Engram inputs of a ragged step (None without Engram layers): the engine's hasher, or the
        model's own, over each row's tokens with the max_ngram-1 tokens before as its context."""
        if not self.model.args.engram_layer_ids:
            return None
        return engram_rows(self.ngram_hasher, [s.token_ids for s in group], pos, ids,
                           self.model.args.engram_max_ngram_size - 1, self.device)  # fmt: skip

    @torch.inference_mode()
    def _prefill_ced(self, group: list[Session]) -> None:
        """CED prefill of every unfed token of the sessions of `group` (any positions and counts) as
        the rows of one RaggedBatch (model/ced.py ced_prefill_ragged)."""
        chunk = min(self.prefill_chunk, max(s.n_unfed for s in group))
        slack = max(chunk, self.model.args.window_size)
        batch = RaggedBatch(self.model, [s.cache for s in group], max(len(s.token_ids) for s in group), slack)
        n_unfed = [s.n_unfed for s in group]

        def engram_rows(pos: list[int], ids: list[list[int]]) -> dict | None:
            return self._engram_rows(group, pos, ids)

        try:
            with self._recording() as record:
                logits_BV, main_hidden, n_replay = ced_prefill_ragged(
                    self.model, batch, [s.token_ids for s in group], chunk=chunk, engram_rows=engram_rows
                )  # fmt: skip
        finally:
            for s, cache in zip(group, batch.split()):
                s.cache = cache
        if record is not None:
            self._record_ced(group, record, n_unfed, n_replay, chunk)
        self.stats["forward_calls"] += 1
        self.stats["tokens_fed"] += sum(n_unfed)
        self.stats["replay_tokens"] += sum(n_replay)
        for b, s in enumerate(group):
            s.next_logits = logits_BV[b].clone()
            s.next_version = self.policy_version
            if self.speculative is not None and main_hidden is not None:
                # the drafter's context of the fed tokens: the replayed ones, zeros before the segment
                u, k = n_unfed[b], n_replay[b]
                mh = main_hidden[b : b + 1, :k][:, max(0, k - u) :]
                self._stash_hidden(s, torch.nn.functional.pad(mh, (0, 0, u - mh.size(1), 0)))
            if self.prefix_cache is not None:
                self.prefix_cache.store(s.token_ids[: s.cache.seq_len], s.cache)

    def _record_ced(self, group: list[Session], record: dict, n_unfed: list[int], n_replay: list[int],
                    chunk: int) -> None:
        """The routing of a ragged CED prefill in which row b fed its last n_unfed[b] positions: the
        encoder's over all of them (one record per ragged step, each row's tokens left-aligned in it,
        min(chunk, what is left) of them per step), the decoder's over the row's replay segment of
        n_replay[b] positions (left-aligned in the replay; its rows before the new positions are
        earlier tokens replayed, which keep what was recorded when they were fed), -1 before it."""
        a = self.model.args
        E = a.n_encoder_layers
        steps = [torch.stack([record[i][j] for i in range(E)], dim=-2) for j in range(len(record[0]))]
        dec = self._routing_BSLK(record, range(E, a.n_layers))
        for b, s in enumerate(group):
            u, k = n_unfed[b], n_replay[b]
            parts, left = [], u
            for step in steps:
                if left <= 0:
                    break
                parts.append(step[b, : min(chunk, left)])
                left -= parts[-1].size(0)
            routing = self._unrecorded(u)
            routing[:, :E] = torch.cat(parts).to(torch.int32)
            m = min(u, k)  # the segment's rows at the new positions
            routing[u - m :, E:] = dec[b, k - m : k]
            s.routing.append(routing)

    def _engram_fn(self, token_lists: Sequence[Sequence[int]]) -> EngramFn | None:
        """Engram inputs of the rows' tokens at a position, hashed by the engine (None: by the model)."""
        if self._hasher is None:
            return None

        def engram_inputs(pos: int, chunk_ids: torch.Tensor) -> dict:
            c = min(pos, self.model.args.engram_max_ngram_size - 1)
            context_ids = torch.tensor([list(t[pos - c : pos]) for t in token_lists]) if c else None
            return make_engram_inputs(self._hasher, chunk_ids, context_ids=context_ids)

        return engram_inputs

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
        stop_when: Callable[[str], bool] | None = None,
        admit: Callable[[], Sequence[tuple[int, int | None]]] | None = None,
        on_finish: Callable[[int, Generation], None] | None = None,
    ) -> list[Generation]:
        """Generate up to `max_new_tokens` per session, all sessions advancing together.

        A session stops at the first generated id in `stop_ids` (default: the template's stop ids;
        pass () for none), once its decoded generated text contains a stop string, or once
        `stop_when(text)` holds (a caller's test that the answer can no longer be useful; `stop` is
        then None); the stopping token is kept. Sampling per `model.sampling.sample`; `seed` is one
        int per session or one int from which session k of this call derives its own generator, so a
        session's draws do not depend on which other sessions share the call (None: seeds from
        torch's global RNG).
        Continuous batching: `admit()`, polled before every decode step, returns (session id, seed or
        None) of sessions that join the call there (open, not decoding in it: a session whose turn
        ended in this call may come back with its next one): their prompts are prefilled
        in one forward, their first tokens sampled, and they decode in the same forward as the rest
        from the next step on, with this call's sampling and limits. `on_finish(session_id, gen)` is
        called as each session stops. Returns the Generations of `session_ids`, then of the joined
        sessions in the order they joined. Sessions that each lack only one token are fed by a decode
        step, except on a CED engine where that token was given rather than generated: a CED engine
        prefills what a turn starts with (its replay segment, which the learner's simulated replay
        reproduces), while a session whose only unfed token it generated itself goes on with its turn.
        """
        if len(set(session_ids)) != len(session_ids):
            raise ValueError("a session may appear only once per generate call")
        if (stop_strings or stop_when) and self.tokenizer is None:
            raise ValueError("stop_strings and stop_when need a tokenizer")
        sessions = [self._get(i) for i in session_ids]
        stops = set(self.default_stop_ids if stop_ids is None else stop_ids)
        gens = self._generators(seed, len(sessions))
        outs = [self._new_generation(s) for s in sessions]
        active = [i for i, s in enumerate(sessions) if len(s.token_ids) < self.max_seq_len and max_new_tokens > 0]
        # sessions that lack only their newest token are fed by a decode step; on a CED engine only when
        # they generated it (a continued turn: no replay segment in mid-turn)
        by_decode = bool(active) and all(
            sessions[i].n_unfed == 1 and (self.prefill_mode == "full" or sessions[i].versions[-1] is not None)
            for i in active
        )
        if not by_decode:
            self._feed([sessions[i] for i in active])
        # decode: the sessions that go on are the rows of one RaggedBatch (one forward per step);
        # rows[k] is the call index of batch row k, in the order of `active`
        batch, rows, logits_BV = None, [], None
        max_tokens = self._bank_tokens(max((len(s.token_ids) for s in sessions), default=0) + max_new_tokens)
        limits = (stops, stop_strings, stop_when, max_new_tokens)

        def finished(idx: list[int], still: list[int]) -> None:
            if on_finish is not None:
                for i in sorted(set(idx) - set(still)):
                    self._finish_text(outs[i])
                    on_finish(session_ids_all[i], outs[i])

        def sample_step(idx: list[int], logits: torch.Tensor | None) -> list[int]:
            drawn = self._fetch(self._draw(sessions, idx, gens, temperature, top_p, logits))
            still = self._record(sessions, outs, idx, drawn, *limits)
            finished(idx, still)
            return still

        session_ids_all = list(session_ids)
        try:
            if by_decode:
                batch, rows = self._decode_batch(sessions, active, max_tokens), active
                logits_BV = self._decode_step(batch, [sessions[i] for i in rows])
            while active:
                joined = list(admit()) if admit is not None else []
                ahead = None
                if self.overlap_decode and batch is not None and not joined:
                    # the next step is launched on the drawn tokens before the host reads them
                    drawn = self._draw(sessions, active, gens, temperature, top_p, logits_BV)
                    fetched = self._fetch(drawn)  # queued before the next step: read while that one runs
                    versions = [sessions[i].next_version for i in active]  # of the logits drawn from
                    if not all(self._at_limit(sessions[i], outs[i], max_new_tokens, drawn=1) for i in active):
                        ahead = self._decode_step(batch, [sessions[i] for i in rows], ids=drawn[0])
                    still = self._record(sessions, outs, active, fetched, *limits, versions=versions)
                    finished(active, still)
                    active = still
                else:
                    active = sample_step(active, logits_BV)
                if batch is not None and len(active) < len(rows):
                    going_on = set(active)
                    gone = [k for k, i in enumerate(rows) if i not in going_on]
                    for k, cache in zip(gone, batch.take(gone)):
                        if ahead is not None:  # fed its last token ahead: back to that token unfed
                            cache.truncate(cache.seq_len - 1)
                            sessions[rows[k]].drop_step()
                            self.stats["rows_rolled_back"] += 1
                        sessions[rows[k]].cache = cache
                    if ahead is not None:
                        ahead = ahead[[k for k, i in enumerate(rows) if i in going_on]]
                    rows = [i for i in rows if i in going_on]
                if ahead is not None:
                    logits_BV = ahead
                    continue
                if joined:  # joiners prefill, draw their first token, and join the batch
                    first = len(sessions)
                    idx = self._join(joined, session_ids_all, sessions, outs, gens, active)
                    for i in sorted(set(range(first, len(sessions))) - set(idx)):  # at max_seq_len already
                        if on_finish is not None:
                            on_finish(session_ids_all[i], outs[i])
                    idx = sample_step(idx, None)
                    # each row's longest: its length when its turn in this call began, plus the call's limit
                    longest = max_new_tokens + max(
                        (len(sessions[i].token_ids) - len(outs[i].token_ids) for i in active + idx), default=0
                    )
                    grown = max(max_tokens, self._bank_tokens(longest))
                    # the joiners' rows go in after the batch's own where its banks and storage hold them;
                    # otherwise every row's cache comes out and the next step rebuilds the batch
                    if batch is not None and idx and grown == max_tokens and batch.extend(
                        [sessions[i].cache for i in idx]
                    ):
                        rows = rows + idx
                        self.stats["rows_joined_in_place"] += len(idx)
                    elif batch is not None:
                        for i, cache in zip(rows, batch.split()):
                            sessions[i].cache = cache
                        batch, rows = None, []
                    active = active + idx
                    max_tokens = grown
                if active:
                    if batch is None:
                        batch, rows = self._decode_batch(sessions, active, max_tokens), active
                    logits_BV = self._decode_step(batch, [sessions[i] for i in rows])
        finally:
            if batch is not None and rows:
                for i, cache in zip(rows, batch.split()):
                    sessions[i].cache = cache
        for out in outs:
            self._finish_text(out)
        return outs

    def _bank_tokens(self, longest: int) -> int:
        """Tokens a decode batch's banks are sized for when its longest row may reach `longest` (at most
        max_seq_len): on graphs or compiled layers a rung of ragged_cache.bank_tokens, so later calls
        reuse their storage, graphs and compiled layers (whose shapes include the banks')."""
        if self.graphs is not None or self._decode_forward is not None:
            return bank_tokens(longest, self.max_seq_len)
        return min(self.max_seq_len, longest)

    def _finish_text(self, out: Generation) -> None:
        if self.tokenizer is not None:
            out.text = self.tokenizer.decode(out.token_ids)

    def _join(self, joined, session_ids: list[int], sessions: list[Session], outs: list[Generation],
              gens: list[torch.Generator], active: list[int]) -> list[int]:  # fmt: skip
        """Add sessions (id, seed) to a running generate call (its lists, in place) and feed their
        prompts; returns their call indices (those below max_seq_len: the others finish at once). A
        session whose turn in this call has finished may join again: its next turn is a new entry."""
        ids = [int(sid) for sid, _ in joined]
        if len(set(ids)) != len(ids) or set(ids) & {session_ids[i] for i in active}:
            raise ValueError(f"sessions {ids} cannot join: a session decodes only once at a time in a generate call")
        seeds = [torch.randint(2**62, ()).item() if seed is None else int(seed) for _, seed in joined]
        start = len(sessions)
        for sid, g in zip(ids, self._generators(seeds, len(ids))):
            s = self._get(sid)
            session_ids.append(sid)
            sessions.append(s)
            outs.append(self._new_generation(s))
            gens.append(g)
        idx = [i for i in range(start, len(sessions)) if len(sessions[i].token_ids) < self.max_seq_len]
        self._feed([sessions[i] for i in idx])
        return idx

    def _draw(self, sessions, active, gens, temperature, top_p, logits_BV=None) -> tuple[torch.Tensor, torch.Tensor]:
        """The next token of every active session and its log-prob ([B] each, on the device, not read
        yet), from the rows' next-token logits (`logits_BV`, the rows of `active` in order, when the
        caller has them batched, else each session's own)."""
        if logits_BV is None:
            logits_BV = torch.stack([sessions[i].next_logits for i in active])
        return sample(logits_BV, temperature, top_p, [gens[i] for i in active])

    def _fetch(self, drawn: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Start the one device-to-host copy of a step's drawn tokens and log-probs ([2,B] fp64: token
        ids are exact in it) into pinned memory; returns it and the event that marks it done (None on
        CPU, where the copy is the tensor itself). Work queued after this call does not delay it."""
        both = torch.stack([drawn[0].double(), drawn[1].double()])
        if both.device.type != "cuda":
            return both, None
        host = both.to("cpu", non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return host, done

    def _record(self, sessions, outs, active, fetched, stops, stop_strings, stop_when, max_new_tokens,
                versions: list[int] | None = None) -> list[int]:  # fmt: skip
        """Append the drawn tokens (`_fetch`'s copy of `_draw`'s, waited for here) to their sessions and
        Generations, stamped with the policy version of the logits they were drawn from (`versions`,
        else each session's next_version); returns the indices that go on (no stop, no length limit)."""
        drawn, done = fetched
        if done is not None:
            done.synchronize()
        if versions is None:
            versions = [sessions[i].next_version for i in active]
        self.stats["tokens_generated"] += len(active)
        still = []
        for i, tok, lp, version in zip(active, drawn[0].long().tolist(), drawn[1].tolist(), versions):
            s, out = sessions[i], outs[i]
            s.token_ids.append(tok)
            s.versions.append(version)
            s.next_logits = None
            out.token_ids.append(tok)
            out.logprobs.append(lp)
            out.policy_versions.append(version)
            if stop_strings or stop_when:
                out.text = self.tokenizer.decode(out.token_ids)
            hit = tok if tok in stops else next((x for x in stop_strings if x in out.text), None)
            if hit is not None:
                out.finish_reason, out.stop = "stop", hit
            elif stop_when is not None and stop_when(out.text):
                out.finish_reason = "stop"
            elif not self._at_limit(s, out, max_new_tokens):
                still.append(i)
        return still

    def _at_limit(self, s: Session, out: Generation, max_new_tokens: int, drawn: int = 0) -> bool:
        """Whether a session is at its length limit (it stops there) once its `drawn` tokens drawn but
        not recorded yet are."""
        return len(out.token_ids) + drawn >= max_new_tokens or len(s.token_ids) + drawn >= self.max_seq_len

    def _decode_batch(self, sessions: list[Session], active: list[int], max_tokens: int) -> RaggedBatch:
        # without graphs the batch's tensors are made as inference tensors, as its steps' outputs are:
        # a compiled step then sees one kind of tensor from the first step on (dynamo guards on it,
        # and would compile every layer again at the second step)
        with torch.inference_mode(self.graphs is None):
            return RaggedBatch(self.model, [sessions[i].cache for i in active], max_tokens, pool=self.graphs,
                               forward=self._decode_forward, hasher=self.ngram_hasher,
                               step_hashes=self._decode_hashes)  # fmt: skip

    def _decode_step(self, batch: RaggedBatch, group: list[Session], ids: torch.Tensor | None = None) -> torch.Tensor:
        """Feed every row's one unfed token (its newest generated one, or `ids` [B] on the device:
        tokens drawn but not recorded yet) in one ragged forward; returns the rows' next-token logits
        [B,V] (the next `_draw` takes them as they are)."""
        if ids is None:
            ids = [s.token_ids[-1] for s in group]
        keep_hidden = self.speculative is not None
        with self._recording() as record:
            out = batch.decode(ids, return_main_hidden=keep_hidden)
        logits_BV, main_hidden = out if keep_hidden else (out, None)
        routing = None if record is None else self._routing_BSLK(record, range(self.model.args.n_layers))
        self.stats["forward_calls"] += 1
        self.stats["decode_steps"] += 1
        self.stats["tokens_fed"] += len(group)
        for b, s in enumerate(group):
            s.next_version = self.policy_version
            if routing is not None:
                s.routing.append(routing[b, :1])
            if main_hidden is not None:
                s.stash_step(main_hidden, b, self.model.args.window_size + self._max_rollback)
        return logits_BV

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

    # ------------------------------------------------------------------ speculative generation
    def _new_generation(self, s: Session) -> Generation:
        """An empty Generation of a session about to generate (its prompt length is its turn boundary)."""
        return Generation([], [], "length", "", [], len(s.token_ids))

    def _scan(self, s: Session, out: Generation, toks: list[int], stops, stop_strings, max_new_tokens):
        """How many of `toks` the session keeps if they are its next tokens, and whether it then
        finishes (a stop id/string as `generate` checks them token by token, or a length limit)."""
        for j, tok in enumerate(toks, 1):
            if tok in stops:
                return j, ("stop", tok)
            if stop_strings:
                text = self.tokenizer.decode(out.token_ids + toks[:j])
                hit = next((x for x in stop_strings if x in text), None)
                if hit is not None:
                    return j, ("stop", hit)
            if len(out.token_ids) + j >= max_new_tokens or len(s.token_ids) + j >= self.max_seq_len:
                return j, ("length", None)
        return len(toks), None

    def _commit(
        self,
        s: Session,
        out: Generation,
        toks: list[int],
        logprobs: list[float],
        version: int,
        finish: tuple[FinishReason, int | str | None] | None,
    ) -> None:
        """Append generated tokens to the session and its Generation (the newest one stays unfed)."""
        s.token_ids += toks
        s.versions += [version] * len(toks)
        s.next_logits = None
        out.token_ids += toks
        out.logprobs += logprobs
        out.policy_versions += [version] * len(toks)
        if finish is not None:
            out.finish_reason, out.stop = finish


__all__ = ["FinishReason", "Generation", "InferenceEngine"]
