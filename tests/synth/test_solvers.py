"""The solver ensemble on a real task (real containers, real grading): the search agent, a policy
checkpoint through model/engine.py (random tiny weights saved here: it fails, and the test checks the
plumbing — episodes ran token-in/token-out, a matrix row was recorded, a failure is a 0, not a crash),
and an LLM agent over the OpenAI protocol (FakeOpenAIServer, tests/fakes, replays a scripted tool-call
conversation that fixes a task of the sample repository: its row passes). Then the inspector accepts
the task with the matrix, and its trajectory rules flag history access, test edits and outside reads.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from envs import engine
from envs.episode import EpisodeConfig
from envs.pool import GraderPool
from envs.protocol import format_tool_call
from envs.task import Task
from synth import mutations
from synth.config import SAMPLE_REPO, Context, FactoryOptions, PolicySolverOptions
from synth.records import RepoRecord, TaskRecord
from synth.stages import feasibility, inspect, solve, specify
from synth.stages.build import build_task

_spec = importlib.util.spec_from_file_location("fake_openai", Path(__file__).parents[1] / "fakes" / "fake_openai.py")
fake_openai = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fake_openai)

pytestmark = pytest.mark.docker

# What a competent agent says, turn by turn, on the sample task below: look, fix, check, submit.
SCRIPT = [
    "Let me look at the wrapping code.\n" + format_tool_call("view", {"path": "minikit/text.py"}),
    "The blank-line test is inverted.\n" + format_tool_call("edit", {"path": "minikit/text.py",
                                                                      "old_str": "if not (not line):",
                                                                      "new_str": "if not line:"}),
    format_tool_call("run_tests", {}),
    "Fixed.\n" + format_tool_call("submit", {}),
]


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> TaskRecord:
    """A task of the shipped sample repository, specified from real runs and built like the factory does."""
    if not engine.engine_available():
        pytest.skip("no Docker engine answers: run `bash infra/docker/ensure_engine.sh` (or `make test`)")
    engine.ensure_base_image(build=True)
    root = tmp_path_factory.mktemp("solvers")
    ctx = Context(FactoryOptions(out_dir=str(root)), root)
    try:
        repo = feasibility.process(RepoRecord(key="sample-solvers", source="sample", path=str(SAMPLE_REPO)), ctx)
        assert repo.ok, repo.drop_reason
        source = (SAMPLE_REPO / "minikit/text.py").read_text()
        m = next(m for m in mutations.find_mutations("minikit/text.py", source)
                 if m.kind == "inverted_condition" and m.old == "not line")
        spec = specify.process((repo, m), ctx)
        assert spec.ok, spec.drop_reason
        rec = build_task(spec, ctx)
    finally:
        ctx.close()
    assert rec.ok, rec.drop_reason
    return rec


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    from model.checkpoint import save_checkpoint
    from model.config import get_flavor
    from model.engram import EngramHasher
    from model.tokenizer import Tokenizer
    from model.transformer import Transformer

    args = get_flavor("tiny", max_seq_len=4096)
    model = Transformer(args, engram_hasher=EngramHasher(args, Tokenizer.default()))
    model.init_weights(seed=0)
    return save_checkpoint(model, tmp_path_factory.mktemp("ckpt") / "tiny-random.safetensors", args=args)


def test_ensemble_pass_matrix_search_policy_and_llm(built, checkpoint, tmp_path):
    with fake_openai.FakeOpenAIServer(SCRIPT) as srv:
        opts = FactoryOptions(out_dir=str(tmp_path), solver_attempts=1)
        opts.solvers.llm.base_url, opts.solvers.llm.model = srv.base_url, "fake-coder"
        opts.solvers.policy = PolicySolverOptions(checkpoint=str(checkpoint), max_turns=2, max_new_tokens=24,
                                                  temperature=1.0)
        ctx = Context(opts, tmp_path)
        try:
            solved = solve.process(built, ctx)
        finally:
            ctx.close()
    matrix = solved.pass_matrix
    assert set(matrix) == {"search", "policy:tiny-random", "llm:fake-coder"}
    assert all(len(row) == 1 for row in matrix.values())

    # the LLM row: the scripted conversation went over the wire turn by turn and its fix graded 1
    assert matrix["llm:fake-coder"] == [1.0]
    assert "+        if not line:" in solved.solutions["llm:fake-coder"]
    assert len(srv.requests) == len(SCRIPT)
    last = srv.requests[-1]["body"]["messages"]
    assert last[1] == {"role": "user", "content": built.task["problem_statement"]}
    assert any("Edited /workspace/minikit/text.py" in m["content"] for m in last if m["role"] == "user")
    llm = solved.verdicts["episode_trajectories"]["llm:fake-coder"][0]
    assert llm["termination"] == "submit" and [c["name"] for c in llm["calls"]] == ["view", "edit", "run_tests",
                                                                                     "submit"]
    assert llm["touched"] == ["minikit/text.py"]

    # the policy row: random weights, real engine episodes, graded to a 0 (not an error)
    assert matrix["policy:tiny-random"] == [0.0]
    pol = solved.verdicts["episode_trajectories"]["policy:tiny-random"][0]
    assert pol["turns"] >= 1 and pol["termination"] in ("max_turns", "submit"), pol
    assert pol["reward"] == 0.0 and pol["grade_reason"]

    rec = inspect.process(solved, Context(FactoryOptions(out_dir=str(tmp_path), gold_runs=1, flaky_reruns=1),
                                          tmp_path))
    assert rec.ok, rec.drop_reason
    stored = Task.from_dict(rec.task).verification["solver_pass_matrix"]
    assert stored["llm:fake-coder"] == [1.0] and stored["policy:tiny-random"] == [0.0]
    assert rec.verdicts["trajectory_gate"] and rec.verdicts["trajectory_flags"]["llm:fake-coder"] == [[]]


def test_policy_that_runs_out_of_context_scores_zero_not_a_crash(built, checkpoint, tmp_path):
    from envs.episode import initial_messages
    from envs.tools import tool_schemas
    from synth.policy import CheckpointModel

    task = Task.from_dict(built.task)
    probe = CheckpointModel(PolicySolverOptions(checkpoint=str(checkpoint)))
    prompt = probe.template.render(initial_messages(task, EpisodeConfig()), tools=tool_schemas(),
                                   add_generation_prompt=True).token_ids
    # room for the first turn only: the second turn's observation no longer fits
    model = CheckpointModel(PolicySolverOptions(checkpoint=str(checkpoint), max_seq_len=len(prompt) + 8,
                                                max_new_tokens=4))
    out = TaskRecord.from_dict(built.to_dict())
    ctx = Context(FactoryOptions(out_dir=str(tmp_path), solver_attempts=2), tmp_path)
    with GraderPool(max_graders=1, graders_per_image=1) as pool:
        solve.run_episodes(model.name, model.policy, task, out, ctx, pool, config=EpisodeConfig(max_turns=3),
                           count_tokens=model.count_tokens)
    assert out.pass_matrix[model.name] == [0.0, 0.0]
    notes = out.verdicts["episode_trajectories"][model.name]
    assert [(n["termination"], n["turns"]) for n in notes] == [("policy_error", 1), ("policy_error", 1)]
    assert "ContextFull" in notes[0]["error"] and notes[0]["reward"] is None
    assert model.open_sessions == set()  # the engine sessions were closed although the episodes failed


def _note(*calls: tuple[str, dict], touched=(), reward=1.0) -> dict:
    return {"reward": reward, "touched": list(touched),
            "calls": [{"name": n, "args": json.dumps(a)} for n, a in calls]}


def test_trajectory_rules(built):
    task = Task.from_dict(built.task)
    flags = inspect.trajectory_flags
    assert flags(_note(("view", {"path": "minikit/text.py"}), ("bash", {"command": "python -m pytest -q"}),
                       touched=["minikit/text.py"]), task) == []
    assert flags(_note(("bash", {"command": "git log -p | head"})), task) == ["git history access"]
    assert flags(_note(("bash", {"command": "cat .git/ORIG_HEAD"})), task) == ["git history access"]
    assert flags(_note(("edit", {"path": "tests/test_text.py", "old_str": "5", "new_str": "-1"})), task) == [
        "test file edit"]
    assert flags(_note(("bash", {"command": "sed -i s/5/-1/ tests/test_text.py"})), task) == ["test file edit"]
    assert flags(_note(touched=["tests/test_text.py"]), task) == ["test file edit"]
    assert flags(_note(("view", {"path": "/root/solution.py"})), task) == ["read outside the workspace"]
    assert flags(_note(("bash", {"command": "cat /opt/gold.diff"})), task) == ["read outside the workspace"]
    assert flags(_note(("bash", {"command": "ls /workspace/minikit && cat /tmp/x"})), task) == []
