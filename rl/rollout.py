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
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from model.chat_template import ChatTemplate
from model.engine import Generation, InferenceEngine
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
class SessionBatcher:
    """The episodes of one group, one engine: their pending `generate` requests run as one batched
    `InferenceEngine.generate` (in a thread, so the event loop keeps serving tool calls and other
    groups). A batch is dispatched once every registered episode waits for the policy, or, with
    `max_wait_s` set (sandbox episodes), after that long: an episode busy in a tool does not hold the
    others back. In-process episodes use None, so a group's batches, hence its numbers, are the same
    on every run. `lock` serialises engine access between the batchers of one worker and weight loads
    (tokens carry the version they were sampled under)."""

    def __init__(self, engine: InferenceEngine, sampling: SamplingParams, max_wait_s: float | None = None,
                 lock: asyncio.Lock | None = None):  # fmt: skip
        self.engine = engine
        self.sampling = sampling
        self.max_wait_s = max_wait_s
        self.lock = lock or asyncio.Lock()
        self.n_active = 0
        self._pending: list[tuple[int, int, asyncio.Future]] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._warmed: set[tuple[int, ...]] = set()
        self.tokens_generated = 0

    async def start(self, prompt_ids: list[int]) -> tuple[int, dict[str, float]]:
        """Open a session on a prompt -> (session id, its prefix-cache lookup counts). With the engine's
        prefix cache the first session of a prompt in this batcher prefills all but its last token once
        and stores that state, so the group's other samples restore it and feed one token each: the shared
        prompt is prefilled once (a lookup leaves at least one token to feed)."""
        cache = self.engine.prefix_cache
        async with self.lock:  # sessions change only between batched generate calls
            if cache is None:
                return self.engine.start(prompt_ids), {}
            key = tuple(prompt_ids[:-1])
            if len(prompt_ids) > 1 and key not in self._warmed:
                self._warmed.add(key)
                await asyncio.to_thread(self._warm, list(key))
            before = dict(cache.counters)
            sid = self.engine.start(prompt_ids)
        return sid, {f"prefix_{k}": float(cache.counters[k] - before[k]) for k in ("global_hit", "global_miss")}

    def _warm(self, ids: list[int]) -> None:
        sid = self.engine.start(ids)
        try:
            self.engine.prefill([sid])
        finally:
            self.engine.close(sid)

    def register(self) -> None:
        self.n_active += 1
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._loop())

    def unregister(self) -> None:
        self.n_active -= 1
        self._wake.set()

    async def generate(self, session_id: int, seed: int) -> Generation:
        fut = asyncio.get_running_loop().create_future()
        self._pending.append((session_id, seed, fut))
        self._wake.set()
        return await fut

    async def load_weights(self, weights: dict, version: int) -> None:
        """New policy weights; the prefix cache starts empty (its states were computed under the old ones)."""
        async with self.lock:
            await asyncio.to_thread(self.engine.load_state_dict, weights, version)
            if self.engine.prefix_cache is not None:
                self.engine.prefix_cache = fresh_prefix_cache(self.engine.prefix_cache)

    async def _loop(self) -> None:
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
            batch, self._pending = self._pending, []
            s = self.sampling
            try:
                # DSpark speculation when the engine has it: same contract and distribution as generate
                generate = self.engine.generate if self.engine.speculative is None else self.engine.generate_speculative
                async with self.lock:
                    gens = await asyncio.to_thread(
                        generate, [b[0] for b in batch], s.max_new_tokens, s.temperature, s.top_p,
                        None, (), [b[1] for b in batch],
                    )  # fmt: skip
            except Exception as e:  # every waiter learns why; the episodes turn it into an error
                for _, _, fut in batch:
                    if not fut.done():
                        fut.set_exception(e)
                continue
            for (_, _, fut), g in zip(batch, gens):
                self.tokens_generated += len(g.token_ids)
                if not fut.done():
                    fut.set_result(g)


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
        if self.session is None:
            ids = self.template.render(new, tools=self.tools or None, add_generation_prompt=True).token_ids
            self.session, self.prefix_counts = await self.batcher.start(ids)
        else:
            async with self.batcher.lock:  # sessions change only between batched generate calls
                self.engine.extend(self.session, self.template.render_continuation(new).token_ids)
        self.messages += new
        self.turn_starts.append(len(self.engine.tokens(self.session)))
        gen = await self.batcher.generate(self.session, self.seed * 1_000_003 + len(self.generations))
        self.generations.append(gen)
        ids = list(gen.token_ids)
        if gen.finish_reason != "stop":  # truncated turn: close it with <|end|> so the chat stays well-formed
            async with self.batcher.lock:
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
    template overhead; the grader (pristine by default) and the sandbox factory."""  # fmt: skip
    from envs.episode import EpisodeConfig
    from envs.grading import grade_patch

    config = episode_config or EpisodeConfig(max_turns=4, wall_time_s=300.0)
    config.max_tokens = min(config.max_tokens, max_seq_len - max_new_tokens - 64)
    tokenizer = template.tokenizer
    kwargs: dict[str, Any] = {"config": config, "grade": grade or grade_patch,
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
