"""Batch grading: many candidate file sets (a GRPO group, or candidates for many tasks of one image)
graded in ONE exec of a warm pristine grader container from envs.pool.GraderPool.

The host filters each candidate's files like envs/grading.py filters a patch (test files, pytest
config, conftest, site files... are dropped), then runs `BATCH_RUNNER` once as root in the
grader. The runner reads every pristine file it needs from /workspace into memory before any
candidate runs, then for each candidate in turn: writes a fresh copy (root-owned, read-only to
the agent) under /tmp, forks a child that drops to the `agent` uid (no groups, rlimits, its own
session, no bytecode) and runs the candidate's test functions, waits at most `timeout_s`, and
then SIGKILLs every process of the agent uid, so nothing one candidate leaves behind can touch
the next. Reward 1 iff every test id of the task (F2P and P2P) passed, the child exited 0 and its
report carried the per-candidate nonce. After the batch the pool resets the grader as usual.

A task names the source files its tests import in verification["sources"] (synth/families does).
Tests are plain `test_*` functions called in file order (no pytest: its start-up costs more than
a whole candidate here), so this path is for tasks whose tests are plain functions (synth/families
tasks); `envs.grading.grade_patch` stays the general path. Known limit: code under test shares
the child process with the harness (as it does with pytest's plugin in the resident runner), so a
candidate that executes arbitrary code could forge its report; the demo's short edits are also
screened by `screen_edit`. Not here: the resident runner or pool policy (envs/pool.py).
"""

from __future__ import annotations

import base64
import json
import re
import time
import uuid
from dataclasses import dataclass, field
from pathlib import PurePosixPath

from envs.grading import is_protected
from envs.pool import GraderLost, GraderPool
from envs.task import Task

MAX_JOB_BYTES = 96_000  # base64 job per exec argument (Linux MAX_ARG_STRLEN is 128 KiB)

# Names a one-line repair of a pure function never needs; an edit bringing one in is not graded.
FORBIDDEN = re.compile(
    r"__|\b(import|exec|eval|open|exit|quit|compile|globals|locals|vars|getattr|setattr|"
    r"delattr|breakpoint|input|os|sys|signal|subprocess|builtins)\b"
)


@dataclass(frozen=True)
class BatchGrade:
    reward: float  # 1.0 or 0.0
    tests: dict[str, str] = field(default_factory=dict)  # node id -> passed|failed|error|missing
    reason: str = ""
    dropped_paths: list[str] = field(default_factory=list)


def screen_edit(old_source: str, new_source: str) -> str | None:
    """Why an edited source may not be graded (a forbidden name it introduces), or None."""
    before = {m.group(0) for m in FORBIDDEN.finditer(old_source)}
    after = {m.group(0) for m in FORBIDDEN.finditer(new_source)}
    extra = sorted(after - before)
    return f"edit introduces forbidden names {extra}" if extra else None


BATCH_RUNNER = r"""
import base64, json, os, resource, select, shutil, signal, sys, time
AGENT = 1000
job = json.loads(base64.b64decode(sys.argv[1]))
pristine = {}
for path in job["read"]:
    try:
        with open(os.path.join(job["workspace"], path), "rb") as f:
            pristine[path] = f.read()
    except OSError:
        pristine[path] = None
root = job["scratch"]
os.makedirs(root, mode=0o755, exist_ok=True)

def kill_agent():
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.stat("/proc/" + name).st_uid == AGENT:
                    os.kill(int(name), signal.SIGKILL)
            except OSError:
                pass

def child(d, tests, nonce, w):
    os.setsid()
    os.setgroups([]); os.setgid(AGENT); os.setuid(AGENT)
    resource.setrlimit(resource.RLIMIT_AS, (512 << 20, 512 << 20))
    resource.setrlimit(resource.RLIMIT_NPROC, (64, 64))
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    os.chdir(d)
    sys.path[:0] = [d]
    sys.dont_write_bytecode = True
    out = {}
    for test_file, names in tests.items():
        ns = {"__name__": "batch_test"}
        try:
            with open(test_file) as f:
                exec(compile(f.read(), test_file, "exec"), ns)
        except BaseException as e:
            for name in names:
                out[test_file + "::" + name] = "error"
            continue
        for name in names:
            try:
                ns[name]()
                out[test_file + "::" + name] = "passed"
            except AssertionError:
                out[test_file + "::" + name] = "failed"
            except BaseException:
                out[test_file + "::" + name] = "error"
    os.write(w, json.dumps({"nonce": nonce, "tests": out}).encode())
    os._exit(0)

results = []
for k, cand in enumerate(job["candidates"]):
    t0 = time.monotonic()
    d = "%s/%d" % (root, k)
    for path in cand["copy"]:
        body = cand["files"][path].encode() if path in cand["files"] else pristine[path]
        if body is None:
            continue
        full = os.path.join(d, path)
        os.makedirs(os.path.dirname(full), mode=0o755, exist_ok=True)
        with open(full, "wb") as f:
            f.write(body)
    nonce = base64.b16encode(os.urandom(8)).decode()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            child(d, cand["tests"], nonce, w)
        finally:
            os._exit(3)
    os.close(w)
    data, deadline, status = b"", t0 + job["timeout_s"], None
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([r], [], [], left)[0]:
            break
        chunk = os.read(r, 65536)
        if not chunk:
            break
        data += chunk
    os.close(r)
    while True:  # EOF comes as the child exits; give it until the deadline to be reaped
        done, code = os.waitpid(pid, os.WNOHANG)
        if done or time.monotonic() > deadline:
            break
        time.sleep(0.0005)
    if not done:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        code = None
    try:
        os.killpg(pid, signal.SIGKILL)  # the child's session: whatever it left behind
    except OSError:
        pass
    if job["sweep"]:  # in a grader container: every process of the agent uid, escaped sessions too
        kill_agent()
    try:
        report = json.loads(data) if data else None
    except ValueError:
        report = None
    results.append({"exit": None if code is None else os.waitstatus_to_exitcode(code),
                    "report": report, "nonce": nonce, "s": round(time.monotonic() - t0, 4)})
# The scratch tree is root's: the pool's reset wipes /tmp as `agent` and could not remove it, so
# the grader would fail its pristine check and be replaced by a fresh one (~1 s) after every batch.
shutil.rmtree(root, ignore_errors=True)
print(json.dumps(results))
"""


def _test_plan(task: Task) -> dict[str, list[str]]:
    plan: dict[str, list[str]] = {}
    for tid in task.test_ids:
        path, _, name = tid.partition("::")
        plan.setdefault(path, []).append(name)
    return plan


def _copy_paths(task: Task, files: dict[str, str]) -> list[str]:
    """Test files, candidate files, the task's source files (verification["sources"]: what its tests
    import), and the package __init__.py files above them."""
    paths = set(task.test_files) | set(files) | set(_test_plan(task)) | set(task.verification.get("sources", []))
    for p in list(paths):
        for parent in PurePosixPath(p).parents:
            if str(parent) != ".":
                paths.add(f"{parent}/__init__.py")
    return sorted(paths)


def _decide(task: Task, out: dict, dropped: list[str]) -> BatchGrade:
    report = out.get("report")
    if out.get("exit") is None:
        return BatchGrade(0.0, {}, "timed out or killed", dropped)
    if not report or report.get("nonce") != out["nonce"]:
        return BatchGrade(0.0, {}, f"no valid report (exit {out['exit']})", dropped)
    tests = {tid: report["tests"].get(tid, "missing") for tid in task.test_ids}
    if out["exit"] != 0:
        return BatchGrade(0.0, tests, f"test process exited {out['exit']}", dropped)
    bad = [t for t, s in tests.items() if s != "passed"]
    if bad:
        return BatchGrade(0.0, tests, f"not passed: {bad}", dropped)
    return BatchGrade(1.0, tests, "all F2P pass and all P2P still pass", dropped)


def grade_batch(
    items: list[tuple[Task, dict[str, str]]],
    *,
    pool: GraderPool,
    timeout_s: float = 2.0,
    exec_timeout_s: float = 120.0,
    workspace: str = "/workspace",
    sweep: bool = True,
) -> list[BatchGrade]:
    """Grade (task, {path: new content}) candidates of one image; one exec per <= MAX_JOB_BYTES of job.
    `sweep`: after each candidate kill every process of the agent uid (right in a grader container,
    whose PID namespace is its own; off only for bench.demo_learning's container-less LocalHarness).
    Raises GraderLost when the grader could not run the batch."""
    if not items:
        return []
    images = {task.image for task, _ in items}
    if len(images) != 1:
        raise ValueError(f"one batch grades one image, got {sorted(images)}")
    image = images.pop()
    cands, kept_files, dropped_all = [], [], []
    for task, files in items:
        kept = {p: c for p, c in files.items() if not is_protected(p, task.test_files)}
        dropped_all.append(sorted(set(files) - set(kept)))
        kept_files.append(kept)
        cands.append({"files": kept, "copy": _copy_paths(task, kept), "tests": _test_plan(task)})
    chunks: list[list[dict]] = [[]]
    size = 0
    for c in cands:
        n = len(json.dumps(c)) * 4 // 3 + 64
        if chunks[-1] and size + n > MAX_JOB_BYTES:
            chunks.append([])
            size = 0
        chunks[-1].append(c)
        size += n
    outs: list[dict] = []
    with pool.grader(image) as g:  # one lend (and one reset afterwards) for the whole batch
        for chunk in chunks:
            read = sorted({p for c in chunk for p in c["copy"] if p not in c["files"]})
            scratch = f"/tmp/.batch-{uuid.uuid4().hex[:12]}"
            job = base64.b64encode(
                json.dumps(
                    {
                        "read": read,
                        "candidates": chunk,
                        "timeout_s": timeout_s,
                        "workspace": workspace,
                        "scratch": scratch,
                        "sweep": sweep,
                    }
                ).encode()
            )
            r = g.exec(
                ["python3", "-I", "-c", BATCH_RUNNER, job.decode()],
                timeout=exec_timeout_s,
                user="root",
                workdir="/tmp",
                max_output_bytes=8_000_000,
            )
            lines = r.output.strip().splitlines()
            if r.exit_code != 0 or not lines:
                raise GraderLost(f"batch runner failed ({r.exit_code}): {r.output[-1500:]}")
            got = json.loads(lines[-1])
            if len(got) != len(chunk):
                raise GraderLost(f"batch runner answered {len(got)} of {len(chunk)} candidates")
            outs.extend(got)
    return [_decide(task, out, dropped) for (task, _), out, dropped in zip(items, outs, dropped_all)]


def grade_one_per_exec(
    task: Task,
    files: dict[str, str],
    *,
    pool: GraderPool,
    timeout_s: float = 2.0,
    workspace: str = "/workspace",
    sweep: bool = True,
) -> BatchGrade:
    """The baseline the batch path is measured against: the same runner, one exec per candidate."""
    return grade_batch([(task, files)], pool=pool, timeout_s=timeout_s, workspace=workspace, sweep=sweep)[0]


def timed(fn, *args, **kwargs) -> tuple[object, float]:
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - t0
