"""Family F against real containers: the factory's tasks from the sample repository become demo
instances whose observation was seen in a sandbox, whose demonstration (the solver's fix) scores 1
in the real batch grader on the pristine image, and whose unfixed function scores 0."""

from __future__ import annotations

import ast
import re

import pytest

from envs.pool import GraderPool
from rl.demo_learning import demo_args, grade_actions, policy_of_args, sft_example
from synth.factory_family import build_sample_tasks, factory_instances
from synth.families import apply_action, module_source

pytestmark = [pytest.mark.docker, pytest.mark.slow]


@pytest.fixture(scope="module")
def family_f(engine_ready, tmp_path_factory):
    out = tmp_path_factory.mktemp("factory")
    stats = build_sample_tasks(out, budget=3, seed=0, progress=False)
    insts, tasks, left_out = factory_instances(out, heldout_share=0.5)
    return stats, insts, tasks, left_out


def test_every_accepted_task_is_an_instance_or_left_out_with_a_reason(family_f):
    stats, insts, tasks, left_out = family_f
    assert stats["tasks"] >= 3 and insts
    assert len(insts) + len(left_out) == stats["tasks"]
    assert set(tasks) == {i.iid for i in insts}
    assert {i.split for i in insts} <= {"train", "heldout"}


def test_prompt_is_the_numbered_function_and_the_observed_failure(family_f):
    _, insts, _, _ = family_f
    _, template = policy_of_args(demo_args(), seed=0)
    for inst in insts:
        lines = inst.prompt.splitlines()
        assert [ln.split(" ", 1)[0] for ln in lines[:-1]] == [str(k) for k in range(1, len(lines))]
        assert re.fullmatch(r".+  # got .+", lines[-1]), lines[-1]
        assert inst.file.splitlines()[inst.offset].startswith(f"def {inst.func}(")
        assert module_source(inst, inst.buggy) == inst.file  # the splice keeps the rest of the file
        ids, mask = sft_example(template, inst)
        assert len(ids) <= 256 and any(mask)  # fits one of the demo's SFT rows


def test_solver_demonstration_scores_one_and_the_bug_scores_zero(family_f):
    _, insts, tasks, _ = family_f
    for i in insts:  # the demonstration is the solver's fix (equal code; `not (` -> `(` keeps the brackets)
        assert ast.dump(ast.parse(apply_action(i.buggy, i.action))) == ast.dump(ast.parse(i.correct))
    pairs = [(i, i.action) for i in insts] + [(i, f" 1|{i.func}=>{i.func}") for i in insts] + [(insts[0], "oops")]
    with GraderPool(max_graders=1, graders_per_image=1) as pool:
        rewards, info = grade_actions(pairs, tasks, pool)
    n = len(insts)
    assert rewards[:n] == [1.0] * n
    assert rewards[n:] == [0.0] * (n + 1)
    assert info["graded"] == 2 * n  # the malformed action never reaches a grader
