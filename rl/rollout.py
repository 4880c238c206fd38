"""Rollouts token-in/token-out: an InferenceEngine session is the policy of a multi-turn episode, and
the finished session becomes a `Trajectory` (the experiment layer of the RL system).

`SessionBatcher` turns the concurrent `generate` calls of many episodes (a GRPO group, several groups)
into one `InferenceEngine.generate` call and serialises weight loads against generation. `TokenPolicy`
is the `policy(messages) -> str` of `envs.episode.run_episode`: the first call renders the prompt with
the chat template (tools in the system turn), later calls render only the new tool/user turns
(`render_continuation`) and `extend` the session, so the session's tokens are exactly what the engine
consumed and produced, never a re-tokenisation of text. Two episode kinds use it: `run_toy_episode`
(an in-process task family, no container: CPU tests and benches) and `run_sandbox_episode`
(envs/episode.py in a Docker sandbox, graded in a pristine grader). Episodes played through
flashpost-serve instead (rollout.agent=server) are in rl/serve_rollout.py.
Not here: Ray (rl/actors.py), admission control (rl/buffer.py), advantages and losses.
"""

from __future__ import annotations

import asyncio
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from model.chat_template import ChatTemplate
from model.engine import InferenceEngine
from model.engine_session import Generation
from rl.payloads import Trajectory


@dataclass(kw_only=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 32


@dataclass(kw_only=True)
class RolloutRequest:
    """One episode to run. key: unique and stable across restarts ("<group>/<member>"); task: a
    ToyTask dict or an envs.task.Task dict, per `env`; seed: the episode's sampling seed (turn k
    samples with seed·1000003 + k), so a re-issued rollout is the same experiment."""

    key: str
    group_id: str
    task_id: str
    seed: int
    env: str
    task: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------- batching engine access
# One thread per engine runs its calls: the event loop's default executor (a handful of threads) also
# runs the episodes' Docker calls, and an engine call queued behind them idles the engine.
_ENGINE_THREADS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def engine_thread(engine: InferenceEngine) -> ThreadPoolExecutor:
    if engine not in _ENGINE_THREADS:
        _ENGINE_THREADS[engine] = ThreadPoolExecutor(1, thread_name_prefix="engine")
    return _ENGINE_THREADS[engine]


@dataclass
class _Request:
    """A turn waiting for the engine: its session (None: `prompt` opens one) and its sampling seed;
    `counts`: the prefix-cache lookups of the session it opened."""

    session: int | None
    seed: int
    future: asyncio.Future
    prompt: list[int] | None = None
    opened: bool = False
    counts: dict[str, float] = field(default_factory=dict)


class SessionBatcher:
    """The episodes' `generate` requests, one engine: a batch of pending turns runs as one batched
    `InferenceEngine.generate` call on the engine's own thread, so the event loop keeps serving tool
    calls. A batch is dispatched once every registered episode waits for the policy, or, with
    `max_wait_s` set (sandbox episodes), after that long: an episode busy in a tool does not hold the
    others back. With `max_wait_s` set, the call is continuous too: a turn requested while it runs
    joins it before the next decode step (`generate(admit=...)`), and each turn's result is handed
    back as its session stops (`on_finish`), so an episode goes on to its tool call while the others
    decode. In-process episodes use None (whole calls), so a group's batches, hence its numbers, are
    the same on every run. Sessions are opened on the engine thread too (`generate(None, seed,
    prompt)`), where the prefix cache is read and written. `lock` serialises engine calls between
    batchers of one worker and weight loads; a waiting load stops a continuous call from admitting
    (tokens carry the version they were sampled under)."""

    def __init__(self, engine: InferenceEngine, sampling: SamplingParams, max_wait_s: float | None = None,
                 lock: asyncio.Lock | None = None):  # fmt: skip
        self.engine = engine
        self.sampling = sampling
        self.max_wait_s = max_wait_s
        self.lock = lock or asyncio.Lock()
        self.n_active = 0
        self._pending: list[_Request] = []  # appended on the event loop, taken by the engine thread
        self._pending_lock = threading.Lock()
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._warmed: set[tuple[int, ...]] = set()
        self._loads_waiting = 0
        self.tokens_generated = 0

    def _open(self, prompt: list[int]) -> tuple[int, dict[str, float]]:
        """(engine thread) Open a session on a prompt -> (session id, its prefix-cache lookup counts).
        With the engine's prefix cache the first session of a prompt in this batcher prefills all but
        its last token once and stores that state, so the group's other samples restore it and feed
        one token each: the shared prompt is prefilled once (a lookup leaves at least one token to feed)."""
        cache = self.engine.prefix_cache
        if cache is None:
            return self.engine.start(prompt), {}
        key = tuple(prompt[:-1])
        if len(prompt) > 1 and key not in self._warmed:
            self._warmed.add(key)
            sid = self.engine.start(list(key))
            try:
                self.engine.prefill([sid])
            finally:
                self.engine.close(sid)
        before = dict(cache.counters)
        sid = self.engine.start(prompt)
        return sid, {f"prefix_{k}": float(cache.counters[k] - before[k]) for k in ("global_hit", "global_miss")}

    def register(self) -> None:
        self.n_active += 1
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._loop())

    def unregister(self) -> None:
        self.n_active -= 1
        self._wake.set()

    async def generate(self, session_id: int | None, seed: int,
                       prompt: Sequence[int] | None = None) -> tuple[int, Generation, dict[str, float]]:  # fmt: skip
        """One turn of a session (None: open one on `prompt` first) -> (session id, its Generation, the
        prefix-cache lookup counts of an opened session)."""
        if (session_id is None) == (prompt is None):
            raise ValueError("give a session id or a prompt to open one, not both")
        fut = asyncio.get_running_loop().create_future()
        with self._pending_lock:
            self._pending.append(_Request(session_id, seed, fut, None if prompt is None else list(prompt)))
        self._wake.set()
        return await fut

    async def load_weights(self, weights: dict, version: int) -> None:
        """New policy weights; the prefix cache starts empty (its states were computed under the old ones)."""
        self._loads_waiting += 1
        try:
            async with self.lock:
                await asyncio.get_running_loop().run_in_executor(
                    engine_thread(self.engine), self.engine.load_state_dict, weights, version
                )
                if self.engine.prefix_cache is not None:
                    self.engine.prefix_cache = fresh_prefix_cache(self.engine.prefix_cache)
                self._warmed.clear()
        finally:
            self._loads_waiting -= 1

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while self.n_active > 0 or self._pending:
            await self._wake.wait()
            self._wake.clear()
            if self._pending and len(self._pending) < self.n_active:
                if self.max_wait_s is None:
                    continue  # the next request (or an episode's end) wakes the loop again
                deadline = time.monotonic() + self.max_wait_s
                while self._pending and len(self._pending) < self.n_active and time.monotonic() < deadline:
                    await asyncio.sleep(self.max_wait_s / 5)
            if not self._pending:
                continue
            async with self.lock:
                await loop.run_in_executor(engine_thread(self.engine), self._call, loop)

    def _take(self, loop: asyncio.AbstractEventLoop, in_call: dict[int, _Request]) -> list[tuple[int, int]]:
        """(engine thread) The pending turns, their sessions opened: (session id, seed) each, recorded in
        `in_call`. A turn whose session cannot open gets the error; the others go on."""
        with self._pending_lock:
            batch, self._pending = self._pending, []
        out = []
        for r in batch:
            try:
                if r.session is None:
                    r.session, r.counts = self._open(r.prompt)
                    r.opened = True
            except Exception as e:
                loop.call_soon_threadsafe(_settle, r.future, None, e)
                continue
            in_call[r.session] = r
            out.append((r.session, r.seed))
        return out

    def _call(self, loop: asyncio.AbstractEventLoop) -> None:
        """(engine thread) One generate call over the pending turns; continuous with max_wait_s set."""
        in_call: dict[int, _Request] = {}
        continuous = self.max_wait_s is not None

        def finish(sid: int, gen: Generation) -> None:
            r = in_call.pop(sid, None)
            if r is not None:
                loop.call_soon_threadsafe(self._deliver, r, gen)

        def admit() -> list[tuple[int, int]]:
            return [] if self._loads_waiting else self._take(loop, in_call)

        first = self._take(loop, in_call)
        if not first:
            return
        s = self.sampling
        kw = {"admit": admit, "on_finish": finish} if continuous else {}
        # DSpark speculation when the engine has it: same contract and distribution as generate
        generate = self.engine.generate if self.engine.speculative is None else self.engine.generate_speculative
        try:
            gens = generate([sid for sid, _ in first], s.max_new_tokens, s.temperature, s.top_p, None, (),
                            [seed for _, seed in first], **kw)  # fmt: skip
        except Exception as e:  # every waiter learns why; the episodes turn it into an error
            for r in in_call.values():
                if r.opened:  # its episode never learns the id: a session it cannot close
                    self.engine.close(r.session)
                loop.call_soon_threadsafe(_settle, r.future, None, e)
            return
        # a call that was not continuous (or speculated) returns its sessions' results at its end
        for (sid, _), g in zip(first, gens):
            finish(sid, g)
        for r in list(in_call.values()):  # cannot happen: every joined session finishes in its call
            loop.call_soon_threadsafe(_settle, r.future, None, RuntimeError(f"session {r.session} got no result"))

    def _deliver(self, r: _Request, gen: Generation) -> None:
        self.tokens_generated += len(gen.token_ids)
        _settle(r.future, (r.session, gen, r.counts), None)


def _settle(fut: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)


def fresh_prefix_cache(old):
    """An empty PrefixCache with `old`'s settings (in memory: a rollout's states live for one version)."""
    from model.prefix_cache import PrefixCache

    return PrefixCache(packed=old.packed, window_ttl_s=old.window_ttl_s, clock=old.clock)


# ---------------------------------------------------------------------- the policy of one episode
def _as_template_message(m: Any) -> dict[str, Any]:
    """envs.protocol.Message (or a dict) -> the chat template's message dict."""
    if isinstance(m, dict):
        return m
    return {"role": m.role, "content": m.content}


class TokenPolicy:
    """`policy(messages) -> str` over one engine session. Keeps `messages` (template form: assistant
    turns carry their generated `token_ids`), the turn boundaries and every Generation."""

    def __init__(self, batcher: SessionBatcher, template: ChatTemplate, tools: Sequence[dict] | None, seed: int):
        self.batcher, self.template, self.tools, self.seed = batcher, template, list(tools or []), seed
        self.session: int | None = None
        self.messages: list[dict[str, Any]] = []
        self.turn_starts: list[int] = []
        self.generations: list[Generation] = []
        self.prefix_counts: dict[str, float] = {}
        self._n_seen = 0

    @property
    def engine(self) -> InferenceEngine:
        return self.batcher.engine

    def room(self) -> int:
        """Tokens left in the session before the engine's max_seq_len."""
        used = len(self.engine.tokens(self.session)) if self.session is not None else 0
        return self.engine.max_seq_len - used

    async def __call__(self, messages: Sequence[Any]) -> str:
        new = [_as_template_message(m) for m in messages[self._n_seen :]]
        seed = self.seed * 1_000_003 + len(self.generations)
        # a session in no engine call is the episode's own: extending it needs no lock (its tokens are
        # only recorded; the engine feeds them when the turn joins a call)
        if self.session is None:
            ids = self.template.render(new, tools=self.tools or None, add_generation_prompt=True).token_ids
            self.session, gen, self.prefix_counts = await self.batcher.generate(None, seed, ids)
            self.turn_starts.append(gen.prompt_len)
        else:
            self.engine.extend(self.session, self.template.render_continuation(new).token_ids)
            self.turn_starts.append(len(self.engine.tokens(self.session)))
            _, gen, _ = await self.batcher.generate(self.session, seed)
        self.messages += new
        self.generations.append(gen)
        ids = list(gen.token_ids)
        if gen.finish_reason != "stop":  # truncated turn: close it with <|end|> so the chat stays well-formed
            self.engine.extend(self.session, [self.template.tokenizer.end_id])
            ids.append(self.template.tokenizer.end_id)
        self.messages.append({"role": "assistant", "content": None, "token_ids": ids})
        self._n_seen = len(messages) + 1  # the episode loop appends this reply to its own list
        body = ids[:-1] if ids and ids[-1] in self.template.stop_ids else ids
        return self.template.tokenizer.decode(body)

    def close(self) -> None:
        if self.session is not None:
            self.engine.close(self.session)
            self.session = None

    def transcript(self) -> list[dict[str, Any]]:
        """The conversation so far in template form: `template.render(transcript, tools=<the episode's
        tools>)` gives the session's tokens back exactly (sandbox episodes: tool_schemas(task.tools))."""
        return [dict(m) for m in self.messages]

    def trajectory(self, req: RolloutRequest, **fields: Any) -> Trajectory:
        """The session as a Trajectory: tokens, mask = generated tokens, their log-probs and versions.
        A turn whose generate call raised (before or after committing tokens: then no returned Generation
        accounts for them and they have no log-probs) makes the trajectory infra-failed (kept for the
        record, excluded from its group and from training) instead of failing the whole job."""
        tokens = self.engine.tokens(self.session)
        versions = self.engine.token_versions(self.session)
        logprobs = [lp for g in self.generations for lp in g.logprobs]
        n_generated = sum(v is not None for v in versions)
        # a failed call leaves its turn start behind, possibly at the end of the tokens (nothing committed)
        turn_starts = [s for s in self.turn_starts if s < len(tokens)]
        if n_generated != len(logprobs) or len(self.turn_starts) > len(self.generations):
            verifier = dict(fields.get("verifier") or {})
            verifier["error"] = (f"generate call {len(self.generations) + 1} failed ({n_generated} generated tokens, "
                                 f"{len(logprobs)} log-probs): {verifier.get('error') or 'no error recorded'}")
            fields = {**fields, "infra_failed": True, "verifier": verifier}
            versions = [None] * len(versions)  # nothing of it is trained on
        it = iter(logprobs)
        lps = [next(it) if v is not None else float("nan") for v in versions]
        return Trajectory(
            token_ids=tokens, loss_mask=[v is not None for v in versions], logprobs=lps,
            versions=[-1 if v is None else v for v in versions], turn_starts=turn_starts,
            task_id=req.task_id, group_id=req.group_id, seed=req.seed, transcript=self.transcript(),
            rollout_stats=self.engine_stats(),
            routing=self.engine.routing(self.session) if self.engine.record_routing else None, **fields,
        )  # fmt: skip

    def engine_stats(self) -> dict[str, float]:
        """What the inference path did for this session: its packed cache bytes per token, CED replay
        segments (one per prefilled turn), prefix-cache lookups, DSpark drafts and acceptances."""
        engine, sid = self.engine, self.session
        n = len(engine.tokens(sid))
        stats = {"cache_bytes_per_token": sum(engine.cache_bytes(sid).values()) / max(n, 1),
                 "replay_segments": float(len(self.turn_starts)) if engine.prefill_mode == "ced" else 0.0,
                 **self.prefix_counts}  # fmt: skip
        if engine.speculative is not None:
            spec = engine.speculation_stats(sid)
            keys = ("steps", "drafted", "accepted", "emitted", "plain_steps", "off_calls")
            stats |= {f"spec_{k}": float(spec[k]) for k in keys}
        return stats


# ---------------------------------------------------------------------- episodes
@dataclass(kw_only=True)
class ToyTask:
    """An in-process task family for CPU runs: `n_turns` assistant turns, each answered by a fixed
    observation; reward 1 when the last reply contains `target` (a random policy does sometimes)."""

    task_id: str
    prompt: str
    target: str
    n_turns: int = 2

    def reward(self, last_reply: str) -> float:
        return 1.0 if self.target in last_reply else 0.0


# Substrings that a randomly initialised policy's 6-16-token replies contain 5-30% of the time (measured
# on uniform token ids of the default tokenizer): groups then have reward spread for GRPO.
TOY_TARGETS = ("x", "ing", "(", "q")


def toy_tasks(n: int, n_turns: int = 2) -> list[ToyTask]:
    return [
        ToyTask(task_id=f"toy-{i}", prompt=f"Task {i}: reply with a line that contains '{TOY_TARGETS[i % 4]}'.",
                target=TOY_TARGETS[i % len(TOY_TARGETS)], n_turns=n_turns)
        for i in range(n)
    ]  # fmt: skip


async def run_toy_episode(req: RolloutRequest, batcher: SessionBatcher, template: ChatTemplate) -> Trajectory:
    task = ToyTask(**req.task)
    policy = TokenPolicy(batcher, template, None, req.seed)
    t0 = time.monotonic()
    messages: list[dict[str, Any]] = [{"role": "user", "content": task.prompt}]
    reply = ""
    batcher.register()
    try:
        for turn in range(task.n_turns):
            reply = await policy(messages)
            messages.append({"role": "assistant", "content": reply})
            if turn + 1 < task.n_turns:
                messages.append({"role": "tool", "content": f"observation {turn}: keep going"})
            if policy.room() < batcher.sampling.max_new_tokens + 32:
                break
        reward = task.reward(reply)
        return policy.trajectory(req, reward=reward, verifier={"passed": reward == 1.0, "target": task.target},
                                 timings={"agent_s": time.monotonic() - t0})
    finally:
        batcher.unregister()
        policy.close()


async def run_sandbox_episode(
    req: RolloutRequest,
    batcher: SessionBatcher,
    template: ChatTemplate,
    sandbox_factory: Callable | None = None,
    grade: Callable | None = None,
    episode_config: Any = None,
) -> Trajectory:
    """One envs/episode.py episode in a Docker sandbox. Sandbox or policy errors (no grade) make the
    trajectory `infra_failed`: it is excluded from its group's statistics, not scored 0."""
    from envs.episode import run_episode
    from envs.task import Task
    from envs.tools import tool_schemas

    task = Task(**req.task)
    policy = TokenPolicy(batcher, template, tool_schemas(task.tools), req.seed)
    kwargs = sandbox_episode_kwargs(template, batcher.engine.max_seq_len, batcher.sampling.max_new_tokens,
                                    sandbox_factory, grade, episode_config)  # fmt: skip
    batcher.register()
    try:
        result = await run_episode(task, policy, **kwargs)
    finally:
        batcher.unregister()
    fields = graded_fields(result)
    try:
        if policy.session is None:  # the sandbox never started: no token was consumed
            return unstarted_trajectory(req, template, result, fields)
        return policy.trajectory(req, **fields)
    finally:
        policy.close()


def sandbox_episode_kwargs(template: ChatTemplate, max_seq_len: int, max_new_tokens: int,
                           sandbox_factory: Callable | None, grade: Callable | None, episode_config: Any) -> dict:
    """run_episode's keyword arguments: its token budget in real tokens, with room for one more generation and
    template overhead; the grader (by default pristine, in the task's budget) and the sandbox factory."""  # fmt: skip
    from envs.episode import EpisodeConfig
    from envs.grading import grade_in_budget

    config = episode_config or EpisodeConfig(max_turns=4, wall_time_s=300.0)
    config.max_tokens = min(config.max_tokens, max_seq_len - max_new_tokens - 64)
    tokenizer = template.tokenizer
    kwargs: dict[str, Any] = {"config": config, "grade": grade or grade_in_budget,
                              "count_tokens": lambda text: len(tokenizer.encode(text)) + 4}
    if sandbox_factory is not None:
        kwargs["sandbox_factory"] = sandbox_factory
    return kwargs


def graded_fields(result: Any) -> dict[str, Any]:
    """Trajectory fields of a finished run_episode: reward, verifier report, infra_failed, timings."""
    from envs.episode import UNGRADED

    tr, g = result.transcript, result.grade
    verifier = {"termination": tr.termination, "error": tr.error, "reason": None if g is None else g.reason,
                "passed": bool(g is not None and g.reward == 1.0), "tests": {} if g is None else dict(g.tests)}
    return {"reward": 0.0 if g is None else g.reward, "verifier": verifier,
            "infra_failed": tr.termination in UNGRADED or g is None,
            "timings": {"setup_s": tr.setup_s, "agent_s": tr.agent_s, "grade_s": tr.grade_s}}  # fmt: skip


def unstarted_trajectory(req: RolloutRequest, template: ChatTemplate, result: Any, fields: dict) -> Trajectory:
    """An episode whose policy was never called (its sandbox did not start): the prompt, infra-failed."""
    from envs.tools import tool_schemas

    prompt = template.render([_as_template_message(m) for m in result.transcript.messages[:2]],
                             tools=tool_schemas(req.task.get("tools")),
                             add_generation_prompt=True).token_ids  # fmt: skip
    n = len(prompt)
    return Trajectory(token_ids=prompt, loss_mask=[False] * n, logprobs=[float("nan")] * n, versions=[-1] * n,
                      turn_starts=[], task_id=req.task_id, group_id=req.group_id, seed=req.seed, infra_failed=True,
                      verifier=fields["verifier"], timings=fields["timings"])  # fmt: skip


EPISODE_KINDS = ("toy", "sandbox")
