"""The search-based repair agent: localise, propose, verify. It sees only what an agent sees (the task
image and its statement/test ids), never the gold patch.

1. Localise: in a sandbox of the task image, run the F2P tests and the P2P tests of the same files
   under a line tracer (sys.settrace, stdlib only) and rank the non-test lines by Ochiai
   suspiciousness (covered by failing tests, rarely by passing ones).
2. Propose: on the top-ranked lines, every edit of synth/mutations.py (the operators are their own
   inverses: flip a comparison back, swap arguments back, undo an off-by-one, delete an injected
   statement, pick another variable...).
3. Verify: a batch script in the same sandbox tries each candidate on the F2P tests (forked pytest
   per candidate); candidates that pass are graded for real (envs/grading.py) until one scores 1.
Not here: the LLM agent (synth/stages/solve.py runs envs/episode.py for that).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from envs.grading import grade_patch
from envs.pool import GraderPool
from envs.sandbox import Sandbox
from envs.task import Task
from synth import mutations

TRACE_SCRIPT = r'''
import json, os, sys
import pytest
sys.dont_write_bytecode = True
sys.path[:0] = ["/workspace"] + ["/workspace/src"] * (os.path.isdir("/workspace/src") and
    not os.path.exists("/workspace/src/__init__.py"))  # as envs/grade_runner.py: src/ layouts from src/
tests = json.load(open("/tmp/.solver-tests.json"))
ROOT = "/workspace/"
def is_src(f):
    rel = f[len(ROOT):]
    parts = rel.split("/")
    return f.startswith(ROOT) and not any(p in ("tests", "test", "testing") for p in parts[:-1]) \
        and not parts[-1].startswith("test_") and parts[-1] != "conftest.py"
class Tracer:
    def __init__(self):
        self.cov, self.outcome = {}, {}
    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(self, item):
        lines = set()
        def local(frame, event, arg):
            if event == "line":
                lines.add((frame.f_code.co_filename[len(ROOT):], frame.f_lineno))
            return local
        def glob(frame, event, arg):
            return local if is_src(frame.f_code.co_filename) else None
        sys.settrace(glob)
        try:
            yield
        finally:
            sys.settrace(None)
            self.cov[item.nodeid] = sorted(lines)
    def pytest_runtest_logreport(self, report):
        if report.when == "call" or report.outcome != "passed":
            self.outcome[report.nodeid] = report.outcome
t = Tracer()
pytest.main(["-q", "-p", "no:cacheprovider", *tests], plugins=[t])
print("@@TRACE@@" + json.dumps({"cov": t.cov, "outcome": t.outcome}))
'''

VERIFY_SCRIPT = r'''
import json, os, signal, sys, time
import pytest
sys.dont_write_bytecode = True
sys.path[:0] = ["/workspace"] + ["/workspace/src"] * (os.path.isdir("/workspace/src") and
    not os.path.exists("/workspace/src/__init__.py"))  # as envs/grade_runner.py: src/ layouts from src/
job = json.load(open("/tmp/.solver-job.json"))
passing = []
i = job["start"] - 1
for i, cand in enumerate(job["candidates"][job["start"]:], start=job["start"]):
    path = os.path.join("/workspace", cand["path"])
    original = open(path).read()
    with open(path, "w") as f:
        f.write(cand["source"])
    pid = os.fork()
    if pid == 0:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1); os.dup2(devnull, 2)
        os._exit(int(pytest.main(["-q", "-x", "-p", "no:cacheprovider", *job["tests"]])))
    deadline = time.monotonic() + job["timeout_s"]
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL); os.waitpid(pid, 0); status = -1
            break
        time.sleep(0.02)
    with open(path, "w") as f:
        f.write(original)
    if status == 0:
        passing.append(i)
        if len(passing) >= job["max_pass"]:
            break
print("@@VERIFY@@" + json.dumps({"passing": passing, "tried": i + 1 - job["start"]}))
'''


@dataclass
class SolveAttempt:
    reward: float
    patch: str = ""
    candidates: int = 0
    tried: int = 0
    graded: int = 0
    suspicious: list[tuple[str, int, float]] = field(default_factory=list)
    note: str = ""


def _payload(output: str, marker: str) -> dict:
    for line in output.splitlines():
        if line.startswith(marker):
            return json.loads(line[len(marker):])
    raise RuntimeError(f"solver script gave no result: {output[-800:]}")


def ochiai(cov: dict[str, list], outcome: dict[str, str], failing: list[str]) -> list[tuple[str, int, float]]:
    """(path, line, score) sorted by suspiciousness; failing = ids that should pass but do not."""
    bad = [t for t in failing if outcome.get(t) != "passed"]
    good = [t for t, o in outcome.items() if o == "passed" and t not in failing]
    ef: dict[tuple[str, int], int] = {}
    ep: dict[tuple[str, int], int] = {}
    for t in bad:
        for path, line in cov.get(t, []):
            ef[(path, line)] = ef.get((path, line), 0) + 1
    for t in good:
        for path, line in cov.get(t, []):
            ep[(path, line)] = ep.get((path, line), 0) + 1
    scores = [(p, ln, n / math.sqrt(len(bad) * (n + ep.get((p, ln), 0)))) for (p, ln), n in ef.items()]
    return sorted(scores, key=lambda s: (-s[2], s[0], s[1]))


def propose(sources: dict[str, str], lines: list[tuple[str, int]]) -> list[tuple[mutations.Mutation, str]]:
    """Every edit on the ranked (path, line)s, most suspicious line first, each with its edited file text;
    a file is parsed and indexed once, and only the nodes on the ranked lines are visited."""
    by_line: dict[tuple[str, int], list[mutations.Mutation]] = {}
    for path, source in sources.items():
        wanted = {ln for p, ln in lines if p == path}
        try:
            found = mutations.SourceIndex(path, source).find(wanted)
        except (SyntaxError, ValueError):  # a file the tracer saw but ast cannot parse: nothing to edit
            continue
        for m in found:
            by_line.setdefault((path, m.lineno), []).append(m)
    return [(m, mutations.apply(sources[m.path], m)) for key in lines for m in by_line.get(key, [])]


def search_repair(task: Task, *, pool: GraderPool | None = None, budget: int = 150, top_lines: int = 10,
                  max_grades: int = 3, seed: int = 0, note: Callable[[str], None] = lambda _: None) -> SolveAttempt:
    """One attempt of the search solver on `task`; `seed` rotates ties among equally suspicious lines;
    `note` hears what it is doing (the factory's progress postfix)."""
    same_files = {t.split("::")[0] for t in task.f2p}
    context = [t for t in task.p2p if t.split("::")[0] in same_files][:40]
    with Sandbox(task.image, labels={"flashpost.purpose": "search-solver"}) as sb:
        sb.write_file("/tmp/.solver-tests.json", json.dumps(task.f2p + context))
        sb.write_file("/tmp/.solver-trace.py", TRACE_SCRIPT)
        note(f"tracing {len(task.f2p) + len(context)} tests")
        r = sb.exec("python3 -B /tmp/.solver-trace.py", timeout=180, max_output_bytes=4_000_000)
        trace = _payload(r.output, "@@TRACE@@")
        ranked = ochiai(trace["cov"], trace["outcome"], task.f2p)
        if seed:
            head = ranked[:top_lines * 2]
            ranked = head[seed % max(len(head), 1):] + head[:seed % max(len(head), 1)] + ranked[top_lines * 2:]
        lines = ranked[:top_lines]
        note(f"proposing edits on {len(lines)} lines")
        sources = {path: sb.read_file(path).decode() for path in dict.fromkeys(p for p, _, _ in lines)}
        candidates = propose(sources, [(p, ln) for p, ln, _ in lines])[:budget]
        attempt = SolveAttempt(0.0, candidates=len(candidates), suspicious=lines)
        if not candidates:
            attempt.note = "no candidate edits on the suspicious lines"
            return attempt
        job = {"candidates": [{"path": m.path, "source": src} for m, src in candidates], "tests": task.f2p,
               "timeout_s": 20, "max_pass": 1, "start": 0}
        sb.write_file("/tmp/.solver-verify.py", VERIFY_SCRIPT)
        while attempt.graded < max_grades and job["start"] < len(candidates):
            sb.write_file("/tmp/.solver-job.json", json.dumps(job))
            note(f"verifying edits {job['start'] + 1}-{len(candidates)} on the F2P tests")
            r = sb.exec("python3 -B /tmp/.solver-verify.py", timeout=600, max_output_bytes=200_000)
            verdict = _payload(r.output, "@@VERIFY@@")
            attempt.tried += verdict["tried"]
            if not verdict["passing"]:
                break
            i = verdict["passing"][0]
            m, src = candidates[i]
            patch = mutations.unified_diff(m.path, sources[m.path], src)
            attempt.graded += 1
            note(f"grading edit {i + 1} ({m.kind})")
            if grade_patch(task, patch, pool=pool).reward == 1.0:
                attempt.reward, attempt.patch, attempt.note = 1.0, patch, m.description
                return attempt
            job["start"] = i + 1
    attempt.note = f"tried {attempt.tried} of {len(candidates)} edits; {attempt.graded} passed F2P, none graded 1"
    return attempt
