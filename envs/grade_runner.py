"""Resident grading runner: the main process of every grader container (stdlib + pytest only).

Started as `python3 -I -c <this file>` by envs/pool.py; runs as root holding only
CAP_SETUID/SETGID/KILL, imports pytest once, then serves JSON-line commands on stdin (the host's
attach socket) and answers one JSON line each on stdout, which no other process can write:
  init  -> record the pristine state: content digests of every writable place + a workspace tar
  grade -> fork a child that drops to the `agent` uid (nice 19), applies the screened patch,
           checks that git changed only the paths the host allowed and that the changed Python
           adds nothing the static screen (envs/screen.py, sent ahead of this file) refuses,
           restores test files, applies the hidden test patch, appends this run's canary tests
           to the F2P test modules and runs pytest in-process (under the repository's own pytest
           configuration, less what would stop early or change the report) with a trusted reporter streaming
           per-test records over an inherited pipe (console and records capped while they
           stream); this root parent checks the canaries, builds the JUnit XML from the records
           and returns it with the console output and exit code
  reset -> kill every agent process, wipe the writable places, re-extract the pristine
           workspace, and answer whether the digests equal the pristine ones
Canaries (envs/canaries.py): planted by the child before any code of the workspace runs, their
plan is the first record on the pipe and is then dropped from the child's memory; this parent
checks their outcomes. Code under test that forges outcomes, strips asserts, swaps test modules
or functions, or writes forged records cannot tell them from the real tests without reading
them; the static screen refuses the usual tools for doing so.
Not here: deciding the reward (envs/grading.py cross-checks the three sources).
"""

import hashlib
import importlib.metadata
import io
import json
import os
import pathlib
import random
import re
import shlex
import signal
import stat
import subprocess
import sys
import tarfile
import threading
import time
import xml.etree.ElementTree as ET

import _pytest.config
import _pytest.config.findpaths
import _pytest.main
import _pytest.python
import _pytest.reports
import _pytest.runner
import _pytest.terminal
import pytest

try:
    from envs.canaries import check_canaries, plant_canaries
    from envs.screen import screen_source
except ImportError:  # in a grader container: envs/pool.py sends both files' source ahead of this one
    pass

WORKSPACE, AGENT = "/workspace", 1000
WATCHED = ("/workspace", "/tmp", "/home/agent", "/dev/shm")
AGENT_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/home/agent", "LANG": "C.UTF-8",
             "PYTHONDONTWRITEBYTECODE": "1", "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
MAX_CONSOLE = 512_000  # console bytes kept (the tail: pytest's summary is at the end)
FLOOD_CONSOLE = 64 << 20  # past this much console output the run is killed as a flood
FLOOD_RECORDS = 16 << 20  # a real report of a few thousand tests is far below this
# Functions that decide or carry a test's outcome; replaced ones (or plugins registered from
# outside conftest.py files) after collection starts are reported as tampering.
_OUTCOME_PATH = [(_pytest.runner, "call_and_report"), (_pytest.runner, "runtestprotocol"),
                 (_pytest.runner, "pytest_runtest_makereport"), (_pytest.runner.CallInfo, "from_call"),
                 (_pytest.reports.TestReport, "from_item_and_call"), (_pytest.reports.TestReport, "__init__"),
                 (_pytest.python, "pytest_pyfunc_call"), (_pytest.python.Function, "runtest"),
                 (_pytest.main, "pytest_runtestloop"), (_pytest.terminal.TerminalReporter, "summary_stats"),
                 (_pytest.terminal.TerminalReporter, "pytest_runtest_logreport"), (os, "write"),
                 (json, "dumps")]
# Import every builtin plugin now, once: each forked test run then starts with them loaded.
for _name in _pytest.config.default_plugins:
    __import__(f"_pytest.{_name}")
_ORIGINAL = [(owner, name, owner.__dict__.get(name)) for owner, name in _OUTCOME_PATH]
_write, _dumps = os.write, json.dumps


class FlashpostReporter:
    """pytest plugin object (never a file the code under test could shadow)."""

    def __init__(self, fd):
        self.fd, self.plugins_at_start = fd, None

    def _emit(self, rec):
        _write(self.fd, (_dumps(rec) + "\n").encode())

    def _check(self, where):
        changed = [f"{getattr(o, '__name__', o)}.{n}" for o, n, f in _ORIGINAL if o.__dict__.get(n) is not f]
        if changed:
            self._emit({"tamper": f"{where}: replaced {changed}"})

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection(self, session):
        self.plugins_at_start = {id(p) for p in session.config.pluginmanager.get_plugins()}

    def pytest_runtest_logreport(self, report):
        self._check(report.nodeid)
        props = [str(v) for k, v in report.user_properties if k == "flashpost"] if report.when == "call" else []
        self._emit({"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
                    "xfail": hasattr(report, "wasxfail"), "duration": report.duration,
                    "message": str(report.longrepr)[-1500:] if report.failed else "", "props": props})

    def pytest_collectreport(self, report):
        if report.failed:
            self._emit({"collect_error": report.nodeid, "message": str(report.longrepr)[-1500:]})

    def pytest_sessionfinish(self, session, exitstatus):
        self._check("sessionfinish")
        for p in session.config.pluginmanager.get_plugins():
            if id(p) not in (self.plugins_at_start or ()) and \
                    os.path.basename(getattr(p, "__file__", "") or "") != "conftest.py":
                self._emit({"tamper": f"plugin registered during the run: {p!r}"[:300]})
        self._emit({"finish": int(exitstatus), "collected": session.testscollected})


# ------------------------------------------------------------------ processes as `agent`


def drop_to_agent():
    os.setgroups([])
    os.setgid(AGENT)
    os.setuid(AGENT)
    os.nice(19)  # a runaway test cannot starve this runner's timeout path
    os.environ.clear()
    os.environ.update(AGENT_ENV)


class Capped:
    """A drained stream: keeps the first `head` and last `tail` bytes, counts all of them, and
    sets `flooded` (which ends the run) once more than `flood` bytes came."""

    def __init__(self, head, tail, flood, stop):
        self.head, self.tail, self.flood, self.stop = head, tail, flood, stop
        self.first, self.last, self.total = bytearray(), bytearray(), 0
        self.flooded = False

    def append(self, chunk):
        self.total += len(chunk)
        room = self.head - len(self.first)
        if room > 0:
            self.first += chunk[:room]
            chunk = chunk[room:]
        if chunk and self.tail:
            self.last += chunk
            if len(self.last) > 2 * self.tail:
                del self.last[:len(self.last) - self.tail]
        if self.total > self.flood and not self.flooded:
            self.flooded = True
            self.stop.set()

    def data(self):
        tail = bytes(self.last[-self.tail:]) if self.tail else b""
        cut = self.total - len(self.first) - len(tail)
        return bytes(self.first) + (f"\n[... {cut} bytes cut ...]\n".encode() if cut > 0 else b"") + tail


def in_agent_child(fn, *, out_fd=None, sinks=(), parent_close=(), timeout=None, stop=None):
    """Run fn() in a forked child as agent; returns (exit code or None on timeout, fn's bytes).

    `sinks` are (read_fd, Capped) pairs drained while the child runs; the child closes those
    read ends (it must not steal its own report records) and gets /dev/null as stdin; the parent
    closes `parent_close` (the write ends it handed over) right after the fork. Setting `stop`
    (a sink flooded) ends the wait like a timeout.
    """
    stop = stop or threading.Event()
    r, w = os.pipe()
    for attempt in range(50):  # the pids cap may still be full of dying processes
        try:
            pid = os.fork()
            break
        except BlockingIOError:
            if attempt == 49:
                raise
            time.sleep(0.1)
    if pid == 0:
        code = 70
        try:
            os.close(r)
            for fd, _ in sinks:
                os.close(fd)
            null = os.open("/dev/null", os.O_RDWR)
            os.dup2(null, 0)
            # Never the runner's own stdout: that is the host's answer channel.
            os.dup2(null if out_fd is None else out_fd, 1)
            os.dup2(null if out_fd is None else out_fd, 2)
            drop_to_agent()
            data = fn()
            with os.fdopen(w, "wb") as f:
                f.write(data or b"")
            code = 0
        except BaseException as e:  # noqa: BLE001 - report anything to the parent, never return
            try:
                os.write(w, f"child failed: {e!r}".encode())
            except OSError:
                pass
        finally:
            os._exit(code)
    os.close(w)
    for fd in parent_close:
        os.close(fd)
    # fn's own answer: a state digest, or the workspace tar (the workspace tmpfs is 256 MB at most)
    chunks = Capped(1 << 29, 0, 1 << 29, stop)
    readers = [threading.Thread(target=drain, args=(fd, sink)) for fd, sink in [(r, chunks), *sinks]]
    for t in readers:
        t.start()
    rc = wait_child(pid, timeout, stop)
    kill_agent_processes()  # leftovers would hold the pipes open
    for t in readers:
        t.join(5)
    for fd, _ in [(r, chunks), *sinks]:
        os.close(fd)
    return rc, chunks.data()


def drain(fd, sink):
    while chunk := os.read(fd, 1 << 16):
        sink.append(chunk)


def wait_child(pid, timeout, stop):
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if stop.is_set() or (deadline is not None and time.monotonic() > deadline):
            return None
        time.sleep(0.005)


def agent_pids():
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.stat(f"/proc/{name}").st_uid == AGENT:
                    pids.append(int(name))
            except OSError:
                pass
    return pids


def kill_agent_processes():
    """SIGSTOP agent processes in rounds (a stopped process cannot fork), then SIGKILL them all."""
    stopped = set()
    for _ in range(500):
        fresh = [p for p in agent_pids() if p not in stopped]
        if not fresh:
            break
        for p in fresh:
            try:
                os.kill(p, signal.SIGSTOP)
            except ProcessLookupError:
                pass
        stopped.update(fresh)
    for p in stopped:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    # Dying processes still hold pid slots: wait (bounded) until they are gone or zombies, and
    # reap our own children among them, so the next fork does not fail on the pids cap.
    deadline = time.monotonic() + 5
    while stopped and time.monotonic() < deadline:
        try:
            while os.waitpid(-1, os.WNOHANG)[0] > 0:
                pass
        except ChildProcessError:
            pass
        alive = [p for p in stopped if _alive(p)]
        if not alive:
            break
        time.sleep(0.01)
    return len(stopped)


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# --------------------------------------------------------------------------- state/reset


def digest_tree(root):
    """Names, types, modes, owners, link targets and bytes (not mtimes) of everything under root."""
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in [""] + sorted(dirnames + filenames):
            path = os.path.join(dirpath, name) if name else dirpath
            st = os.lstat(path)
            link = os.readlink(path) if stat.S_ISLNK(st.st_mode) else ""
            size = st.st_size if stat.S_ISREG(st.st_mode) else 0  # tmpfs dir sizes vary
            h.update(f"{os.path.relpath(path, root)}\0{st.st_mode:o}\0{st.st_uid}\0{st.st_gid}\0{link}\0"
                     f"{size}\0".encode())
            if stat.S_ISREG(st.st_mode) and name:
                with open(path, "rb") as f:
                    h.update(hashlib.sha256(f.read()).digest())
    return h.hexdigest()


def state():
    return json.dumps({p: digest_tree(p) for p in WATCHED}).encode()


def snapshot_workspace():
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name in sorted(os.listdir(WORKSPACE)):
            tf.add(os.path.join(WORKSPACE, name), arcname=name)
    return buf.getvalue()


def wipe_and_restore(pristine):
    def fn():
        for top in WATCHED:
            for dirpath, dirnames, _ in os.walk(top):  # make every directory listable first
                for name in dirnames:
                    try:
                        os.chmod(os.path.join(dirpath, name), 0o700)
                    except OSError:
                        pass
            for dirpath, dirnames, filenames in os.walk(top, topdown=False):
                for name in filenames + dirnames:
                    path = os.path.join(dirpath, name)
                    try:
                        if os.path.isdir(path) and not os.path.islink(path):
                            os.chmod(path, 0o700)
                            os.rmdir(path)
                        else:
                            os.unlink(path)
                    except OSError:
                        pass  # not ours to remove (e.g. root-owned in sticky /tmp): state differs
            if top != WORKSPACE:
                continue
            with tarfile.open(fileobj=io.BytesIO(pristine)) as tf:
                tf.extractall(WORKSPACE, numeric_owner=True)
        return state()
    return fn


# --------------------------------------------------------------------------------- grading


class Refused(Exception):
    """The applied patch goes beyond what the host allowed, or the static screen refuses it."""


def git(*args, stdin=b""):
    p = subprocess.run(["git", "-c", "core.quotepath=off", *args], input=stdin, capture_output=True, cwd=WORKSPACE)
    if p.returncode != 0:
        raise RuntimeError(f"git {args[0]}: {p.stderr.decode(errors='replace')[-1500:]}")
    return p.stdout.decode(errors="surrogateescape")


def changed_paths():
    """Paths that differ from HEAD in the work tree: tracked, untracked and ignored ones."""
    out = git("status", "--porcelain=v1", "-z", "--untracked-files=all", "--ignored=matching", "--no-renames")
    return {entry[3:] for entry in out.split("\0") if len(entry) > 3}


def _read(path):
    try:
        with open(path, encoding="utf-8", errors="surrogateescape") as f:
            return f.read()
    except OSError:
        return ""


def prepare(job, baseline):
    """Apply the agent patch and check what it changed, restore test files, apply the test patch,
    append the canaries (as agent, in the pristine workspace, whose changed_paths() are
    `baseline`; before any code of the workspace has run)."""
    old = {p: _read(p) for p in job["allowed"] if p.endswith(".py")}  # the workspace is pristine here
    if job["patch"].strip():
        git("apply", "--whitespace=nowarn", "-", stdin=job["patch"].encode())
    changed = changed_paths() - baseline
    extra = sorted(changed - set(job["allowed"]))
    if extra:
        raise Refused(f"applying the patch changed paths the patch screen did not see: {extra[:20]}")
    hits = []
    for path in sorted(changed):
        st = os.lstat(path) if os.path.lexists(path) else None
        if st is not None and not stat.S_ISREG(st.st_mode):
            raise Refused(f"{path} is no longer a regular file")
        if path.endswith(".py") and st is not None:
            hits += [f"{path}: {h}" for h in screen_source(old.get(path, ""), _read(path))]
    if hits:
        raise Refused("the static screen refuses the changed code: " + "; ".join(hits))
    if job["test_files"]:
        listed = git("ls-tree", "-r", "--name-only", job["base_revision"], "--", *job["test_files"])
        in_base = set(listed.splitlines())
        if in_base:
            git("checkout", job["base_revision"], "--", *sorted(in_base))
        for path in set(job["test_files"]) - in_base:
            subprocess.run(["rm", "-rf", "--", path])
    if job["test_patch"].strip():
        git("apply", "--whitespace=nowarn", "-", stdin=job["test_patch"].encode())
    sources = {p: _read(p) for p in {t.split("::")[0] for t in job["f2p"]} if os.path.isfile(p)}
    append, expect = plant_canaries(sources, job["f2p"], random.SystemRandom(), record=True)
    for path, source in append.items():
        with open(path, "a") as f:
            f.write(source)
    return expect


# The repository's own pytest configuration (pytest.ini, pyproject.toml, tox.ini, setup.cfg: pytest's
# own search) is passed as -o overrides with `-c /dev/null`, so keys that would stop this pytest
# (minversion, required_plugins) or write files (cache_dir, log_file) are left out, and addopts keeps
# only options that select or describe tests: never ones that stop early, change the report or the
# process model, load code, or collect tests from files the agent may edit (doctests).
_INI_SKIPPED = {"minversion", "required_plugins", "cache_dir", "log_file", "log_file_level", "log_file_format",
                "log_file_date_format", "junit_logging", "addopts"}
_ADDOPTS_KEPT = {  # option -> takes a value
    "--strict-markers": False, "--strict-config": False, "--strict": False, "--import-mode": True,
    "--ignore": True, "--ignore-glob": True, "--deselect": True, "-m": True, "-k": True, "-W": True,
    "--pythonwarnings": True, "-r": True, "--tb": True, "-l": False, "--showlocals": False,
    "--durations": True, "--durations-min": True, "--continue-on-collection-errors": False,
    "--runxfail": False, "--color": True, "--no-header": False, "-p": True,  # -p only as "no:NAME"
}
# Plugins that would change outcomes or the process model.
_PLUGINS_SKIPPED = {"xdist", "xdist.looponfail", "randomly", "rerunfailures", "flaky", "cov"}


def image_plugins():
    """The pytest plugins of the image's test environment (its wheels' pytest11 entry points), loaded
    here, before any workspace path is on sys.path, and handed to pytest as objects: pytest never looks
    a plugin up by name, so a workspace *.dist-info cannot slip one in ahead of the reporter's checks."""
    out = []
    for ep in sorted(importlib.metadata.entry_points(group="pytest11"), key=lambda e: e.name):
        if ep.name in _PLUGINS_SKIPPED:
            continue
        try:
            out.append(ep.load())
        except Exception:  # noqa: BLE001 - a plugin that cannot load is left out, not fatal to grading
            continue
    return out


IMAGE_PLUGINS = image_plugins()


def filter_addopts(opts):
    """(kept, dropped) options of an addopts value (a string, or a list from pyproject.toml)."""
    tokens = shlex.split(opts) if isinstance(opts, str) else [str(t) for t in opts]
    kept, dropped, i = [], [], 0
    while i < len(tokens):
        tok, i = tokens[i], i + 1
        if tok.startswith("--"):
            name, eq, value = tok.partition("=")
            value = value if eq else None
        elif tok.startswith("-") and len(tok) > 1:
            name, value = tok[:2], tok[2:] or None
        else:  # a path: which tests run is the grader's choice
            dropped.append(tok)
            continue
        takes = _ADDOPTS_KEPT.get(name)
        if takes and value is None and i < len(tokens):
            value, i = tokens[i], i + 1
        ok = takes is not None and (value is not None) == takes and not (name == "-p" and not value.startswith("no:"))
        (kept if ok else dropped).extend([name] if value is None else [name, value])
    return kept, dropped


def repo_config_args(workspace):
    """pytest arguments that honour the repository's configuration; (args, notes)."""
    try:
        _, inipath, inicfg = _pytest.config.findpaths.locate_config([pathlib.Path(workspace)])
    except Exception as e:  # noqa: BLE001 - pytest itself would stop on a malformed config
        return ["-o", "addopts="], [f"pytest configuration not read: {e}"[:300]]
    args, notes = [], []
    for key, value in sorted(inicfg.items()):
        if key in _INI_SKIPPED:
            if key != "addopts":
                notes.append(f"ini {key} not used")
            continue
        if key == "pythonpath":  # relative to the config's folder, which `-c /dev/null` would make /dev
            parts = shlex.split(value) if isinstance(value, str) else value
            value = [os.path.join(os.path.dirname(inipath), p) for p in parts]
        args += ["-o", f"{key}={chr(10).join(value) if isinstance(value, list) else value}"]
    kept, dropped = filter_addopts(inicfg.get("addopts", ""))
    args += ["-o", f"addopts={shlex.join(kept)}"]
    if dropped:
        notes.append(f"addopts not used: {' '.join(dropped)}")
    if inipath is not None:
        notes.insert(0, f"pytest configuration: {os.path.relpath(inipath, workspace)}")
    return args, notes


def run_tests(job, baseline, rec_fd):
    def fn():
        os.chdir(WORKSPACE)
        try:
            expect = prepare(job, baseline)
        except (RuntimeError, Refused, OSError) as e:
            kind = "refused" if isinstance(e, Refused) else "prepare_failed"
            os.write(rec_fd, (json.dumps({kind: str(e)}) + "\n").encode())
            os._exit(97)
        # The first record, written before any code of the workspace runs; then forgotten here.
        os.write(rec_fd, (json.dumps({"canaries": expect}) + "\n").encode())
        expect.clear()
        # the library under test is imported from the workspace: a flat layout from its root, a src/ one from src/
        src = os.path.join(WORKSPACE, "src")
        src_layout = os.path.isdir(src) and not os.path.exists(os.path.join(src, "__init__.py"))
        sys.path[:0] = [WORKSPACE] + [src] * src_layout
        sys.dont_write_bytecode = True
        config, notes = repo_config_args(WORKSPACE)
        for note in notes:
            print(f"flashpost: {note}", file=sys.stderr)
        args = ["-p", "no:cacheprovider", "-c", "/dev/null", "--rootdir", WORKSPACE, *config,
                "-q", "--tb=short", *job["test_paths"]]
        rc = pytest.main(args, plugins=[FlashpostReporter(rec_fd), *IMAGE_PLUGINS])
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(int(rc))
    return fn


def grade(job, baseline):
    rec_r, rec_w = os.pipe()
    out_r, out_w = os.pipe()
    stop = threading.Event()
    recs = Capped(FLOOD_RECORDS, 0, FLOOD_RECORDS, stop)
    console = Capped(MAX_CONSOLE // 8, MAX_CONSOLE, FLOOD_CONSOLE, stop)
    rc, _ = in_agent_child(run_tests(job, baseline, rec_w), out_fd=out_w,
                           sinks=[(rec_r, recs), (out_r, console)], parent_close=(rec_w, out_w),
                           timeout=job["timeout_s"], stop=stop)
    result = {"prepared": True, "exit_code": rc, "records": [], "conflicts": [], "log": [], "tamper": [],
              "refused": None, "flood": None, "canaries": []}
    expect = None
    if console.flooded or recs.flooded:
        rc = result["exit_code"] = None
        what = "console output" if console.flooded else "report records"
        result["flood"] = f"the tests wrote more than {(console.flood if console.flooded else recs.flood) >> 20} MB " \
                          f"of {what}; the run was killed"
    elif rc is None:
        result["log"].append(f"pytest timed out after {job['timeout_s']}s")
    for n, line in enumerate(recs.data().decode(errors="replace").splitlines()):
        try:
            rec = json.loads(line)
        except ValueError:
            result["conflicts"].append(f"unparseable report record: {line[:200]!r}")
            continue
        if isinstance(rec, dict) and "canaries" in rec:
            if n != 0 or not isinstance(rec["canaries"], dict):
                result["tamper"].append("a canary plan record that the runner did not write first")
            else:
                expect = {k: tuple(v) for k, v in rec["canaries"].items()}
        elif isinstance(rec, dict) and isinstance(rec.get("prepare_failed"), str) and rc == 97:
            result["prepared"] = False
            result["log"].append(rec["prepare_failed"])
        elif isinstance(rec, dict) and isinstance(rec.get("refused"), str) and rc == 97:
            result["prepared"] = False
            result["refused"] = rec["refused"]
        elif isinstance(rec, dict) and isinstance(rec.get("tamper"), str):
            result["tamper"].append(rec["tamper"])
        elif well_formed(rec):
            result["records"].append(rec)
        else:
            result["conflicts"].append(f"malformed report record: {line[:200]!r}")
    status, conflicts = statuses(result["records"])
    result["conflicts"] += conflicts
    if result["prepared"] and result["flood"] is None and rc is not None:
        if expect is None:
            result["tamper"].append("the canary plan record is missing")
        else:
            result["canaries"] = sorted(expect)
            evidence = {}
            for r in result["records"]:
                if "nodeid" in r and r["when"] == "call":
                    evidence[r["nodeid"]] = r["message"] if r["outcome"] == "failed" else "|".join(r["props"])
            # A module that did not load has no test records at all; one that has is not excused.
            ran = {r["nodeid"].split("::")[0] for r in result["records"] if "nodeid" in r}
            unloaded = {r["collect_error"].split("::")[0] for r in result["records"] if "collect_error" in r} - ran
            result["tamper"] += check_canaries(expect, status, evidence, unloaded=unloaded)
    return {"result": result, "junit": junit_xml(status, result["records"]),
            "console": console.data().decode(errors="replace")}


def well_formed(rec):
    if not isinstance(rec, dict):
        return False
    if "nodeid" in rec:
        return (isinstance(rec["nodeid"], str) and rec.get("when") in ("setup", "call", "teardown")
                and rec.get("outcome") in ("passed", "failed", "skipped")
                and isinstance(rec.get("xfail"), bool)
                and isinstance(rec.get("duration"), (int, float)) and isinstance(rec.get("message"), str)
                and isinstance(rec.get("props"), list) and all(isinstance(v, str) for v in rec["props"]))
    if "collect_error" in rec:
        return isinstance(rec["collect_error"], str) and isinstance(rec.get("message"), str)
    return set(rec) == {"finish", "collected"} and all(type(v) is int for v in rec.values())


def statuses(records):
    """Per-test status from phase records; a (nodeid, phase) seen twice is a conflict."""
    status, seen, conflicts = {}, set(), []
    for r in records:
        if "nodeid" not in r:
            continue
        key = (r["nodeid"], r["when"])
        if key in seen:
            conflicts.append(f"{r['nodeid']} ({r['when']}) reported twice")
        seen.add(key)
        nid, outcome, xfail = r["nodeid"], r["outcome"], r["xfail"]
        if r["when"] == "setup" and outcome != "passed":
            status[nid] = "error" if outcome == "failed" else ("xfailed" if xfail else "skipped")
        elif r["when"] == "call":
            status[nid] = {"passed": "xpassed" if xfail else "passed", "failed": "failed",
                           "skipped": "xfailed" if xfail else "skipped"}[outcome]
        elif r["when"] == "teardown" and outcome == "failed":
            status[nid] = "error"
    return status, conflicts


# Characters XML 1.0 cannot hold (a failure message quoting terminal escapes, NUL...), written as \xNN.
_XML_UNSAFE = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def _escape(m):
    return f"\\x{ord(m.group()):02x}"


def junit_xml(status, records):
    """pytest-style JUnit (xunit2 naming, plus a file attribute) built outside the test process."""
    messages = {r["nodeid"]: r["message"] for r in records if r.get("message") and "nodeid" in r}
    count = lambda *s: str(sum(v in s for v in status.values()))
    suite = ET.Element("testsuite", name="pytest", tests=str(len(status)), failures=count("failed"),
                       errors=count("error"), skipped=count("skipped", "xfailed"))
    for nid, st in status.items():
        parts = nid.split("::")
        module = parts[0][:-3] if parts[0].endswith(".py") else parts[0]
        case = ET.SubElement(suite, "testcase", classname=".".join([module.replace("/", "."), *parts[1:-1]]),
                             name=parts[-1], file=parts[0])
        if st in ("failed", "error"):
            tag = "failure" if st == "failed" else "error"
            ET.SubElement(case, tag, message=st).text = _XML_UNSAFE.sub(_escape, messages.get(nid, ""))
        elif st in ("skipped", "xfailed"):
            ET.SubElement(case, "skipped", message=st)
    root = ET.Element("testsuites")
    root.append(suite)
    return ET.tostring(root, encoding="unicode")


# ----------------------------------------------------------------------------------- serve


def main():
    pristine = {}  # "state" (digests), "workspace" (tar), "baseline" (changed_paths() when pristine)
    for line in sys.stdin:
        cmd = json.loads(line)
        t0 = time.monotonic()
        try:
            reply = serve_one(cmd, pristine)
        except Exception as e:  # noqa: BLE001 - keep serving; the host fails this request
            reply = {"error": f"{type(e).__name__}: {e}"}
        reply["runner_s"] = time.monotonic() - t0
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


def serve_one(cmd, pristine):
    if cmd["cmd"] == "init":  # the host has extracted the image's workspace: record it
        rc, data = in_agent_child(state, timeout=60)
        rc2, snapshot = in_agent_child(snapshot_workspace, timeout=60)
        rc3, base = in_agent_child(lambda: json.dumps(sorted(changed_paths())).encode(), timeout=60)
        ok = rc == rc2 == rc3 == 0
        if ok:
            pristine.update(state=json.loads(data), workspace=snapshot, baseline=set(json.loads(base)))
        return {"ready": ok, "state": pristine.get("state")}
    if not pristine:
        return {"error": "not initialised"}
    if cmd["cmd"] == "grade":
        return grade(cmd["job"], pristine["baseline"])
    if cmd["cmd"] == "reset":
        killed = kill_agent_processes()
        rc, now = in_agent_child(wipe_and_restore(pristine["workspace"]), timeout=60)
        now_state = json.loads(now) if rc == 0 else None
        return {"ok": now_state == pristine["state"], "killed": killed, "state": now_state}
    return {"error": f"unknown command {cmd['cmd']!r}"}


if __name__ == "__main__":
    main()
