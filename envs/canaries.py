"""Canary tests planted beside a task's F2P tests at grading time, and the check of their outcomes.

Code under test runs in the same process as the tests, so it can forge what gets reported. The
canaries make a forgery show: in every F2P test module, under random names,
  - "fail": asserts two different nonce-derived integers equal; it must fail (and under pytest
    its failure message must quote the first integer: the assert really ran);
  - "pass": computes a nonce-derived integer and hands it back (pytest: record_property; the
    batch runner: the return value); it must pass with exactly that value;
  - "same": a copy of a module-level F2P test under a random name (decorators kept); it must end
    exactly as the original does. Forging only the F2P tests by name leaves the copy honest.
A blanket forgery, an assert stripper, a swapped runner, a fake or substituted test module, or
forged records written from outside all break at least one. Stdlib only: envs/pool.py and
envs/batch_grading.py send this file's source into grader containers ahead of their runners.
Not here: the static screen (envs/screen.py) or running the tests.
"""

import ast

N_FAIL, N_PASS = 2, 2  # per F2P test module


def _clone_test(source, name, new_name):
    """Source of module-level `def name` (with its decorators) renamed to new_name, or None."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return None
    lines = source.splitlines()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            start = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
            text = "\n".join(lines[start:node.end_lineno])
            head = f"def {name}("
            if text.count(head) != 1:
                return None
            return text.replace(head, f"def {new_name}(")
    return None


def plant_canaries(sources, f2p, rng, *, record):
    """({test module: source to append}, {canary node id: (kind, detail)}) for this run.

    `sources`: test module path -> its source as the tests will run it; `f2p`: F2P node ids;
    `rng`: a random.SystemRandom; `record`: "pass" canaries report through pytest's
    record_property (True) or their return value (False). detail: the literal a "fail" canary's
    message quotes, the value a "pass" canary reports, the node id a "same" canary mirrors.
    """
    by_file = {}
    for tid in f2p:
        path, _, rest = tid.partition("::")
        if path in sources:
            by_file.setdefault(path, []).append(rest)
    append, expect = {}, {}
    for path, rests in sorted(by_file.items()):
        names = [r.split("::")[-1].split("[")[0] for r in rests]
        names = [n if n.startswith("test") else "test_" + n for n in names]
        body = []

        def fresh(base):
            return f"{base}_{rng.getrandbits(32):08x}"

        kinds = ["fail"] * N_FAIL + ["pass"] * N_PASS
        rng.shuffle(kinds)
        for kind in kinds:
            name, a, b = fresh(rng.choice(names)), rng.getrandbits(60), rng.getrandbits(60) | 1
            if kind == "fail":
                body.append(f"def {name}():\n    assert {a} == {a ^ b}\n")
                expect[f"{path}::{name}"] = ("fail", str(a))
            elif record:
                body.append(f"def {name}(record_property):\n    value = {a} ^ {b}\n"
                            f"    record_property('flashpost', value)\n    assert value == {a ^ b}\n")
                expect[f"{path}::{name}"] = ("pass", str(a ^ b))
            else:
                body.append(f"def {name}():\n    value = {a} ^ {b}\n    assert value == {a ^ b}\n    return value\n")
                expect[f"{path}::{name}"] = ("pass", str(a ^ b))
        copies = {}
        for rest in rests:
            if "::" in rest:  # a method: copies of module-level tests only
                continue
            name, _, params = rest.partition("[")
            if name not in copies:
                copies[name] = fresh(name)
                text = _clone_test(sources[path], name, copies[name])
                if text is None:
                    copies[name] = None
                else:
                    body.append(text + "\n")
            if copies[name] is not None:
                expect[f"{path}::{copies[name]}" + (f"[{params}" if params else "")] = ("same", f"{path}::{rest}")
        rng.shuffle(body)
        append[path] = "\n\n" + "\n\n".join(body)
    return append, expect


def check_canaries(expect, outcome, evidence, *, unloaded=(), quote=True):
    """What the canaries say was forged (empty if they hold).

    `outcome`: node id -> passed|failed|error|skipped|...; `evidence`: node id -> the failure
    message ("fail") or the reported value ("pass"); `unloaded`: test modules that did not load
    (broken code under test: none of their tests ran, the reward is 0 anyway); `quote`: whether
    a failing canary's message must quote its literal (pytest's assertion rewriting does).
    """
    problems = []
    for nid, (kind, detail) in sorted(expect.items()):
        if nid.split("::")[0] in unloaded:
            continue
        got = outcome.get(nid, "missing")
        if kind == "fail" and (got != "failed" or (quote and detail not in evidence.get(nid, ""))):
            problems.append(f"canary {nid} must fail quoting its assertion, got {got}")
        elif kind == "pass" and (got != "passed" or evidence.get(nid) != detail):
            problems.append(f"canary {nid} must pass with its nonce value, got {got}")
        elif kind == "same" and got != outcome.get(detail, "missing"):
            problems.append(f"canary {nid} (a copy of {detail}) {got}, the original {outcome.get(detail, 'missing')}")
    return problems
