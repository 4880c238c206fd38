"""Episode runner against real sandboxes: a scripted solve, malformed calls, every limit, teardown.

Policies here are plain test functions returning fixed assistant messages (our own test code).
Every test checks, through the engine's label query, that it left no container behind.
"""

import asyncio
import dataclasses
import time

import pytest
import requests.exceptions

from envs import engine
from envs.episode import (
    NO_TOOL_CALL,
    EpisodeConfig,
    initial_messages,
    run_episode,
    run_episode_sync,
)
from envs.fixtures.build import fixture_tasks
from envs.grading import grade_patch
from envs.protocol import format_tool_call
from envs.sandbox import Sandbox

pytestmark = pytest.mark.docker

BUGGY = "if merged and start < merged[-1][1]:"
FIXED = "if merged and start <= merged[-1][1]:"


@pytest.fixture(scope="module")
def task(base_image):
    (t,) = [t for t in fixture_tasks() if t.task_id == "calkit-merge-touching"]
    return t


def _ours() -> set[str]:
    return {c["Id"] for c in engine.list_containers({engine.LABEL_OWNER: engine.owner_id()})}


@pytest.fixture(autouse=True)
def no_leaked_containers(engine_ready):
    before = _ours()
    yield
    leaked = _ours() - before
    assert not leaked, f"episode left containers behind: {[c[:12] for c in leaked]}"


def scripted(*replies: str):
    """A policy that answers turn i with replies[i]."""
    it = iter(replies)

    def policy(messages):
        reply = next(it, None)
        assert reply is not None, "the scripted policy ran out of replies"
        return reply

    return policy


def call(name, **arguments):
    return format_tool_call(name, arguments)


def tool_outputs(result, turn):
    return [r.output for r in result.transcript.turns[turn].results]


def test_scripted_policy_solves_the_fixture_task(task):
    policy = scripted(
        "Let me read the code and run the tests." + call("view", path="calkit/intervals.py")
        + call("run_tests"),
        "The comparison excludes touching intervals." + call("edit", path="calkit/intervals.py",
                                                             old_str=BUGGY, new_str=FIXED),
        call("run_tests"),
        call("submit"),
    )
    result = run_episode_sync(task, policy, config=EpisodeConfig(max_turns=6), grade=grade_patch)
    tr = result.transcript
    assert tr.termination == "submit" and tr.error is None
    assert [len(t.results) for t in tr.turns] == [2, 1, 1, 1]
    view, before = tool_outputs(result, 0)
    assert BUGGY in view and "     9\t" in view
    assert "1 failed" in before and before.endswith("[exit code: 1]")
    assert FIXED in tool_outputs(result, 1)[0]
    after = tool_outputs(result, 2)[0]
    assert "failed" not in after and after.endswith("[exit code: 0]")
    assert [m.role for m in tr.messages] == ["system", "user"] + ["assistant", "tool", "tool"] + [
        "assistant", "tool"] * 3
    assert [m.name for m in tr.messages if m.role == "tool"] == ["view", "run_tests", "edit", "run_tests",
                                                                 "submit"]
    assert tr.messages[1].content == task.problem_statement
    assert tr.n_tokens == sum(len(m.content) // 4 for m in tr.messages)
    assert f"-        {BUGGY}\n+        {FIXED}\n" in result.final_diff
    assert result.reward == 1.0, result.grade.reason
    assert result.grade.tests["tests/test_intervals.py::test_merge_touching"] == "passed"


def test_doing_nothing_scores_zero_and_without_a_grader_there_is_no_reward(task):
    graded = run_episode_sync(task, scripted(call("submit")), grade=grade_patch)
    assert graded.final_diff == "" and graded.reward == 0.0
    assert graded.grade.tests["tests/test_intervals.py::test_merge_touching"] == "failed"
    ungraded = run_episode_sync(task, scripted(call("edit", path="calkit/intervals.py", old_str=BUGGY,
                                                    new_str=FIXED) + call("submit")))
    assert ungraded.transcript.termination == "submit" and FIXED in ungraded.final_diff
    assert ungraded.grade is None and ungraded.reward is None


def test_a_workspace_without_its_git_repo_scores_zero_without_running_tests(task):
    policy = scripted(call("bash", command="rm -rf .git") + call("submit"))
    result = run_episode_sync(task, policy, grade=_must_not_grade)
    assert result.final_diff is None and result.reward == 0.0
    assert result.grade.reason.startswith("no patch:")


def test_malformed_calls_become_observations_and_the_episode_continues(task):
    replies = {
        "I think the bug is in dates.": NO_TOOL_CALL,
        "<tool_call>{not json}</tool_call>": "error: tool call is not valid JSON",
        call("launch_missiles"): "error: unknown tool 'launch_missiles'",
        call("bash"): "error: invalid arguments for bash: missing required argument arguments.command",
        call("bash", command=5): "arguments.command must be string, got integer",
        call("view", path="README.md", extra=1): "unexpected argument arguments.extra",
        '<tool_call>{"name": "bash", "arguments": {"command": "ls"}': "error: unterminated <tool_call>",
        call("bash", command="echo still-alive"): "still-alive\n[exit code: 0]",
    }
    policy = scripted(*replies, call("submit"))
    result = run_episode_sync(task, policy)
    tr = result.transcript
    assert tr.termination == "submit" and len(tr.turns) == len(replies) + 1
    observations = [m for m in tr.messages[2:] if m.role == "tool"]
    assert len(observations) == len(replies) + 1
    for obs, expected in zip(observations, replies.values(), strict=False):
        assert expected in obs.content, (expected, obs.content)
    assert observations[0].name is None and observations[-2].name == "bash"


def test_async_policy_object_and_max_turns(task):
    class Looper:
        calls = 0

        async def __call__(self, messages):
            self.calls += 1
            await asyncio.sleep(0)
            return call("bash", command=f"echo turn {self.calls}")

    looper = Looper()
    result = run_episode_sync(task, looper, config=EpisodeConfig(max_turns=3))
    assert result.transcript.termination == "max_turns" and looper.calls == 3
    assert [tool_outputs(result, i)[0] for i in range(3)] == [f"turn {i}\n[exit code: 0]" for i in (1, 2, 3)]


def test_max_tokens_stops_before_running_an_overlong_reply(task):
    config = EpisodeConfig()
    prompt = sum(len(m.content) for m in initial_messages(task, config))
    config.max_tokens = prompt + 100
    reply = call("create", path="marker.txt", content="x" * 200)
    result = run_episode_sync(task, scripted(reply), config=config, count_tokens=len)
    tr = result.transcript
    assert tr.termination == "max_tokens" and tr.n_tokens == prompt + len(reply)
    assert tr.messages[-1].content == reply and tr.turns[0].results == []  # recorded, not executed


def test_max_tokens_counts_observations(task):
    config = EpisodeConfig()
    config.max_tokens = sum(len(m.content) for m in initial_messages(task, config)) + 3000
    policy = scripted(call("bash", command="head -c 5000 /dev/zero | tr '\\0' y"), call("submit"))
    result = run_episode_sync(task, policy, config=config, count_tokens=len)
    assert result.transcript.termination == "max_tokens" and len(result.transcript.turns) == 1
    assert result.transcript.turns[0].results[0].exit_code == 0


def test_wall_time_limit_stops_a_hanging_policy(task):
    async def hangs(messages):
        await asyncio.sleep(3600)

    t0 = time.monotonic()
    result = run_episode_sync(task, hangs, config=EpisodeConfig(wall_time_s=1.0))
    assert result.transcript.termination == "timeout" and time.monotonic() - t0 < 10


def test_wall_time_limit_clips_a_long_tool_call(task):
    policy = scripted(call("bash", command="sleep 60", timeout=600), call("submit"))
    t0 = time.monotonic()
    result = run_episode_sync(task, policy, config=EpisodeConfig(wall_time_s=1.5))
    assert result.transcript.termination == "timeout" and time.monotonic() - t0 < 12
    assert result.transcript.turns[0].results[0].timed_out


def _must_not_grade(task, patch):
    pytest.fail("episodes that end in an infrastructure failure must not be graded")


@pytest.mark.parametrize(
    ("policy", "error"),
    [
        (scripted(call("bash", command="true")), "AssertionError: the scripted policy ran out of replies"),
        (lambda messages: 42, "TypeError: policy returned int, expected str"),
    ],
)
def test_policy_errors_end_the_episode_ungraded(task, policy, error):
    result = run_episode_sync(task, policy, grade=_must_not_grade)
    assert result.transcript.termination == "policy_error" and result.transcript.error.startswith(error)
    assert result.reward is None


def test_sandbox_dying_mid_episode_is_a_sandbox_error(task):
    boxes = []

    def factory(t):
        boxes.append(Sandbox(t.image, labels={"flashpost.task_id": t.task_id}))
        return boxes[-1]

    def policy(messages):
        if len(messages) > 2:  # second turn: the container disappears under the agent
            engine.remove_container(boxes[0].container_id)
        return call("bash", command="echo hi")

    result = run_episode_sync(task, policy, grade=_must_not_grade, sandbox_factory=factory)
    tr = result.transcript
    assert tr.termination == "sandbox_error" and tr.error.startswith("tool bash:")
    assert len(tr.turns) == 2 and result.reward is None


def test_sandbox_that_cannot_start_is_a_sandbox_error(task):
    missing = dataclasses.replace(task, image="flashpost/no-such-image:none")
    result = run_episode_sync(missing, scripted(), grade=_must_not_grade)
    assert result.transcript.termination == "sandbox_error"
    assert result.transcript.error.startswith("sandbox start:") and result.transcript.turns == []


def test_keyboard_interrupt_propagates_after_teardown(task):
    def interrupted(messages):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_episode_sync(task, interrupted)


def test_cancellation_while_the_sandbox_starts_still_removes_it(task):
    async def main():
        episode = asyncio.create_task(run_episode(task, scripted()))
        await asyncio.sleep(0.05)  # container creation is in flight in a worker thread
        episode.cancel()
        with pytest.raises(asyncio.CancelledError):
            await episode

    asyncio.run(main())  # returns after the worker thread finished starting and removing it


def test_concurrent_episodes_share_a_loop_but_not_a_workspace(task):
    def writer(name):
        return scripted(call("create", path=f"{name}.txt", content=name), call("bash", command="ls *.txt"),
                        call("submit"))

    async def main():
        return await asyncio.gather(run_episode(task, writer("left")), run_episode(task, writer("right")))

    left, right = asyncio.run(main())
    assert tool_outputs(left, 1) == ["left.txt\n[exit code: 0]"]
    assert tool_outputs(right, 1) == ["right.txt\n[exit code: 0]"]
    assert "+right" in right.final_diff and "left" not in right.final_diff


class FakeStalledEngineRemoval:
    """The Docker engine's remove call as a stalled engine answers it once: docker-py's read timeout, the
    container left in place (the engine is the boundary we do not own); later removals go through."""

    def __init__(self, real):
        self.real, self.refused = real, []

    def __call__(self, container_id, **kwargs):
        if self.refused:
            return self.real(container_id, **kwargs)
        self.refused.append(container_id)
        raise requests.exceptions.ReadTimeout("Read timed out. (read timeout=120)")


def test_a_sandbox_the_engine_does_not_remove_keeps_the_episode_and_its_grade(task, monkeypatch):
    api = engine.client().api
    stalled = FakeStalledEngineRemoval(api.remove_container)
    replies = iter([call("edit", path="calkit/intervals.py", old_str=BUGGY, new_str=FIXED), call("submit")])

    def policy(messages):  # the engine stalls once the agent's sandbox is up: its removal is the first refused
        monkeypatch.setattr(api, "remove_container", stalled)
        return next(replies)

    try:
        result = run_episode_sync(task, policy, config=EpisodeConfig(max_turns=4), grade=grade_patch)
        tr = result.transcript
        assert tr.termination == "submit" and result.reward == 1.0, (tr.termination, tr.error)
        assert tr.error.startswith("sandbox removal: EngineUnavailable: the Docker engine did not remove container")
        assert "docker rm -f" in tr.error
        # the agent's container is still there (only its removal stalled); the grader's went through
        assert len(stalled.refused) == 1 and engine.container_running(stalled.refused[0])
    finally:
        monkeypatch.undo()
        for cid in stalled.refused:
            engine.remove_container(cid)
