"""Container lifecycle policy: a concurrency cap for agent sandboxes, and warm grader pools.

`SandboxPool` caps how many agent sandboxes run at once and never reuses one between episodes
(a fresh container per episode); it reaps stale containers left by dead processes on start.
`GraderPool` keeps warm pristine grader containers per task image: after each grading a grader
is reset (processes killed, writable mounts wiped, the image's workspace re-extracted) and
verified against the content hash of a fresh container's state before it is used again;
a grader that fails verification is discarded. What runs inside graders is envs/grading.py.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from envs import engine
from envs.sandbox import Sandbox, SandboxLimits

# The runner's canaries and static screen (stdlib only) travel ahead of it in one -c source.
RUNNER_SRC = "\n".join((Path(__file__).parent / f).read_text() for f in ("canaries.py", "screen.py", "grade_runner.py"))

GRADER_LIMITS = SandboxLimits(memory="1g", pids=256, cpus=1.0, lifetime_s=6 * 3600)


class SandboxPool:
    """`with pool.sandbox(image) as sb:` blocks while max_concurrent sandboxes are live."""

    def __init__(self, max_concurrent: int, *, reap_stale: bool = True):
        if max_concurrent < 1:
            raise ValueError("max_concurrent must be >= 1")
        self.max_concurrent = max_concurrent
        self._sem = threading.BoundedSemaphore(max_concurrent)
        self._lock = threading.Lock()
        self._live: set[str] = set()
        self.reaped = engine.reap_containers(only_stale=True) if reap_stale else []

    @contextlib.contextmanager
    def sandbox(self, image: str | None = None, **kwargs) -> Iterator[Sandbox]:
        with self._sem, Sandbox(image, **kwargs) as sb:
            with self._lock:
                self._live.add(sb.container_id)
            try:
                yield sb
            finally:
                with self._lock:
                    self._live.discard(sb.container_id)

    @property
    def live(self) -> int:
        with self._lock:
            return len(self._live)


class GraderLost(RuntimeError):
    """The grader's runner did not answer in time or died; the container must be discarded."""


class GraderSandbox(Sandbox):
    """A sandbox of the task image whose main process is the resident runner (envs/grade_runner.py)
    as root holding CAP_SETUID/SETGID/KILL: it drops each test run to the `agent` uid and kills
    whatever the tests leave behind; the tests themselves hold no capabilities. The host talks
    to it over the attach socket, so grading costs no `docker exec` and no interpreter start."""

    def __init__(self, image: str, limits: SandboxLimits = GRADER_LIMITS):
        super().__init__(image, limits=limits, role="grader")
        self._stdin_open = True
        self._chan: engine.Attached | None = None
        self._chan_lock = threading.Lock()  # one request/answer at a time
        self.pristine_state: dict[str, str] | None = None

    def _cap_add(self) -> list[str]:
        return ["SETUID", "SETGID", "KILL"]

    def _command(self) -> list[str]:
        return ["python3", "-I", "-c", RUNNER_SRC]

    def start(self) -> GraderSandbox:
        super().start()
        try:
            self._chan = engine.Attached(self.container_id)
            reply = self.request({"cmd": "init"}, timeout=60)
            if not reply.get("ready"):
                raise GraderLost(f"grader runner failed to initialise: {reply}")
            self.pristine_state = reply["state"]
        except BaseException:
            self.close()
            raise
        return self

    def request(self, cmd: dict, timeout: float) -> dict:
        if self._chan is None:
            raise GraderLost("grader is not started")
        try:
            with self._chan_lock:
                self._chan.send_line(json.dumps(cmd).encode())
                return json.loads(self._chan.recv_line(timeout))
        except (TimeoutError, EOFError, OSError, ValueError) as e:
            self._chan.close()  # a late answer must never be read as the next one
            self._chan = None
            why = str(e)
            if isinstance(e, EOFError):  # say what the engine knows: OOM-killed, exit code
                try:
                    why = engine.container_state_reason(self.container_id)
                except engine.ContainerGone as gone:
                    why = str(gone)
            raise GraderLost(f"grader runner lost: {why}") from e

    def close(self) -> None:
        if self._chan is not None:
            self._chan.close()
            self._chan = None
        super().close()


class GraderPool:
    """Warm pristine graders per image; `with pool.grader(image) as g:` lends one exclusively.

    At most max_graders are busy or resetting at once. Each image keeps up to
    graders_per_image; when all of them are busy a request waits (up to wait_s) for one to come
    back, since a reset (~0.03 s) is far cheaper than starting a new grader (~0.8 s).
    Resets run on background threads so a grading returns as soon as its tests are done.
    """

    def __init__(self, *, max_graders: int = 8, graders_per_image: int = 4, wait_s: float = 2.0,
                 limits: SandboxLimits = GRADER_LIMITS, reset_workers: int = 2):
        self.limits = limits
        self.graders_per_image = graders_per_image
        self.wait_s = wait_s
        self._sem = threading.BoundedSemaphore(max_graders)
        self._lock = threading.Lock()
        self._returned = threading.Condition(self._lock)
        self._active: dict[str, int] = defaultdict(int)  # existing graders of an image not idle
        self._idle: dict[str, list[GraderSandbox]] = defaultdict(list)
        self._pristine: dict[str, dict[str, str]] = {}
        self._resetter = ThreadPoolExecutor(reset_workers, thread_name_prefix="grader-reset")
        self._closed = False
        self.stats = {"created": 0, "reused": 0, "reset_ok": 0, "reset_failed": 0}

    def warm(self, image: str, n: int) -> None:
        """Start n idle graders for image ahead of time."""
        for _ in range(n):
            g = self._create(image)
            with self._lock:
                self._idle[image].append(g)

    @contextlib.contextmanager
    def grader(self, image: str) -> Iterator[GraderSandbox]:
        if self._closed:
            raise RuntimeError("GraderPool is closed")
        self._sem.acquire()
        g = None
        try:
            g = self._take(image) or self._create(image)
            yield g
        except BaseException:  # a lost grader (or a failed start) is removed, never reused
            if g is not None:
                g.close()
            with self._lock:
                self._active[image] -= 1
                self._returned.notify_all()
            self._sem.release()
            raise
        self._resetter.submit(self._recycle, g, image)

    def _take(self, image: str) -> GraderSandbox | None:
        """An idle grader of image, or None to create one. Counts the grader as active."""
        deadline = time.monotonic() + self.wait_s
        with self._returned:
            while not self._idle[image] and self._active[image] >= self.graders_per_image:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._returned.wait(left)
            self._active[image] += 1
            if self._idle[image]:
                self.stats["reused"] += 1
                return self._idle[image].pop()
        return None

    def _create(self, image: str) -> GraderSandbox:
        g = GraderSandbox(image, self.limits).start()
        with self._lock:
            self.stats["created"] += 1
            # A fresh container IS the image's exact state; all graders of an image must agree.
            pristine = self._pristine.setdefault(image, g.pristine_state)
        if g.pristine_state != pristine:
            g.close()
            raise GraderLost(f"fresh grader of {image} differs from the image's recorded state")
        return g

    def reset(self, g: GraderSandbox, image: str) -> bool:
        """Return g to the image's exact state; True iff its content hashes match pristine.

        The runner (root, CAP_KILL) stops and kills every agent process, wipes /workspace, /tmp,
        $HOME and /dev/shm as agent, re-extracts the workspace it recorded at start and hashes
        all four again; anything it cannot remove makes the hashes differ.
        """
        reply = g.request({"cmd": "reset"}, timeout=90)
        return bool(reply.get("ok")) and reply.get("state") == self._pristine[image]

    def _recycle(self, g: GraderSandbox, image: str) -> None:
        try:
            ok = self.reset(g, image)
        except Exception:
            ok = False
        with self._lock:
            self.stats["reset_ok" if ok else "reset_failed"] += 1
            keep = ok and len(self._idle[image]) + self._active[image] <= self.graders_per_image
            if keep:
                self._idle[image].append(g)
            self._active[image] -= 1
            self._returned.notify_all()
        if not keep:
            g.close()
        self._sem.release()

    def close(self) -> None:
        """Refuse new gradings, let pending resets finish (and count), remove every grader."""
        self._closed = True
        self._resetter.shutdown(wait=True)
        with self._lock:
            idle = [g for gs in self._idle.values() for g in gs]
            self._idle.clear()
        for g in idle:
            g.close()

    def __enter__(self) -> GraderPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
