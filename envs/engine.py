"""The one module that talks to the Docker engine (docker SDK v7): client, images, containers.

Everything else in `envs/` goes through these functions with plain ids and bytes, so engine
quirks (read-only rootfs vs. put_archive, exec exit codes, leak reaping) live in one place.
It does not start the engine or build the base image (see `infra/docker/*.sh`), and it knows
nothing about tasks, grading or the hardened container profile (that is `envs/sandbox.py`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import os
import signal
import socket
import subprocess
import tarfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import docker
import docker.errors
import requests.exceptions
from docker.types import DriverConfig, Mount

REPO_ROOT = Path(__file__).resolve().parent.parent
RECIPE_PATH = REPO_ROOT / "infra" / "docker" / "base_image.recipe"
BUILD_SCRIPT = REPO_ROOT / "infra" / "docker" / "build_base_image.sh"
ENSURE_SCRIPT = REPO_ROOT / "infra" / "docker" / "ensure_engine.sh"
BASE_IMAGE_REPO = "flashpost/sandbox-base"

# Labels on every container we create. OWNER says which process made it ("host:pid"),
# DEADLINE is a unix time after which any reaper may remove it, ROLE is "agent" or "grader".
LABEL_OWNER = "flashpost.owner"
LABEL_DEADLINE = "flashpost.deadline"
LABEL_ROLE = "flashpost.role"


class EngineUnavailable(RuntimeError):
    """No Docker engine answers (or the base image is missing and cannot be built)."""


class PathNotFound(FileNotFoundError):
    """A path given to put_archive/get_archive does not exist in the container."""


class ContainerGone(RuntimeError):
    """The container is no longer running (its init exited, was OOM-killed, or it was removed);
    the message says why (status, exit code, OOMKilled, the engine's error)."""


def owner_id() -> str:
    """This process's owner label value; reapers use it to spot containers of dead owners."""
    return f"{socket.gethostname()}:{os.getpid()}"


@functools.cache
def client() -> docker.DockerClient:
    try:
        c = docker.from_env(timeout=120, max_pool_size=64)
        c.ping()
    except Exception as e:  # the SDK raises several types for "no socket"/"refused"
        raise EngineUnavailable(
            f"no Docker engine answers ({e}). Start one with `bash {ENSURE_SCRIPT.relative_to(REPO_ROOT)}` "
            "(root on Debian; it runs dockerd with no bridge and no iptables) or run `make test`, "
            "which does it for you."
        ) from e
    return c


def engine_available() -> bool:
    try:
        client()
    except EngineUnavailable:
        client.cache_clear()
        return False
    return True


# ---------------------------------------------------------------------------------- images


def base_image_tag() -> str:
    """flashpost/sandbox-base:<sha256(recipe)[:12]>: the same rule as build_base_image.sh."""
    digest = hashlib.sha256(RECIPE_PATH.read_bytes()).hexdigest()[:12]
    return f"{BASE_IMAGE_REPO}:{digest}"


def image_exists(ref: str) -> bool:
    try:
        client().images.get(ref)
    except docker.errors.ImageNotFound:
        return False
    return True


def image_id(ref: str) -> str:
    """The image's content id ("sha256:..."), the digest we pin tasks to (no registry digests)."""
    return client().images.get(ref).id


def ensure_base_image(*, build: bool = True) -> str:
    """Return the base image tag, building it with the script if it is missing and `build`."""
    tag = base_image_tag()
    if image_exists(tag):
        return tag
    if not build:
        raise EngineUnavailable(f"base image {tag} missing: run `bash {BUILD_SCRIPT.relative_to(REPO_ROOT)}`")
    proc = subprocess.run(["bash", str(BUILD_SCRIPT)], capture_output=True, text=True)
    if proc.returncode != 0 or not image_exists(tag):
        raise EngineUnavailable(f"building {tag} failed:\n{proc.stderr[-3000:]}")
    return tag


_workspace_tars: dict[tuple[str, str], bytes] = {}
_workspace_lock = threading.Lock()


def image_dir_tar(ref: str, path: str = "/workspace") -> bytes:
    """Tar of the image's `path` contents (members relative to it), cached per image id.

    Sandboxes mount a size-capped tmpfs over the workspace, which hides the image's files, so
    they are copied in from this snapshot; it is also the "exact image state" graders reset to.
    """
    key = (image_id(ref), path)
    with _workspace_lock:
        if key in _workspace_tars:
            return _workspace_tars[key]
    c = client().containers.create(ref, ["true"], network_disabled=True, labels=_labels("snapshot", 60))
    try:
        stream, _ = c.get_archive(path.rstrip("/") + "/.")
        data = b"".join(stream)
    finally:
        c.remove(force=True, v=True)
    with _workspace_lock:
        _workspace_tars[key] = data
    return data


def build_image(base: str, *, files: bytes, dest: str, script: str, env: dict[str, str],
                repository: str, tag: str, labels: dict[str, str], timeout_s: float = 300,
                user: str | None = None) -> str:
    """Layer a new image on `base` without a registry or Dockerfile: extract the `files` tar at
    `dest` of a network-less container, run `script` (bash, as `user`, by default the image's
    user) there, and commit the result as repository:tag with the base's user/workdir and
    `sleep infinity`.
    Returns the new image id; raises RuntimeError with the script's output if it fails.
    """
    cfg = client().images.get(base).attrs["Config"]
    c = client().containers.create(base, ["bash", "-euc", script], working_dir=dest, network_mode="none",
                                   environment=env, labels=_labels("build", timeout_s),
                                   **({"user": user} if user else {}))
    try:
        put_archive(c.id, dest, files)
        c.start()
        code = c.wait(timeout=timeout_s)["StatusCode"]
        if code != 0:
            logs = c.logs().decode(errors="replace")[-3000:]
            raise RuntimeError(f"image build script failed ({code}):\n{logs}")
        changes = [f"USER {cfg['User'] or 'root'}", f"WORKDIR {cfg['WorkingDir'] or '/'}",
                   'CMD ["sleep", "infinity"]', *(f"LABEL {k}={v}" for k, v in labels.items())]
        return c.commit(repository=repository, tag=tag, changes=changes).id
    finally:
        c.remove(force=True, v=True)


def image_labels(ref: str) -> dict[str, str]:
    try:
        return client().images.get(ref).attrs["Config"].get("Labels") or {}
    except docker.errors.ImageNotFound:
        return {}


# ------------------------------------------------------------------------------ containers


@dataclass(frozen=True, kw_only=True)
class ContainerSpec:
    """Everything create() passes to the engine; the hardened values are chosen by Sandbox."""

    image: str
    command: list[str]
    user: str
    workdir: str
    role: str
    lifetime_s: float
    mem_limit: str
    pids_limit: int
    nano_cpus: int
    tmpfs_volumes: dict[str, str]  # mount point -> tmpfs options ("size=..,uid=..,mode=..")
    cap_add: list[str] = field(default_factory=list)
    shm_size: str = "16m"
    stdin_open: bool = False  # keep the main process's stdin open for attach()
    labels: dict[str, str] = field(default_factory=dict)
    environment: dict[str, str] = field(default_factory=dict)


def _labels(role: str, lifetime_s: float, extra: dict[str, str] | None = None) -> dict[str, str]:
    labels = {LABEL_OWNER: owner_id(), LABEL_DEADLINE: str(int(time.time() + lifetime_s)), LABEL_ROLE: role}
    labels.update(extra or {})
    return labels


def start_container(spec: ContainerSpec) -> str:
    """Create and start a hardened container; returns its id. Removes it if starting fails.

    Writable places are anonymous tmpfs-backed volumes (not HostConfig.Tmpfs): they have a
    size cap, vanish with the container, and, unlike plain tmpfs mounts on a read-only root,
    accept put_archive.
    """
    mounts = [
        Mount(target=path, source=None, type="volume",
              driver_config=DriverConfig("local", {"type": "tmpfs", "device": "tmpfs", "o": opts}))
        for path, opts in spec.tmpfs_volumes.items()
    ]
    c = client().containers.create(
        spec.image, spec.command, user=spec.user, working_dir=spec.workdir,
        network_mode="none", cap_drop=["ALL"], cap_add=spec.cap_add or None,
        security_opt=["no-new-privileges"], shm_size=spec.shm_size, stdin_open=spec.stdin_open,
        mem_limit=spec.mem_limit, memswap_limit=spec.mem_limit, pids_limit=spec.pids_limit,
        nano_cpus=spec.nano_cpus, read_only=True, init=True, mounts=mounts,
        environment=spec.environment, labels=_labels(spec.role, spec.lifetime_s, spec.labels),
    )
    try:
        c.start()
    except BaseException:
        c.remove(force=True, v=True)
        raise
    return c.id


def remove_container(container_id: str) -> None:
    """Force-remove a container and its volumes; one already gone is fine.

    Raises EngineUnavailable when the engine does not answer within the client's timeout (a stalled
    engine). The container keeps its owner and deadline labels, so a later reaper removes it.
    """
    try:
        client().api.remove_container(container_id, force=True, v=True)
    except docker.errors.NotFound:
        pass
    except requests.exceptions.RequestException as e:  # ReadTimeout, ConnectionError: no answer, not a refusal
        raise EngineUnavailable(
            f"the Docker engine did not remove container {container_id[:12]} ({type(e).__name__}: {e}); "
            f"the next sandbox pool reaps it once its deadline passes, or run `docker rm -f {container_id[:12]}` "
            "when the engine answers again (`timeout 15 docker ps` checks; restart it with "
            f"`bash {ENSURE_SCRIPT.relative_to(REPO_ROOT)}` if it does not)"
        ) from e


def container_running(container_id: str) -> bool:
    try:
        return client().api.inspect_container(container_id)["State"]["Running"]
    except docker.errors.NotFound:
        return False


# How long an exec (or kill_processes) waits for a container the engine reports as paused.
PAUSED_WAIT_S = 10.0


def _state(container_id: str) -> dict:
    try:
        return client().api.inspect_container(container_id)["State"]
    except docker.errors.NotFound as e:
        raise ContainerGone(f"container {container_id[:12]} no longer exists (removed)") from e


def _not_running_reason(container_id: str, state: dict) -> str:
    why = (f"container {container_id[:12]} is not running: status {state.get('Status')!r}, "
           f"exit code {state.get('ExitCode')}, OOMKilled={state.get('OOMKilled')}")
    if state.get("Error"):
        why += f", error {state['Error']!r}"
    return why + f", finished at {state.get('FinishedAt')}"


def container_state_reason(container_id: str) -> str:
    """Why a container's main process stopped answering, in the engine's words (running or not,
    exit code, OOMKilled); ContainerGone if it no longer exists."""
    deadline = time.monotonic() + 3.0  # the engine notices the stop a moment after the output closes
    state = _state(container_id)
    while state.get("Running") and time.monotonic() < deadline:
        time.sleep(0.05)
        state = _state(container_id)
    if state.get("Running") and not state.get("OOMKilled"):
        return f"container {container_id[:12]} is still running but its main process closed its output"
    return _not_running_reason(container_id, state)


def wait_until_running(container_id: str, timeout: float = PAUSED_WAIT_S) -> None:
    """Return once the engine reports the container running and not paused.

    Raises ContainerGone (saying why: exit code, OOMKilled, ...) if it stopped, TimeoutError if
    it is still paused after `timeout` s. Note the engine's Paused flag can flip back to true for
    a moment after an unpause has returned (see kill_processes), so callers that need the
    container unpaused for an API call retry on 409 as well (_retry_while_paused).
    """
    deadline = time.monotonic() + timeout
    while True:
        state = _state(container_id)
        if not state.get("Running") or state.get("Dead"):  # Running stays true while paused
            raise ContainerGone(_not_running_reason(container_id, state))
        if not state.get("Paused") and not state.get("Restarting"):
            return
        if time.monotonic() >= deadline:
            raise TimeoutError(f"container {container_id[:12]} is still {state.get('Status')!r} "
                               f"after {timeout:.0f} s")
        time.sleep(0.02)


def _retry_while_paused(container_id: str, call):
    """`call()`, retried while the engine answers 409 Conflict because the container is paused
    (for at most PAUSED_WAIT_S); ContainerGone if the conflict is that it is not running."""
    deadline = time.monotonic() + PAUSED_WAIT_S
    while True:
        try:
            return call()
        except docker.errors.APIError as e:
            if e.status_code != 409:
                raise
            left = deadline - time.monotonic()
            if left <= 0:
                raise
            wait_until_running(container_id, timeout=left)
            time.sleep(0.01)


class Attached:
    """Line-oriented stdin/stdout of a container's main process (started with stdin_open).

    The engine multiplexes stdout/stderr on the attach socket in frames (8-byte header: stream
    type, 3 zero bytes, big-endian length); stderr is kept aside for diagnostics.
    """

    def __init__(self, container_id: str):
        self._io = client().api.attach_socket(container_id, params={"stdin": 1, "stdout": 1, "stderr": 1,
                                                                    "stream": 1})
        self._sock = self._io._sock
        self._stdout = bytearray()
        self.stderr = bytearray()

    def send_line(self, data: bytes) -> None:
        self._sock.sendall(data + b"\n")

    def _recv_exact(self, n: int, deadline: float) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no answer from the container in time")
            self._sock.settimeout(left)
            try:
                chunk = self._sock.recv(n - len(buf))
            except TimeoutError as e:
                raise TimeoutError("no answer from the container in time") from e
            if not chunk:
                raise EOFError(f"container closed its output; stderr: {bytes(self.stderr[-2000:])!r}")
            buf += chunk
        return bytes(buf)

    def recv_line(self, timeout: float) -> bytes:
        deadline = time.monotonic() + timeout
        while b"\n" not in self._stdout:
            header = self._recv_exact(8, deadline)
            payload = self._recv_exact(int.from_bytes(header[4:8], "big"), deadline)
            (self._stdout if header[0] == 1 else self.stderr).extend(payload)
        line, _, rest = bytes(self._stdout).partition(b"\n")
        self._stdout = bytearray(rest)
        return line

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._io.close()


def put_archive(container_id: str, path: str, data: bytes) -> None:
    """Extract a tar into `path`; only the tmpfs volumes accept it (the root is read-only)."""
    try:
        ok = client().api.put_archive(container_id, path, data)
    except docker.errors.NotFound as e:
        raise PathNotFound(f"{path} (in container {container_id[:12]})") from e
    except docker.errors.APIError as e:
        if "read-only" in str(e):
            raise PermissionError(f"{path} is on the read-only root (in container {container_id[:12]})") from e
        raise
    if not ok:
        raise RuntimeError(f"put_archive to {path} in {container_id[:12]} failed")


def get_archive(container_id: str, path: str) -> bytes:
    try:
        stream, _ = client().api.get_archive(container_id, path)
        return b"".join(stream)
    except docker.errors.NotFound as e:
        raise PathNotFound(f"{path} (in container {container_id[:12]})") from e


def exec_create(container_id: str, argv: list[str], *, user: str, workdir: str, env: dict[str, str]) -> str:
    """Create (not start) an exec. Waits out a paused container (up to PAUSED_WAIT_S; see
    kill_processes for why one can look paused right after an unpause); raises ContainerGone,
    with the reason, if the container is not running."""
    return _retry_while_paused(container_id, lambda: client().api.exec_create(
        container_id, argv, user=user, workdir=workdir, environment=env,
        stdout=True, stderr=True, stdin=False, tty=False))["Id"]


def exec_stream(exec_id: str, container_id: str | None = None) -> Iterator[bytes]:
    """Output chunks (stdout and stderr interleaved) until the exec's streams close. Given the
    container, a start refused with 409 because it is paused is retried like exec_create."""
    start = lambda: client().api.exec_start(exec_id, stream=True, demux=False)  # noqa: E731
    return start() if container_id is None else _retry_while_paused(container_id, start)


def exec_exit_code(exec_id: str) -> int | None:
    info = client().api.exec_inspect(exec_id)
    return None if info["Running"] else info["ExitCode"]


def exec_never_started(exec_id: str) -> bool:
    """True if the engine refused to start this exec (no process, no exit code). The refusal
    (e.g. "Container ... is paused, unpause the container before exec") is then the only text
    on its stream, since the engine has already answered 200 when it checks the container."""
    info = client().api.exec_inspect(exec_id)
    return not info["Running"] and info["ExitCode"] is None and not info.get("Pid")


def kill_processes(container_id: str, *, env_marker: str | None = None) -> int:
    """SIGKILL the container's non-root processes, or only those whose environment holds
    `env_marker` ("KEY=value"); returns how many. The init (docker-init + root `sleep`) stays.

    Host-side, so it works when every pid slot is taken (a fork bomb) and `docker exec` cannot
    start: the container is frozen (pause), its processes are listed by host PID and killed from
    here, then thawed. A fork storm can defeat the freezer; then targets are SIGSTOPped in rounds
    until none runs (a stopped process cannot fork) and only then killed. Needs the engine on
    this host (same PID namespace); otherwise falls back to an exec of `kill -9 -1` as agent.

    Returns only once the engine reports the container running and unpaused (ContainerGone,
    with the reason, if its init died). Even then the engine may still report it paused for a
    moment: it also applies the runtime's asynchronous "paused"/"resumed" events to its state,
    and under load the "paused" event of this pause can land after the unpause returned
    (events: pause, unpause, pause, unpause). exec_create (and Sandbox.exec, for a refused
    exec start) wait that out; _unpause handles the mirror case ("not paused" while frozen).
    """
    api = client().api
    init_pid = api.inspect_container(container_id)["State"]["Pid"]
    if not init_pid or not Path(f"/proc/{init_pid}/environ").exists():
        if env_marker is not None:
            return 0
        eid = exec_create(container_id, ["kill", "-9", "-1"], user="agent", workdir="/", env={})
        list(exec_stream(eid))
        return -1
    marker = env_marker.encode() if env_marker else None

    def targets() -> list[int]:
        found = []
        for row in api.top(container_id, ps_args="-eo pid,ppid,uid")["Processes"]:
            pid, ppid, uid = (int(x) for x in row[:3])
            if pid == init_pid or (ppid == init_pid and uid == 0) or (marker is None and uid == 0):
                continue
            try:
                if marker is None or marker in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                    found.append(pid)
            except OSError:
                pass
        return found

    def signal_all(pids: list[int], sig: int) -> None:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    try:
        api.pause(container_id)
        frozen = True
    except docker.errors.APIError:  # freezing failed (runc thaws again), or already paused
        frozen = False
    try:
        if frozen:
            victims = targets()
        else:
            victims, seen = [], set()
            for _ in range(200):
                fresh = [p for p in targets() if p not in seen]
                if not fresh:
                    break
                signal_all(fresh, signal.SIGSTOP)
                seen.update(fresh)
                victims += fresh
        signal_all(victims, signal.SIGKILL)
    finally:
        if frozen:
            _unpause(container_id)
    wait_until_running(container_id)
    return len(victims)


def _unpause(container_id: str) -> None:
    """Unpause a container this process paused. The engine answers 409 "not paused" when a late
    "resumed" event of an earlier pause/unpause was applied after our pause: the container is still
    frozen, and the engine marks it paused again once our own late "paused" event lands (such late
    events came 10-40 ms after the call in the fork-bomb runs), so retry while that may still
    happen; 1 s without it: done."""
    deadline = time.monotonic() + PAUSED_WAIT_S
    not_paused_since = None
    while True:
        try:
            client().api.unpause(container_id)
            return
        except docker.errors.NotFound:
            return  # removed meanwhile; the caller's wait_until_running says so
        except docker.errors.APIError as e:
            if e.status_code != 409:
                raise
            state = _state(container_id)
            if not state.get("Running"):
                return
            if not state.get("Paused"):
                now = time.monotonic()
                not_paused_since = not_paused_since or now
                if now - not_paused_since > 1.0:
                    return
            if time.monotonic() >= deadline:
                raise RuntimeError(f"could not unpause container {container_id[:12]} within "
                                   f"{PAUSED_WAIT_S:.0f} s: {e.explanation}") from e
            time.sleep(0.02)


def list_containers(labels: dict[str, str | None]) -> list[dict]:
    """Containers (running or not) matching all labels; a None value matches any value."""
    filters = {"label": [k if v is None else f"{k}={v}" for k, v in labels.items()]}
    return client().api.containers(all=True, filters=filters)


def reap_containers(label_selector: dict[str, str | None] | None = None, *,
                    only_stale: bool = False) -> list[str]:
    """Force-remove our containers matching `label_selector` (default: all flashpost ones).

    With only_stale, remove only those past their deadline label or whose owner process (on
    this host) is gone, so concurrent sessions sharing one engine do not reap each other.
    Returns the removed ids.
    """
    selector = {LABEL_OWNER: None, **(label_selector or {})}
    host, now, removed = socket.gethostname(), time.time(), []
    for info in list_containers(selector):
        labels = info.get("Labels") or {}
        if only_stale and not _is_stale(labels, host, now):
            continue
        remove_container(info["Id"])
        removed.append(info["Id"])
    return removed


def _is_stale(labels: dict[str, str], host: str, now: float) -> bool:
    try:
        if float(labels.get(LABEL_DEADLINE, "inf")) < now:
            return True
    except ValueError:
        return True
    owner_host, _, pid = labels.get(LABEL_OWNER, "").rpartition(":")
    if owner_host != host or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


# ------------------------------------------------------------------------------ tar helpers


def tar_files(files: dict[str, bytes], *, uid: int = 1000, gid: int = 1000, mode: int = 0o644) -> bytes:
    """A tar of {relative path: content}, owned by uid:gid, with parent directories."""
    buf = io.BytesIO()
    seen_dirs: set[str] = set()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for rel, content in files.items():
            parts = rel.strip("/").split("/")
            for i in range(1, len(parts)):
                d = "/".join(parts[:i])
                if d not in seen_dirs:
                    seen_dirs.add(d)
                    ti = tarfile.TarInfo(d)
                    ti.type, ti.mode, ti.uid, ti.gid, ti.mtime = tarfile.DIRTYPE, 0o755, uid, gid, time.time()
                    tf.addfile(ti)
            ti = tarfile.TarInfo("/".join(parts))
            ti.size, ti.mode, ti.uid, ti.gid, ti.mtime = len(content), mode, uid, gid, time.time()
            tf.addfile(ti, io.BytesIO(content))
    return buf.getvalue()
