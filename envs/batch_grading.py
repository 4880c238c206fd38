"""Batch grading: many candidate file sets (a GRPO group, or candidates for many tasks of one image)
graded in ONE exec of a warm pristine grader container from envs.pool.GraderPool.

The host normalises and screens each candidate's paths like envs/patches.py screens a patch
(absolute, `..`, odd or auto-loaded paths refuse the candidate; test files are dropped), then
runs `BATCH_RUNNER` once as root in the grader. The runner reads every pristine file it needs
from /workspace into memory before any candidate runs, then for each candidate in turn: drops
new files (only existing ones may change), screens its changed Python with envs/screen.py
(sent ahead of the runner), writes a fresh private copy (root-owned, read-only to the test uid)
under /tmp with this candidate's canary tests appended to its F2P test files, forks a child
that drops to `RUN_UID` (owns nothing: it cannot write /workspace, the copies or the runner's
files; no groups, rlimits, its own session, stdin/stdout/stderr on /dev/null, only its own
result pipe open) and runs the candidate's tests and canaries in a shuffled order, reads at most
`MAX_REPORT` bytes of its report, waits at most `timeout_s`, then SIGKILLs every process of the
test uids and removes whatever they left, so nothing one candidate does can reach the next or
the answer. The answer is one line on the runner's stdout behind a marker only the host knows.
Reward 1 iff the report carried the per-candidate nonce, every canary came out as planted, the
child exited 0 and every test id of the task (F2P and P2P) passed.

A task names the source files its tests import in verification["sources"] (synth/families does).
Tests are plain `test_*` functions called in file order (no pytest: its start-up costs more than
a whole candidate here), so this path is for tasks whose tests are plain functions (synth/families
tasks); `envs.grading.grade_patch` stays the general path. Known limit: code under test shares
the child process with the harness, so the canaries and the screen make a forgery show rather
than impossible (code that finds the canaries' source by means the screen misses can mimic
them). The demo's short edits are also screened by `screen_edit`. Not here: the resident runner
or pool policy (envs/pool.py).
"""

from __future__ import annotations

import base64
import json
import re
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from envs.grading import audit
from envs.patches import is_test_path, path_problem
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
import base64, json, os, random, resource, select, shutil, signal, stat, sys, time
AGENT, RUN_UID = 1000, 1001
MAX_REPORT = 1 << 20
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
rng = random.SystemRandom()

def kill_test_uids():
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.stat("/proc/" + name).st_uid in (AGENT, RUN_UID):
                    os.kill(int(name), signal.SIGKILL)
            except OSError:
                pass

def remove_leftovers():  # what the test uid wrote in the shared writable places
    for top in ("/tmp", "/dev/shm", "/home/agent"):
        for dirpath, dirnames, filenames in os.walk(top, topdown=False):
            for name in filenames + dirnames:
                path = os.path.join(dirpath, name)
                try:
                    st = os.lstat(path)
                    if st.st_uid == RUN_UID:
                        os.rmdir(path) if stat.S_ISDIR(st.st_mode) else os.unlink(path)
                except OSError:
                    pass

def child(d, plan, secrets, nonce, w):
    for secret in secrets:  # the canaries' expected outcomes stay with the root parent only
        secret.clear()
    os.setsid()
    null = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.closerange(3, w)
    os.closerange(w + 1, 1 << 16)
    os.setgroups([]); os.setgid(RUN_UID); os.setuid(RUN_UID)
    resource.setrlimit(resource.RLIMIT_AS, (512 << 20, 512 << 20))
    resource.setrlimit(resource.RLIMIT_NPROC, (64, 64))
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    os.chdir(d)
    sys.path[:0] = [d]
    sys.dont_write_bytecode = True
    out, values = {}, {}
    for test_file, names in plan:
        ns = {"__name__": "batch_test"}
        try:
            with open(test_file) as f:
                exec(compile(f.read(), test_file, "exec"), ns)
        except BaseException:
            for name in names:
                out[test_file + "::" + name] = "error"
            continue
        for name in names:
            try:
                ret = ns[name]()
                out[test_file + "::" + name] = "passed"
                if type(ret) is int:
                    values[test_file + "::" + name] = ret
            except AssertionError:
                out[test_file + "::" + name] = "failed"
            except BaseException:
                out[test_file + "::" + name] = "error"
    os.write(w, json.dumps({"nonce": nonce, "tests": out, "values": values}).encode())
    os._exit(0)

def grade_one(k, cand):
    t0 = time.monotonic()
    res = {"exit": None, "report": None, "tamper": [], "refused": None, "dropped": [], "note": ""}
    files = {}
    for path, body in cand["files"].items():
        if pristine.get(path) is None:
            res["dropped"].append(path)  # a new file: only existing files may change
            continue
        if path.endswith(".py"):
            hits = screen_source(pristine[path].decode("utf-8", "surrogateescape"), body)
            if hits:
                res["refused"] = "the static screen refuses the changed code: %s: %s" % (path, "; ".join(hits))
                return res
        files[path] = body.encode()
    d = "%s/%d" % (root, k)
    for path in cand["copy"]:
        body = files[path] if path in files else pristine.get(path)
        if body is None:
            continue
        full = os.path.join(d, path)
        os.makedirs(os.path.dirname(full), mode=0o755, exist_ok=True)
        with open(full, "wb") as f:
            f.write(body)
    sources = {}
    for test_file in cand["tests"]:
        try:
            with open(os.path.join(d, test_file), encoding="utf-8", errors="surrogateescape") as f:
                sources[test_file] = f.read()
        except OSError:
            pass
    planted, expect = plant_canaries(sources, cand["f2p"], rng, record=False)
    plan = []
    for test_file, names in cand["tests"].items():
        if test_file in planted:
            with open(os.path.join(d, test_file), "a") as f:
                f.write(planted[test_file])
        names = names + sorted(t.split("::", 1)[1] for t in expect if t.startswith(test_file + "::"))
        rng.shuffle(names)
        plan.append((test_file, names))
    nonce = base64.b16encode(os.urandom(16)).decode()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            child(d, plan, (expect, planted), nonce, w)
        finally:
            os._exit(3)
    os.close(w)
    data, deadline, code = b"", t0 + job["timeout_s"], None
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([r], [], [], left)[0]:
            break
        chunk = os.read(r, 65536)
        if not chunk:
            break
        data += chunk
        if len(data) > MAX_REPORT:
            res["note"] = "report over %d bytes" % MAX_REPORT
            break
    os.close(r)
    while True:  # EOF comes as the child exits; give it until the deadline to be reaped
        done, code = os.waitpid(pid, os.WNOHANG)
        if done or time.monotonic() > deadline or res["note"]:
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
    if job["sweep"]:  # in a grader container: every process of the test uids, escaped sessions too
        kill_test_uids()
        remove_leftovers()
    res["exit"] = None if code is None else os.waitstatus_to_exitcode(code)
    try:
        report = json.loads(data) if data and not res["note"] else None
    except ValueError:
        report = None
    if isinstance(report, dict) and report.get("nonce") == nonce and isinstance(report.get("tests"), dict):
        tests = {str(t): str(v) for t, v in report["tests"].items()}
        values = report.get("values") if isinstance(report.get("values"), dict) else {}
        res["report"] = {"tests": {t: v for t, v in tests.items() if t not in expect}}
        unloaded = {p for p in cand["tests"] if all(v == "error" for t, v in tests.items() if t.startswith(p + "::"))}
        res["tamper"] = check_canaries(expect, tests, {t: str(v) for t, v in values.items()}, unloaded=unloaded,
                                       quote=False)
    res["s"] = round(time.monotonic() - t0, 4)
    return res

results = []
for k, cand in enumerate(job["candidates"]):
    try:
        results.append(grade_one(k, cand))
    except Exception as e:  # one candidate's failure is its own zero, never the batch's
        results.append({"exit": None, "report": None, "tamper": [], "refused": None, "dropped": [],
                        "note": "runner error: %s: %s" % (type(e).__name__, e)})
# The scratch tree is root's: the pool's reset wipes /tmp as `agent` and could not remove it, so
# the grader would fail its pristine check and be replaced by a fresh one (~1 s) after every batch.
shutil.rmtree(root, ignore_errors=True)
sys.stdout.write("\n" + job["marker"] + json.dumps(results) + "\n")
sys.stdout.flush()
"""
# The runner's canaries and static screen (stdlib only) travel ahead of it in one -c source.
RUNNER_SOURCE = "\n".join((Path(__file__).parent / f).read_text() for f in ("canaries.py", "screen.py")) + BATCH_RUNNER


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
    def zero(reason: str, tests: dict | None = None, flag: str = "") -> BatchGrade:
        if flag:
            audit(task, flag, reason)
        return BatchGrade(0.0, tests or {}, reason, dropped)

    dropped = sorted(set(dropped) | set(out.get("dropped", [])))
    report = out.get("report")
    if out.get("refused"):
        return zero(f"candidate refused in the grader: {out['refused']}", flag="screen")
    if out.get("note"):
        return zero(f"no valid report ({out['note']})", flag="flood" if "bytes" in out["note"] else "")
    if out.get("exit") is None:
        return zero("timed out or killed")
    if not report:
        return zero(f"no valid report carrying this candidate's nonce (exit {out['exit']})")
    if out.get("tamper"):
        return zero("tamper detected (the test run's report cannot be trusted): " + "; ".join(out["tamper"])[:1500],
                    flag="tamper")
    tests = {tid: report["tests"].get(tid, "missing") for tid in task.test_ids}
    if out["exit"] != 0:
        return zero(f"test process exited {out['exit']}", tests)
    bad = [t for t, s in tests.items() if s != "passed"]
    if bad:
        return zero(f"not passed: {bad}", tests)
    return BatchGrade(1.0, tests, "all F2P pass and all P2P still pass", dropped)


def _screen_files(task: Task, files: dict[str, str]) -> tuple[dict[str, str], list[str], str | None]:
    """(files to send, dropped test files, why the candidate is refused or None)."""
    for p in files:
        if (why := path_problem(p)) is not None:
            return {}, [], f"candidate refused: {why}"
    kept = {p: c for p, c in files.items() if not is_test_path(p, task.test_files)}
    return kept, sorted(set(files) - set(kept)), None


def _parse_answer(output: str, marker: str, n: int) -> list[dict]:
    at = output.rfind(marker)
    if at < 0:
        raise GraderLost(f"batch runner gave no answer: {output[-1500:]}")
    got = json.loads(output[at + len(marker):].split("\n", 1)[0])
    if len(got) != n:
        raise GraderLost(f"batch runner answered {len(got)} of {n} candidates")
    return got


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
    `sweep`: after each candidate kill every process of the test uids and remove their files (right
    in a grader container, whose PID namespace is its own; never turn it off where the PID namespace
    is shared). Raises GraderLost when the grader could not run the batch."""
    if not items:
        return []
    images = {task.image for task, _ in items}
    if len(images) != 1:
        raise ValueError(f"one batch grades one image, got {sorted(images)}")
    image = images.pop()
    cands, dropped_all, refused = [], [], {}
    for k, (task, files) in enumerate(items):
        kept, dropped, why = _screen_files(task, files)
        dropped_all.append(dropped)
        if why:
            refused[k] = why
            continue
        cands.append((k, {"files": kept, "copy": _copy_paths(task, kept), "tests": _test_plan(task),
                          "f2p": task.f2p}))
    chunks: list[list[tuple[int, dict]]] = [[]]
    size = 0
    for kc in cands:
        n = len(json.dumps(kc[1])) * 4 // 3 + 64
        if chunks[-1] and size + n > MAX_JOB_BYTES:
            chunks.append([])
            size = 0
        chunks[-1].append(kc)
        size += n
    outs: dict[int, dict] = {}
    with pool.grader(image) as g:  # one lend (and one reset afterwards) for the whole batch
        for chunk in [c for c in chunks if c]:
            marker = f"@@flashpost-batch-{uuid.uuid4().hex}@@"
            job = {"read": sorted({p for _, c in chunk for p in c["copy"]}), "candidates": [c for _, c in chunk],
                   "timeout_s": timeout_s, "workspace": workspace, "sweep": sweep, "marker": marker,
                   "scratch": f"/tmp/.batch-{uuid.uuid4().hex[:12]}"}
            r = g.exec(
                ["python3", "-I", "-c", RUNNER_SOURCE, base64.b64encode(json.dumps(job).encode()).decode()],
                timeout=exec_timeout_s,
                user="root",
                workdir="/tmp",
                max_output_bytes=8_000_000,
            )
            if r.exit_code != 0:
                raise GraderLost(f"batch runner failed ({r.exit_code}): {r.output[-1500:]}")
            outs.update(zip([k for k, _ in chunk], _parse_answer(r.output, marker, len(chunk))))
    grades = []
    for k, (task, _) in enumerate(items):
        if k in refused:
            audit(task, "patch", refused[k])
            grades.append(BatchGrade(0.0, {}, refused[k], dropped_all[k]))
        else:
            grades.append(_decide(task, outs[k], dropped_all[k]))
    return grades


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
