"""Run a repository's test suite on an image with a patch applied, through the real grader.

The factory decides F2P/P2P, flakiness and gates from the same pristine grader containers
(envs/pool.py, envs/grade_runner.py) and the same report cross-checks (envs/grading.py) that
grade agents, so a task is verified by exactly the machinery that will score it. Unlike
`grade_patch` this also returns each failing test's message (the statement writer quotes it).
Not here: choosing what to run (the stages do).
"""

from __future__ import annotations

import re
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field

from envs.grading import grade_patch_output
from envs.pool import GraderPool
from envs.task import Task

TEST_COMMAND = "python3 -m pytest -q"


@dataclass
class SuiteRun:
    statuses: dict[str, str]  # test id -> passed|failed|error|skipped|xfailed|missing
    messages: dict[str, str] = field(default_factory=dict)  # failing test id -> failure text
    agreement: bool = False  # exit code, report and console agree
    reward: float = 0.0  # 1.0 iff every f2p passes and every p2p still passes
    reason: str = ""
    seconds: float = 0.0  # the whole call, waiting for a grader included
    grading_s: float = 0.0  # the grader's own time for the run: what a grading timeout bounds
    console: str = ""  # the end of pytest's console output (why a suite did not run)

    def why_not_run(self) -> str:
        """The grader's reason, and the first error pytest printed (an ImportError of the library...)."""
        errors = [re.sub(r"^E\s+", "", ln.strip()) for ln in self.console.splitlines()
                  if re.search(r"\b\w*(Error|Exception)\b:", ln)]
        return self.reason + (f"; pytest says: {errors[0][:400]}" if errors else "")

    def passed(self) -> set[str]:
        return {t for t, s in self.statuses.items() if s == "passed"}


def probe_task(image: str, test_files: list[str], *, f2p: list[str] | None = None, p2p: list[str] | None = None,
               base_revision: str = "HEAD") -> Task:
    """A Task shell for running tests on an image that is not (yet) a task of its own."""
    return Task(task_id="probe", repo="probe", base_revision=base_revision, image=image, image_digest="",
                problem_statement="-", test_command=TEST_COMMAND, test_parser="junit", f2p=list(f2p or []),
                p2p=list(p2p or []), gold_patch="", test_files=list(test_files))


def junit_messages(xml: str | None) -> dict[str, str]:
    out: dict[str, str] = {}
    if not xml:
        return out
    for case in ET.fromstring(xml).iter("testcase"):
        bad = case.find("failure")
        bad = bad if bad is not None else case.find("error")
        if bad is not None:
            parts = case.get("classname", "").split(".")
            file = case.get("file", "")
            depth = len(file[:-3].split("/")) if file.endswith(".py") else 1
            out["::".join([file, *parts[depth:], case.get("name", "")])] = bad.text or ""
    return out


def run_suite(task: Task, patch: str, *, pool: GraderPool | None = None, timeout_s: float = 120.0) -> SuiteRun:
    """Grade `patch` against `task` (fresh grader, or a warm one from pool) and keep the messages."""
    t0 = time.monotonic()
    res, out = grade_patch_output(task, patch, pool=pool, timeout_s=timeout_s)
    seconds = time.monotonic() - t0
    out = out or {}
    return SuiteRun(dict(res.tests), junit_messages(out.get("junit")), res.agreement, res.reward, res.reason,
                    seconds, out.get("runner_s", seconds), (out.get("console") or "")[-8000:])
