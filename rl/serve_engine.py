"""The engine side of flashpost-serve: one thread owns the InferenceEngine and batches every pending
request into shared `generate` calls; the conversation sessions that make a served chat token-exact.

`EngineLoop` is the only code that touches the engine after start-up. HTTP handlers hand it closures
(`call`) and generation jobs (`submit`); between engine calls it runs the closures, then advances every
active job by up to `decode_chunk` tokens, jobs of equal sampling settings in one `generate` call (the
engine groups rows that share a position into one forward). A job that arrives while others decode joins
at the next chunk boundary; chunks are also the streaming granularity. Beyond `max_pending` jobs a submit
is refused with 429 rather than queued without bound.

`Conversation`: a `session_id`'s engine session, its messages in chat-template form (assistant turns carry
the ids the engine sampled) and per-token log-probs, so its record is exactly the consumed and produced
tokens and `ChatTemplate.render(messages, tools)` gives them back (DESIGN §3.1). Not here: HTTP and the
wire format (rl/serve_app.py, rl/serve_protocol.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from model.engine import InferenceEngine
from rl.serve_protocol import ApiError


@dataclass(kw_only=True)
class ServeConfig:
    """flashpost-serve's settings (conf/serve.yaml `serve:`)."""

    host: str = "127.0.0.1"
    port: int = 8000
    model_name: str = "flashpost"  # the id /v1/models lists and requests must name
    max_sessions: int = 256  # engine sessions open at once: live conversations + choices being generated
    max_pending: int = 256  # choices queued or generating; a request beyond it gets 429
    default_max_tokens: int = 256  # when a request gives no max_tokens (capped by the room left)
    max_n: int = 16
    # tokens per engine call between scheduling points; 0 = a request's whole generation in one call. CED
    # prefill treats the start of every call as a prompt end, so a "ced" engine needs 0
    decode_chunk: int = 16
    batch_wait_s: float = 0.005  # an idle loop waits this long for concurrent requests to arrive together
    prefill_mode: str = "full"  # the engine flashpost-serve builds (rl/serve.py)
    threads: int = 1  # torch CPU threads of the engine
    session_ttl_s: float = 3600.0  # a conversation idle this long is closed (its engine session freed)

    def __post_init__(self) -> None:
        if self.prefill_mode not in ("full", "ced"):
            raise ValueError(f"serve.prefill_mode={self.prefill_mode!r} is not 'full' or 'ced'")
        if self.decode_chunk < 0 or self.max_pending < 1 or self.max_n < 1:
            raise ValueError("serve.decode_chunk must be >= 0, serve.max_pending and serve.max_n >= 1")


@dataclass(kw_only=True)
class Job:
    """One choice being generated on engine session `sid`. `on_chunk(job)` runs on the engine thread after
    every chunk (the last one with `finish` set); `on_finish(job)` runs before it, once."""

    sid: int
    max_tokens: int
    temperature: float
    top_p: float
    stop: tuple[str, ...]
    seed: int
    on_chunk: Callable[[Job], None]
    on_finish: Callable[[Job], None] | None = None
    prompt_len: int = 0
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish: str | None = None  # "stop" | "length" | "error"
    error: str | None = None
    n_chunks: int = 0


class EngineLoop:
    """The engine's one thread. `call(fn)` runs fn(engine) there and returns a concurrent Future."""

    def __init__(self, engine: InferenceEngine, cfg: ServeConfig):
        if engine.prefill_mode == "ced" and cfg.decode_chunk != 0:
            raise ValueError("a CED engine needs serve.decode_chunk=0: every engine call would start a CED turn")
        self.engine, self.cfg = engine, cfg
        self._cmds: queue.Queue = queue.Queue()
        self._jobs: list[Job] = []
        self._lock = threading.Lock()
        self.n_pending = 0
        self.stats = {"engine_calls": 0, "rows": 0, "tokens_generated": 0, "jobs_done": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="flashpost-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ API for other threads
    def call(self, fn: Callable[[InferenceEngine], Any]) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._cmds.put((fn, fut))
        return fut

    async def acall(self, fn: Callable[[InferenceEngine], Any]) -> Any:
        return await asyncio.wrap_future(self.call(fn))

    def reserve(self, n: int) -> None:
        """Count n jobs against max_pending before their sessions are opened; 429 beyond it."""
        with self._lock:
            if self.n_pending + n > self.cfg.max_pending:
                raise ApiError(429, f"the server is at capacity ({self.cfg.max_pending} choices pending); retry "
                                    "after a moment", code="rate_limit_exceeded", kind="rate_limit_error")  # fmt: skip
            self.n_pending += n

    def release(self, n: int) -> None:
        with self._lock:
            self.n_pending -= n

    def submit(self, jobs: list[Job]) -> None:
        """Queue reserved jobs (see `reserve`)."""
        self._cmds.put((None, jobs))

    def load_weights(self, weights: dict, version: int) -> None:
        """Blocking: new policy weights at `version`, between two engine calls."""
        self.call(lambda e: e.load_state_dict(weights, version)).result()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        import torch

        torch.set_num_threads(self.cfg.threads)
        while not self._stop.is_set():
            self._drain(block=not self._jobs)
            if self._jobs:
                self._step()

    def _drain(self, block: bool) -> None:
        items = []
        if block:
            try:
                items.append(self._cmds.get(timeout=0.2))
            except queue.Empty:
                return
            if self.cfg.batch_wait_s > 0:
                time.sleep(self.cfg.batch_wait_s)
        while True:
            try:
                items.append(self._cmds.get_nowait())
            except queue.Empty:
                break
        for fn, payload in items:
            if fn is None:
                self._jobs += payload
                continue
            try:
                payload.set_result(fn(self.engine))
            except Exception as e:  # the caller's future carries it; the loop goes on
                payload.set_exception(e)

    def _step(self) -> None:
        groups: dict[tuple, list[Job]] = {}
        for j in self._jobs:
            groups.setdefault((j.temperature, j.top_p, j.stop), []).append(j)
        chunk = self.cfg.decode_chunk or math.inf
        for (temperature, top_p, stop), group in groups.items():
            k = int(min(chunk, min(j.max_tokens - len(j.token_ids) for j in group)))
            # chunk c of a job samples from its own generator: seed for the first, a derived one after
            seeds = [j.seed if j.n_chunks == 0 else (j.seed * 1_000_003 + j.n_chunks) % 2**63 for j in group]
            try:
                gens = self.engine.generate([j.sid for j in group], k, temperature, top_p, None, stop, seeds)
            except Exception as e:  # e.g. a device error: these requests fail, the server stays up
                for j in group:
                    self._done(j, "error", f"{type(e).__name__}: {e}")
                continue
            self.stats["engine_calls"] += 1
            self.stats["rows"] += len(group)
            for j, g in zip(group, gens):
                j.n_chunks += 1
                j.token_ids += g.token_ids
                j.logprobs += g.logprobs
                j.versions += g.policy_versions
                self.stats["tokens_generated"] += len(g.token_ids)
                room = self.engine.max_seq_len - len(self.engine.tokens(j.sid))
                if g.finish_reason == "stop":
                    self._done(j, "stop")
                elif len(j.token_ids) >= j.max_tokens or room <= 0:
                    self._done(j, "length")
                elif stop and any(s in self.engine.tokenizer.decode(j.token_ids) for s in stop):
                    self._done(j, "stop")  # a stop string across a chunk boundary: ends with this chunk
                else:
                    j.on_chunk(j)
        self._jobs = [j for j in self._jobs if j.finish is None]

    def _done(self, j: Job, finish: str, error: str | None = None) -> None:
        j.finish, j.error = finish, error
        if j.on_finish is not None:
            try:
                j.on_finish(j)
            except Exception as e:  # bookkeeping must not kill the loop
                j.finish, j.error = "error", f"{type(e).__name__}: {e}"
        self.release(1)
        self.stats["jobs_done"] += 1
        j.on_chunk(j)


# ---------------------------------------------------------------------- conversations
@dataclass(kw_only=True)
class Conversation:
    """One `session_id`. All fields change on the engine thread only."""

    key: str
    sid: int
    tools: list[dict[str, Any]] | None
    messages: list[dict[str, Any]] = field(default_factory=list)  # template form, ours carry token_ids
    roles: list[str] = field(default_factory=list)  # the client's message roles accounted so far
    logprobs: list[float] = field(default_factory=list)  # per session token, NaN where not generated
    turn_starts: list[int] = field(default_factory=list)
    turn_closed: bool = True  # the last assistant turn ended with a stop id
    busy: bool = False
    last_used: float = field(default_factory=time.monotonic)

    def record(self, engine: InferenceEngine) -> dict[str, Any]:
        """The trajectory so far: what rl/payloads.Trajectory needs, plus the template-form messages. JSON has
        no NaN: log-probs of tokens the policy did not generate are None."""
        versions = engine.token_versions(self.sid)
        return {"session_id": self.key, "token_ids": engine.tokens(self.sid),
                "loss_mask": [v is not None for v in versions],
                "logprobs": [None if math.isnan(x) else x for x in self.logprobs],
                "versions": [-1 if v is None else v for v in versions], "turn_starts": list(self.turn_starts),
                "messages": [dict(m) for m in self.messages], "tools": self.tools}  # fmt: skip


def extend_conversation(engine: InferenceEngine, conv: Conversation, ids: list[int]) -> None:
    engine.extend(conv.sid, ids)
    conv.logprobs += [math.nan] * len(ids)


def finish_turn(engine: InferenceEngine, conv: Conversation, job: Job, stop_ids: tuple[int, ...]) -> None:
    """Record a finished generation in its conversation (engine thread)."""
    conv.logprobs += job.logprobs
    conv.messages.append({"role": "assistant", "content": None, "token_ids": list(job.token_ids)})
    conv.roles.append("assistant")
    conv.turn_closed = bool(job.token_ids) and job.token_ids[-1] in stop_ids
    conv.busy = False
    conv.last_used = time.monotonic()


__all__ = ["Conversation", "EngineLoop", "Job", "ServeConfig", "extend_conversation", "finish_turn"]
