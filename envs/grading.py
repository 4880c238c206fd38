"""Grading: take the agent's non-test diff, run the task's tests in a pristine grader container,
and reward 1 only if every F2P test explicitly passes, every P2P test still passes, the run's
canaries came out as planted, and the exit code, the JUnit report and the console agree.

Never grades in the agent's container. The patch is parsed and screened on the host
(envs/patches.py: test files and new files are dropped; conftest.py, pytest config, site files,
*.pth, odd paths, symlinks or a malformed diff refuse the whole patch), then the resident runner
(envs/grade_runner.py, root) of a grader container (fresh, or warm from `GraderPool`) applies it
as the `agent` uid, checks what git changed against the screened paths, screens the changed code
(envs/screen.py), plants canary tests beside the F2P tests and runs the tests; the per-test
report is built in the runner's own process from records sent over an inherited pipe and comes
back over the runner's own stdout. Every zero says why; a refusal by the screen, a tamper the
canaries or the reporter saw, or an output flood is also written to the audit log. Known limit:
the tests run in one process with the code under test, which could mimic the canaries if it
found their source by means the static screen does not see. An episode's grading runs its tests
under the task's own budget, measured when its source verified it, capped by the caller's timeout
(`grading_timeout`).
Not here: the agent loop or the canned hacks (envs/hacks.py).
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field

from envs import engine
from envs.patches import PatchScreen, is_protected, screen_patch  # noqa: F401 - is_protected: synth/ imports it here
from envs.pool import GraderLost, GraderPool, GraderSandbox
from envs.sandbox import AGENT_USER, Sandbox
from envs.task import Task

DEFAULT_TEST_TIMEOUT_S = 120.0
# A task's grading budget, Task.verification[GRADING_BUDGET_KEY] (seconds): set by the source that verified
# the task from its slowest gold grading (`grading_budget`), so a patch that makes a test loop forever costs
# a few times what the task's tests take instead of the whole cap. MARGIN: episodes are graded beside the
# learner and every live episode, where a grading runs several times slower than in the source's quiet gold
# runs, and a correct patch timed out would be taught as a failure. FLOOR: what a grading pays whatever its
# tests (pytest's start-up, applying the patch, a busy engine) does not scale with a sub-second gold run.
GRADING_BUDGET_KEY = "grading_budget_s"
GRADING_BUDGET_MARGIN = 10.0
GRADING_BUDGET_FLOOR_S = 10.0
# Where flagged gradings are appended as JSON lines (besides the "flashpost.audit" logger).
AUDIT_LOG_ENV = "FLASHPOST_AUDIT_LOG"
_audit = logging.getLogger("flashpost.audit")


@dataclass(frozen=True)
class GradeResult:
    reward: float  # 1.0 or 0.0
    tests: dict[str, str]  # node id -> passed|failed|error|skipped|xfailed|missing
    agreement: bool  # exit code, JUnit report and console summary tell the same story
    reason: str
    duration_s: float
    dropped_paths: list[str] = field(default_factory=list)  # agent changes not applied
    flag: str = ""  # what the audit log was told: "patch", "screen", "tamper", "flood" or ""


def audit(task: Task, flag: str, reason: str) -> None:
    """Record a grading that looked like an attack on the verifier (the log and, if set, a file)."""
    rec = {"time": round(time.time(), 3), "task": task.task_id, "flag": flag, "reason": reason[:2000]}
    _audit.warning("grading flagged %s: %s", flag, json.dumps(rec))
    path = os.environ.get(AUDIT_LOG_ENV)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(rec) + "\n")


def extract_patch(sb: Sandbox, task: Task, timeout: float = 60.0) -> str:
    """The agent's changes against base_revision, new files included, as a binary git diff.

    Uses a scratch index so the agent's own index is untouched; fails if the repo is gone.
    """
    script = (
        "set -e; export GIT_INDEX_FILE=/tmp/.flashpost-index; cp .git/index $GIT_INDEX_FILE; "
        "git -c core.fsmonitor=false -c core.hooksPath=/dev/null add -A .; "
        "git -c core.fsmonitor=false diff --cached --binary --no-color --no-ext-diff --no-textconv "
        f"--no-renames {task.base_revision} > /tmp/.flashpost.diff; rm -f $GIT_INDEX_FILE"
    )
    r = sb.exec(script, timeout=timeout, user=AGENT_USER)
    if r.exit_code != 0:
        raise RuntimeError(f"could not diff the agent's workspace: {r.output[-1000:]}")
    return sb.read_file("/tmp/.flashpost.diff").decode("utf-8", "surrogateescape")


def task_test_paths(task: Task) -> list[str]:
    return sorted({tid.split("::")[0] for tid in task.test_ids})


def grading_budget(gold_s: list[float]) -> float:
    """The budget of a task whose gold gradings took `gold_s` seconds each (the grader's own time):
    GRADING_BUDGET_MARGIN x the slowest, at least GRADING_BUDGET_FLOOR_S."""
    return round(max(GRADING_BUDGET_FLOOR_S, GRADING_BUDGET_MARGIN * max(gold_s)), 1)


def budget_fields(gold_s: list[float]) -> dict[str, float]:
    """What a source that timed a task's gold gradings (`gold_s`, the grader's own seconds) writes into its
    verification: the slowest ("gold_grading_s") and the budget it gives (GRADING_BUDGET_KEY)."""
    return {"gold_grading_s": round(max(gold_s), 3), GRADING_BUDGET_KEY: grading_budget(gold_s)}


def grading_timeout(task: Task, cap_s: float) -> float:
    """The test timeout of a grading of `task`: its measured budget (verification["grading_budget_s"],
    written by the source that verified it: the factory's inspect stage, the demo's families) when it is
    below `cap_s`, else `cap_s` (the user's upper bound, env.grading_timeout_s); tasks that record no
    budget (fixtures, toy and hand-made sets) get `cap_s`."""
    budget = task.verification.get(GRADING_BUDGET_KEY)
    return cap_s if budget is None else min(cap_s, float(budget))


def run_job(grader: GraderSandbox, task: Task, screen: PatchScreen, timeout_s: float) -> dict:
    """One grading by the grader's resident runner: {"result", "junit", "console"}."""
    job = {"patch": screen.patch, "allowed": screen.paths, "test_patch": task.test_patch,
           "test_files": task.test_files, "base_revision": task.base_revision, "f2p": task.f2p,
           "test_paths": task_test_paths(task), "timeout_s": timeout_s}
    return grader.request({"cmd": "grade", "job": job}, timeout=timeout_s + 30)


def parse_junit(xml: bytes) -> dict[str, str]:
    """node id -> status from a pytest-style JUnit XML (classname + name + file attributes)."""
    tests = {}
    for case in ET.fromstring(xml).iter("testcase"):
        file, classname, name = case.get("file", ""), case.get("classname", ""), case.get("name", "")
        module = file[:-3].replace("/", ".") if file.endswith(".py") else file
        classes = classname[len(module) + 1:].split(".") if classname.startswith(module + ".") else []
        nodeid = "::".join([file, *classes, name])
        if case.find("failure") is not None:
            tests[nodeid] = "failed"
        elif case.find("error") is not None:
            tests[nodeid] = "error"
        elif (skip := case.find("skipped")) is not None:
            tests[nodeid] = "xfailed" if skip.get("message") == "xfailed" else "skipped"
        else:
            tests[nodeid] = "passed"
    return tests


_SUMMARY = re.compile(r"^=*\s*((?:\d+ [a-z]+(?:, )?)+|no tests ran)(?: in [\d.]+s.*)?\s*=*$")


def parse_console(console: str) -> dict[str, int] | None:
    """Counts from pytest's final summary line ("1 failed, 20 passed in 0.1s"); None if absent."""
    for line in reversed(console.strip().splitlines()):
        m = _SUMMARY.match(line.strip())
        if m and " in " in line:
            counts: dict[str, int] = {}
            for n, word in re.findall(r"(\d+) ([a-z]+)", m.group(1)):
                word = {"errors": "error", "warnings": "warning"}.get(word, word)
                counts[word] = counts.get(word, 0) + int(n)
            return counts
    return None


def decide(task: Task, out: dict, dropped: list[str], t0: float) -> GradeResult:
    def result(reason: str, tests: dict | None = None, agreement: bool = False, reward: float = 0.0,
               flag: str = ""):
        if flag:
            audit(task, flag, reason)
        return GradeResult(reward, tests or {}, agreement, reason, time.monotonic() - t0, dropped, flag)

    res = out.get("result")
    if res is None:
        return result(f"runner produced no result: {out}"[:1000])
    if res["flood"]:
        return result(f"output flood: {res['flood']}", flag="flood")
    if res["refused"]:
        flag = "screen" if "static screen" in res["refused"] else "patch"
        return result(f"patch refused in the grader: {res['refused']}"[:2000], flag=flag)
    if not res["prepared"]:
        return result("the patch or the task's tests could not be applied: " + " | ".join(res["log"])[-1000:])
    if out["junit"] is None:
        return result("no JUnit report")
    junit = parse_junit(out["junit"].encode())
    canaries = set(res["canaries"])
    tests = {tid: junit.get(tid, "missing") for tid in task.test_ids}
    tests.update({k: v for k, v in junit.items() if k not in tests and k not in canaries})
    if res["tamper"]:  # the statuses stay for the factory's flake counts; the reward is 0
        return result("tamper detected (the test run's report cannot be trusted): "
                      + "; ".join(res["tamper"])[:1500], tests, flag="tamper")
    finish = [r["finish"] for r in res["records"] if "finish" in r]
    collect_errors = [r for r in res["records"] if "collect_error" in r]
    console = parse_console(out["console"])
    problems = list(res["conflicts"])
    code = res["exit_code"]
    if code is None:
        problems.append("pytest timed out")
    if finish != [code]:
        problems.append(f"session finish records {finish} != exit code {code}")
    n = {s: sum(v == s for v in junit.values()) for s in ("passed", "failed", "error", "skipped", "xfailed")}
    if console is None:
        problems.append("no summary line in the console output")
    else:
        want = {"passed": console.get("passed", 0) + console.get("xpassed", 0),
                "failed": console.get("failed", 0), "skipped": console.get("skipped", 0),
                "xfailed": console.get("xfailed", 0), "error": console.get("error", 0) - len(collect_errors)}
        if want != n:
            problems.append(f"console summary {console} disagrees with JUnit counts {n}")
    bad = n["failed"] + n["error"] + len(collect_errors)
    if (code == 0) != (bad == 0 and len(junit) > 0):
        problems.append(f"exit code {code} disagrees with {bad} failing/erroring tests of {len(junit)}")
    if problems:
        return result("report disagreement: " + "; ".join(problems)[:1500], tests)
    not_passed = [t for t in task.f2p if tests[t] != "passed"]
    broken = [t for t in task.p2p if tests[t] != "passed"]
    if not_passed or broken:
        reasons = [f"F2P not passed: {not_passed}"] * bool(not_passed)
        reasons += [f"P2P broken: {broken}"] * bool(broken)
        return result("; ".join(reasons), tests, agreement=True)
    return result("all F2P pass and all P2P still pass", tests, agreement=True, reward=1.0)


def run_in_grader(task: Task, screen: PatchScreen, *, pool: GraderPool | None, timeout_s: float) -> dict:
    """Run the task's tests on a screened patch in a fresh grader, or a warm one from pool.
    Raises GraderLost when the runner hung or died (the grader is then discarded)."""
    if pool is not None:
        with pool.grader(task.image) as grader:
            return run_job(grader, task, screen, timeout_s)
    with GraderSandbox(task.image) as grader:
        return run_job(grader, task, screen, timeout_s)


def grade_patch_output(task: Task, patch: str, *, pool: GraderPool | None = None,
                       timeout_s: float = DEFAULT_TEST_TIMEOUT_S,
                       allow_new_files: bool = False) -> tuple[GradeResult, dict | None]:
    """grade_patch, plus the runner's raw answer (None if it never ran): the factory reads its
    failure messages."""
    t0 = time.monotonic()
    screen = screen_patch(patch, task.test_files, allow_new_files=allow_new_files)
    dropped = [*screen.dropped]
    if screen.refused:
        audit(task, "patch", screen.refused)
        return GradeResult(0.0, {}, False, screen.refused, time.monotonic() - t0, dropped, "patch"), None
    try:
        out = run_in_grader(task, screen, pool=pool, timeout_s=timeout_s)
    except GraderLost as e:  # the runner hung or died: the grader is discarded, reward 0
        return GradeResult(0.0, {}, False, f"grading failed: {e}", time.monotonic() - t0, dropped), None
    res = decide(task, out, dropped, t0)
    if screen.notes and res.reward == 0.0:
        why = f"{res.reason} (not applied: {'; '.join(screen.notes)})"
        res = GradeResult(res.reward, res.tests, res.agreement, why, res.duration_s, dropped, res.flag)
    return res, out


def grade_patch(task: Task, patch: str, *, pool: GraderPool | None = None,
                timeout_s: float = DEFAULT_TEST_TIMEOUT_S, allow_new_files: bool = False) -> GradeResult:
    """Grade a git diff (against task.base_revision) in a fresh grader, or a warm one from pool.
    `allow_new_files` lets the patch add files (never ones pytest or Python load on their own)."""
    return grade_patch_output(task, patch, pool=pool, timeout_s=timeout_s, allow_new_files=allow_new_files)[0]


def grade_in_budget(task: Task, patch: str, *, pool: GraderPool | None = None,
                    cap_s: float = DEFAULT_TEST_TIMEOUT_S) -> GradeResult:
    """grade_patch under `grading_timeout(task, cap_s)`: an episode's grade function
    (functools.partial(grade_in_budget, pool=..., cap_s=env.grading_timeout_s))."""
    return grade_patch(task, patch, pool=pool, timeout_s=grading_timeout(task, cap_s))


def grade_sandbox(sb: Sandbox, task: Task, *, pool: GraderPool | None = None,
                  timeout_s: float = DEFAULT_TEST_TIMEOUT_S) -> GradeResult:
    """Grade the agent's final workspace: diff it there, test it elsewhere."""
    t0 = time.monotonic()
    try:
        patch = extract_patch(sb, task)
    except (RuntimeError, engine.PathNotFound) as e:
        return GradeResult(0.0, {}, False, f"no patch: {e}", time.monotonic() - t0)
    return grade_patch(task, patch, pool=pool, timeout_s=timeout_s)
