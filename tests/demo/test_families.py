"""synth/families: templates run, every drawn instance has a failing test and a short gold edit that
fixes it, the splits do not leak, and the action survives the chat template both ways."""

from __future__ import annotations

import ast
import itertools
import random
import statistics

import pytest

from synth.families import (
    TEMPLATES,
    action_ruled_out,
    apply_action,
    demo_splits,
    families,
    gold_action,
    make_instance,
    parse_action,
    render_tests,
    run_calls,
    template_bugs,
)  # fmt: skip


@pytest.fixture(scope="module")
def sets():
    return demo_splits(300, 120, 60, seed=3)


def test_templates_run_and_most_have_bugs():
    with_bugs = 0
    for t in range(len(TEMPLATES)):
        expected, bugs = template_bugs(t)  # raises if a template fails on its own calls
        assert len(expected) >= 5
        with_bugs += bool(bugs)
    assert with_bugs >= len(TEMPLATES) - 2


def test_families_split_by_template():
    f = families()
    assert not set(f["A"]) & set(f["B"])
    assert sorted(f["A"] + f["B"]) == list(range(len(TEMPLATES)))
    assert len(f["B"]) == 12 and len(f["A"]) == 36


def test_instances_fail_before_and_pass_after_the_gold_edit(sets):
    for inst in sets["A_train"][:80] + sets["B_heldout"]:
        calls = TEMPLATES[inst.template][1]
        expected, _ = template_bugs(inst.template)
        before = run_calls(inst.buggy, inst.func, calls)
        fixed = apply_action(inst.buggy, inst.action)
        after = run_calls(fixed, inst.func, calls)
        assert any(k != "ok" or repr(v) != e for (k, v), e in zip(before, expected)), inst.iid
        assert all(k == "ok" and repr(v) == e for (k, v), e in zip(after, expected)), inst.iid
        assert ast.dump(ast.parse(fixed)) == ast.dump(ast.parse(inst.correct))
        # the prompt shows the first failing assert with what it really got
        first = next(i for i, ((k, v), e) in enumerate(zip(before, expected)) if k != "ok" or repr(v) != e)
        assert inst.first_fail.startswith(inst.tests[first] + "  # got ")
        assert inst.prompt.splitlines()[0].startswith("1 def " + inst.func)


def test_actions_are_short(sets):
    lengths = [len(i.action) for i in sets["A_train"]]
    assert statistics.mean(lengths) < 12 and max(lengths) <= 24
    prompts = [len(i.prompt) for i in sets["A_train"]]
    assert 100 < statistics.mean(prompts) < 260


def test_heldout_never_repeats_train_and_families_stay_apart(sets):
    for fam in ("A", "B"):
        train = {i.buggy for i in sets[f"{fam}_train"]}
        assert not train & {i.buggy for i in sets[f"{fam}_heldout"]}
        assert {i.template for i in sets[f"{fam}_train"]} <= set(families()[fam])


def test_gold_action_and_parsing():
    buggy = "def f(a, b):\n    return a <= b and True\n"
    correct = "def f(a, b):\n    return a < b and True\n"
    action = gold_action(buggy, correct)
    assert action == " 2|<=><" or apply_action(buggy, action) == correct
    assert parse_action(action)[0] == 2
    assert apply_action(buggy, " 9|x=>y") is None  # no such line
    assert apply_action(buggy, " 2|zzz=>y") is None  # old not on the line
    assert apply_action(buggy, "2 <= b") is None  # no separator
    assert gold_action(buggy, buggy) is None
    # whole tokens with their space, as the line tokenizes: " True=> False", never a cut word ("Tru=>Fals")
    assert gold_action("def f():\n    return True\n", "def f():\n    return False\n") == " 2| True=> False"
    # an operator whole (" !=", not "!" -> "="); a missing `not` anchored on the token after it
    assert gold_action("def f(a, b):\n    return a != b\n", "def f(a, b):\n    return a == b\n") == " 2| !==> =="
    assert gold_action("def f(a):\n    if a:\n        return 1\n",
                       "def f(a):\n    if not a:\n        return 1\n") == " 2| a=> not a"  # fmt: skip


def test_renaming_is_random_and_test_file_imports_the_renamed_function():
    t = families()["A"][0]
    a = make_instance(t, random.Random(1), "A", "train", "x1")
    b = make_instance(t, random.Random(2), "A", "train", "x2")
    assert a is not None and b is not None and a.correct != b.correct
    src = render_tests(a)
    assert f"from fam.x1 import {a.func}" in src and src.count("def test_") == len(a.tests)


def test_a_ruled_out_prefix_never_becomes_an_action():
    # every string over an alphabet of the grammar's characters: once a prefix is ruled out, no
    # extension parses, and no prefix of a valid action is ruled out
    alphabet = [" ", "\n", "1", "2", "|", "a", "=", ">"]
    for n in range(6):
        for t in itertools.product(alphabet, repeat=n):
            s = "".join(t)
            extensions = ("".join(u) for m in range(4) for u in itertools.product(alphabet, repeat=m))
            if action_ruled_out(s):
                assert all(parse_action(s + e) is None for e in extensions), s
            if parse_action(s) is not None:
                assert not any(action_ruled_out(s[:i]) for i in range(len(s) + 1)), s
    assert action_ruled_out("x") and action_ruled_out("|") and action_ruled_out(" \n")
    assert not action_ruled_out(" 12") and not action_ruled_out("\n 3|x")
    assert not action_ruled_out(" 1\ufffd")  # an unfinished byte token may still complete
