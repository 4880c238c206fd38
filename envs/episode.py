"""The episode runner: one policy, one task, one sandbox, a multi-turn tool-calling loop, then grading.

`run_episode` is async (many episodes share one event loop; blocking sandbox calls run in threads) and
policy-agnostic: a policy is any callable `policy(messages) -> str`, sync or async, returning the next
assistant message text. It enforces turn, token and wall-time limits, records a `Transcript`, takes the
agent's diff, tears the container down on every exit path (exceptions, cancellation, KeyboardInterrupt),
and only then, when given a `grade` function, grades the diff in a pristine grader (envs/grading.py), so
the agent's container is not held while tests run. It does not tokenize: rollout workers keep token ids
and wrap their engine as a policy.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from envs import engine
from envs.grading import GradeResult, extract_patch
from envs.protocol import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, Message, ToolCall, parse_tool_calls
from envs.sandbox import Sandbox
from envs.tools import ToolConfig, ToolContext, ToolResult, execute_tool_call

if TYPE_CHECKING:
    from envs.task import Task

TerminationReason = Literal["submit", "max_turns", "max_tokens", "timeout", "policy_error", "sandbox_error"]
# Episodes that end for these reasons are infrastructure failures: not graded, reward None.
UNGRADED: frozenset[str] = frozenset({"policy_error", "sandbox_error"})

Policy = Callable[[list[Message]], "str | Awaitable[str]"]
# (task, the agent's diff against task.base_revision) -> grade; e.g. envs.grading.grade_patch, or
# functools.partial(grade_in_budget, pool=grader_pool) to grade in warm pristine graders under each task's
# measured budget.
GradeFn = Callable[["Task", str], GradeResult]
SandboxFactory = Callable[["Task"], contextlib.AbstractContextManager[Sandbox]]

# The tool schemas are not in this text: the chat template renders `tool_schemas()` into the system turn
# (model/chat_template.py `render(messages, tools=...)`), and OpenAI-style endpoints take them as `tools`.
# Short: it is prefill of every episode and every demonstration (with the schemas, model/chat_template.py).
SYSTEM_PROMPT = """You are a software engineer in the repository at {workdir} (no network). Fix the issue \
the user describes. Act only through tool calls, each written \
{open}{{"name": "<tool>", "arguments": {{...}}}}{close}; a call returns an observation. Call submit when done."""

NO_TOOL_CALL = (f"error: your message contained no tool call. Call a tool with {TOOL_CALL_OPEN}"
                f'{{"name": ..., "arguments": {{...}}}}{TOOL_CALL_CLOSE}, or call submit when you are done.')


def estimate_tokens(text: str) -> int:
    """Default token count: len(text) // 4, a rough average for English and code under BPE tokenizers.
    Pass the real tokenizer's counter when the limit must be exact."""
    return len(text) // 4


@dataclass(kw_only=True)
class EpisodeConfig:
    max_turns: int = 30  # policy calls
    max_tokens: int = 32_768  # whole conversation, as measured by the count_tokens callable
    wall_time_s: float = 900.0  # agent loop only; sandbox start-up and grading have their own budgets
    workdir: str = "/workspace"
    tools: ToolConfig = field(default_factory=ToolConfig)


@dataclass
class Turn:
    """One policy call and what it caused. `results[i]` answers `calls[i]`; calls after a submit are
    not executed (so `results` may be shorter)."""

    index: int
    assistant: str
    calls: list[ToolCall] = field(default_factory=list)
    parse_errors: list[str] = field(default_factory=list)
    results: list[ToolResult] = field(default_factory=list)
    policy_s: float = 0.0
    tools_s: float = 0.0
    n_tokens: int = 0  # conversation size after this turn


@dataclass
class Transcript:
    task_id: str
    messages: list[Message]
    turns: list[Turn] = field(default_factory=list)
    termination: TerminationReason | None = None
    error: str | None = None  # what went wrong, for policy_error / sandbox_error / failed grading
    n_tokens: int = 0
    setup_s: float = 0.0
    agent_s: float = 0.0
    grade_s: float = 0.0


@dataclass
class EpisodeResult:
    transcript: Transcript
    final_diff: str | None = None  # git diff of the workspace against task.base_revision (None: unavailable)
    grade: GradeResult | None = None

    @property
    def reward(self) -> float | None:
        """None means "no reward" (not graded, or an infrastructure failure): exclude, don't score 0."""
        return None if self.grade is None else self.grade.reward


def task_file(task: Task) -> str | None:
    """The one file a task is about, when its factory names one (verification["file"], relative to the
    workspace): `view` and `edit` act on it when the call gives no path, so a one-token fix needs no path."""
    return task.verification.get("file")


def initial_messages(task: Task, config: EpisodeConfig) -> list[Message]:
    system = SYSTEM_PROMPT.format(workdir=config.workdir, open=TOOL_CALL_OPEN, close=TOOL_CALL_CLOSE)
    return [Message("system", system), Message("user", task.problem_statement)]


def _is_async_callable(fn: Any) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


async def call_policy(policy: Policy, messages: list[Message]) -> str:
    """Adapter: await an async policy, run a sync one in a worker thread (it may block on HTTP)."""
    if _is_async_callable(policy):
        out = await policy(messages)
    else:
        out = await asyncio.to_thread(policy, messages)
        if inspect.isawaitable(out):
            out = await out
    if not isinstance(out, str):
        raise TypeError(f"policy returned {type(out).__name__}, expected str")
    return out


def default_sandbox(task: Task) -> contextlib.AbstractContextManager[Sandbox]:
    return Sandbox(image=task.image, labels={"flashpost.task_id": task.task_id})


class _SandboxHandle:
    """Enters a sandbox context manager in a worker thread and guarantees exactly one exit, including
    when the awaiting coroutine is cancelled while the container is still starting."""

    def __init__(self, cm: contextlib.AbstractContextManager[Sandbox]):
        self._cm, self._lock = cm, threading.Lock()
        self._entered = self._abandoned = self._closed = False

    def _enter(self) -> Sandbox:
        sb = self._cm.__enter__()
        with self._lock:
            self._entered, abandoned = True, self._abandoned
        if abandoned:
            self._exit()
        return sb

    def _exit(self) -> None:
        with self._lock:
            if self._closed or not self._entered:
                return
            self._closed = True
        self._cm.__exit__(None, None, None)

    async def open(self) -> Sandbox:
        try:
            return await asyncio.to_thread(self._enter)
        except BaseException:
            with self._lock:
                self._abandoned = True
            self._exit()  # no-op unless the start finished but its result never reached us
            raise

    async def close(self) -> None:
        # The thread runs to completion even if this await is cancelled, and the interpreter joins it.
        await asyncio.to_thread(self._exit)


async def run_episode(
    task: Task,
    policy: Policy,
    *,
    config: EpisodeConfig | None = None,
    grade: GradeFn | None = None,
    count_tokens: Callable[[str], int] = estimate_tokens,
    sandbox_factory: SandboxFactory = default_sandbox,
) -> EpisodeResult:
    """Run one episode of `policy` on `task` in a fresh sandbox, then grade its diff when `grade` is given.

    Episodes ending in policy_error or sandbox_error get no diff and no grade (reward None: an
    infrastructure failure, not a 0). A workspace whose diff cannot be taken (the agent broke the git
    repo) is graded 0 without running tests. A sandbox the engine fails to remove afterwards leaves the
    episode as it ended, graded, with `.error` saying so. Never raises for policy, tool, sandbox or grading
    errors (see `Transcript.termination` / `.error`); cancellation and KeyboardInterrupt propagate after teardown.
    """
    config = config or EpisodeConfig()
    transcript = Transcript(task_id=task.task_id, messages=initial_messages(task, config))
    result = EpisodeResult(transcript=transcript)
    t0 = time.monotonic()
    no_diff: str | None = None
    try:
        handle = _SandboxHandle(sandbox_factory(task))
        sb = await handle.open()
    except Exception as e:
        transcript.termination, transcript.error = "sandbox_error", f"sandbox start: {type(e).__name__}: {e}"
        return result
    try:
        transcript.setup_s = time.monotonic() - t0
        ctx = ToolContext(config=config.tools, test_command=task.test_command, workdir=config.workdir,
                          deadline=time.monotonic() + config.wall_time_s, default_path=task_file(task))
        t1 = time.monotonic()
        await _agent_loop(sb, policy, ctx, config, count_tokens, transcript)
        transcript.agent_s = time.monotonic() - t1
        if transcript.termination not in UNGRADED:
            no_diff = await _take_diff(task, sb, result)
    finally:
        try:
            await handle.close()
        except Exception as e:  # noqa: BLE001 - the episode and its diff are complete: a removal the
            # engine does not finish (a stalled engine) must not void them; the reaper removes the container
            transcript.error = transcript.error or f"sandbox removal: {type(e).__name__}: {e}"
    if grade is not None and transcript.termination not in UNGRADED:
        await _grade(task, grade, no_diff, result)
    return result


async def _take_diff(task: Task, sb: Sandbox, result: EpisodeResult) -> str | None:
    """Fill result.final_diff; returns why there is none when that is the agent's doing."""
    try:
        result.final_diff = await asyncio.to_thread(extract_patch, sb, task)
    except (RuntimeError, engine.PathNotFound) as e:  # git failed in the workspace the agent controls
        return str(e)
    except Exception as e:
        result.transcript.error = f"diff: {type(e).__name__}: {e}"
    return None


async def _grade(task: Task, grade: GradeFn, no_diff: str | None, result: EpisodeResult) -> None:
    t0 = time.monotonic()
    if result.final_diff is not None:
        try:
            result.grade = await asyncio.to_thread(grade, task, result.final_diff)
        except Exception as e:
            result.transcript.error = f"grading: {type(e).__name__}: {e}"
    elif no_diff is not None:
        result.grade = GradeResult(0.0, {}, False, f"no patch: {no_diff}", 0.0)
    result.transcript.grade_s = time.monotonic() - t0


async def _agent_loop(sb: Sandbox, policy: Policy, ctx: ToolContext, config: EpisodeConfig,
                      count_tokens: Callable[[str], int], tr: Transcript) -> None:
    """Fill `tr` turn by turn until a limit, a submit, or an error sets `tr.termination`."""
    assert ctx.deadline is not None
    tr.n_tokens = sum(count_tokens(m.content) for m in tr.messages)
    for index in range(config.max_turns):
        if tr.n_tokens >= config.max_tokens:
            tr.termination = "max_tokens"
            return
        remaining = ctx.deadline - time.monotonic()
        if remaining <= 0:
            tr.termination = "timeout"
            return
        t0 = time.monotonic()
        try:
            async with asyncio.timeout(remaining) as budget:
                text = await call_policy(policy, list(tr.messages))
        except Exception as e:
            if isinstance(e, TimeoutError) and budget.expired():
                tr.termination = "timeout"
            else:
                tr.termination, tr.error = "policy_error", f"{type(e).__name__}: {e}"
            return
        turn = Turn(index=index, assistant=text, policy_s=time.monotonic() - t0)
        tr.turns.append(turn)
        tr.messages.append(Message("assistant", text))
        tr.n_tokens += count_tokens(text)
        turn.n_tokens = tr.n_tokens
        if tr.n_tokens > config.max_tokens:  # the reply overran the budget; its calls are not run
            tr.termination = "max_tokens"
            return
        turn.calls, turn.parse_errors = parse_tool_calls(text)
        observations = [Message("tool", f"error: {err}") for err in turn.parse_errors]
        if not turn.calls and not turn.parse_errors:
            observations.append(Message("tool", NO_TOOL_CALL))
        t1 = time.monotonic()
        for call in turn.calls:
            try:
                res = await asyncio.to_thread(execute_tool_call, sb, call, ctx)
            except Exception as e:
                turn.tools_s = time.monotonic() - t1
                tr.termination, tr.error = "sandbox_error", f"tool {call.name}: {type(e).__name__}: {e}"
                return
            turn.results.append(res)
            observations.append(Message("tool", res.output, name=call.name))
            if res.ends_episode:
                break
        turn.tools_s = time.monotonic() - t1
        tr.messages.extend(observations)
        tr.n_tokens += sum(count_tokens(m.content) for m in observations)
        turn.n_tokens = tr.n_tokens
        if any(r.ends_episode for r in turn.results):
            tr.termination = "submit"
            return
        if time.monotonic() >= ctx.deadline:
            tr.termination = "timeout"
            return
    tr.termination = "max_turns"


def run_episode_sync(task: Task, policy: Policy, **kwargs: Any) -> EpisodeResult:
    """`run_episode` for callers without an event loop (scripts, tests)."""
    return asyncio.run(run_episode(task, policy, **kwargs))
