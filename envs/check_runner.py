"""The agent's quick test runner: runs the plain `test_*` functions of one test file and prints the first
failure with the value it got, then a one-line summary, in a few hundred bytes.

Shipped into task images whose tests are plain functions of pure code (synth/families.py writes it as
tests/check.py and makes `python3 tests/check.py <test file>` the task's test command), so `run_tests`
in the agent's sandbox costs one Python start-up (no pytest import: that is most of a second here) and
its observation is what a small policy can read:

    FAILED test_2: assert get_value(3, 1) == 4 (got 5)
    1 failed, 5 passed

It is feedback for the agent only: rewards come from the pristine grader (envs/grading.py,
envs/batch_grading.py), which never runs this file. Stdlib only (it runs inside the sandbox image);
not here: pytest-style fixtures, classes or parametrisation (a task with those uses pytest itself).
"""

import ast
import importlib.util
import os
import signal
import sys

TEST_TIMEOUT_S = 1  # per test: an edit can make a loop endless (then the rest are not run)
MAX_LINE = 240  # bytes of one reported line


class _Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise _Timeout()


def _cap(text):
    text = " ".join(text.split())
    return text if len(text) <= MAX_LINE else text[: MAX_LINE - 3] + "..."


def _first_assert(tree, name):
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            for stmt in ast.walk(node):
                if isinstance(stmt, ast.Assert):
                    return stmt
    return None


def _got(stmt, namespace):
    """What the left side of `assert <left> == <right>` evaluates to, for the report."""
    test = stmt.test if stmt is not None else None
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1):
        return ""
    try:
        signal.alarm(TEST_TIMEOUT_S)
        value = eval(compile(ast.Expression(test.left), "<check>", "eval"), namespace)
        return f"got {value!r}"
    except _Timeout:
        return "timed out"
    except Exception as e:  # noqa: BLE001 - any exception is what the agent should see
        return f"raised {type(e).__name__}: {e}"
    finally:
        signal.alarm(0)


def main(path):
    sys.path.insert(0, os.getcwd())
    signal.signal(signal.SIGALRM, _alarm)
    source = open(path).read()
    spec = importlib.util.spec_from_file_location("_checked_tests", path)
    module = importlib.util.module_from_spec(spec)
    try:
        signal.alarm(TEST_TIMEOUT_S)
        spec.loader.exec_module(module)
    except BaseException as e:  # noqa: BLE001 - a broken module under test is a report, not a crash
        where = f" (line {e.lineno})" if isinstance(e, SyntaxError) else ""
        print(_cap(f"ERROR importing {path}: {type(e).__name__}: {e}{where}"))
        return 2
    finally:
        signal.alarm(0)
    tree = ast.parse(source)
    names = [n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test")]
    failed, first, run = 0, None, 0
    for name in names:
        run += 1
        try:
            signal.alarm(TEST_TIMEOUT_S)
            getattr(module, name)()
            ok, why = True, ""
        except AssertionError:
            ok, why = False, ""
        except _Timeout:
            ok, why = False, "timed out"
        except Exception as e:  # noqa: BLE001
            ok, why = False, f"raised {type(e).__name__}: {e}"
        finally:
            signal.alarm(0)
        if ok:
            continue
        failed += 1
        if first is None:
            stmt = _first_assert(tree, name)
            shown = ast.unparse(stmt) if stmt is not None else name
            first = _cap(f"FAILED {name}: {shown} ({why or _got(stmt, vars(module))})")
        if why == "timed out":
            break
    if first:
        print(first)
    passed, skipped = run - failed, len(names) - run
    summary = f"{failed} failed, {passed} passed" if failed else f"{passed} passed"
    print(summary + (f", {skipped} not run" if skipped else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: python3 check.py <test file>")
        sys.exit(2)
    sys.exit(main(sys.argv[1]))
