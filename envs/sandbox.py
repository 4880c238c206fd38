"""Sandbox: one hardened, disposable container with timed, output-capped exec and file I/O.

The defaults ARE the hardened profile: no network, non-root `agent` user for execs, all
capabilities dropped, no-new-privileges, memory == memory+swap cap, pids and CPU caps, read-only
root with size-capped tmpfs volumes at the workspace, /tmp and $HOME, leak-reaping labels.
It does not decide what runs inside (agent tools, grading), nor pool or reuse containers.
"""

from __future__ import annotations

import contextlib
import io
import tarfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from envs import engine

AGENT_USER = "agent"
AGENT_UID = 1000
FLOOD_BYTES = 32 * 1024 * 1024  # past this much output an exec is killed as a flood
# Host-side guard fires this long after the in-container timeout. (The engine itself closes an
# exec's stream ~2 s after its main process exits, even if background children hold the pipe.)
GUARD_GRACE_S = 3.0


@dataclass(frozen=True, kw_only=True)
class SandboxLimits:
    memory: str = "512m"  # also the memory+swap cap: no swap
    pids: int = 128
    cpus: float = 1.0
    workspace_size: str = "256m"  # the disk quota for the agent's writes
    tmp_size: str = "64m"
    home_size: str = "16m"
    lifetime_s: float = 3600.0  # written as the deadline label; reapers remove it after that


@dataclass(frozen=True)
class ExecResult:
    exit_code: int | None  # None when the command timed out (or the exec was lost)
    output: str  # stdout and stderr interleaved, head+tail truncated to max_output_bytes
    timed_out: bool
    truncated: bool
    duration_s: float


class _CappedBuffer:
    """Keeps the first and last `cap/2` bytes of a stream and counts the rest."""

    def __init__(self, cap: int):
        self.half = max(cap // 2, 1)
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def add(self, chunk: bytes) -> None:
        self.total += len(chunk)
        room = self.half - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        if chunk:
            self.tail += chunk
            if len(self.tail) > self.half:
                del self.tail[: len(self.tail) - self.half]

    def text(self) -> tuple[str, bool]:
        dropped = self.total - len(self.head) - len(self.tail)
        if dropped <= 0:
            return (bytes(self.head) + bytes(self.tail)).decode("utf-8", "replace"), False
        marker = f"\n[... {dropped} bytes of output truncated ...]\n".encode()
        return (bytes(self.head) + marker + bytes(self.tail)).decode("utf-8", "replace"), True


class Sandbox:
    """`with Sandbox(image) as sb: sb.exec("pytest -q", timeout=60)`; always removed on exit."""

    def __init__(self, image: str | None = None, *, limits: SandboxLimits = SandboxLimits(),
                 workdir: str = "/workspace", labels: dict[str, str] | None = None, role: str = "agent"):
        self.image = image or engine.ensure_base_image(build=False)
        self.limits = limits
        self.workdir = workdir
        self.labels = dict(labels or {})
        self.role = role
        self._id: str | None = None
        self._stdin_open = False

    # ------------------------------------------------------------------ lifecycle

    @property
    def container_id(self) -> str:
        if self._id is None:
            raise RuntimeError("sandbox is not started (use it as a context manager)")
        return self._id

    def _volumes(self) -> dict[str, str]:
        """Writable mounts (tmpfs-backed volumes) -> tmpfs options; subclasses may add more."""
        lim, agent = self.limits, f"uid={AGENT_UID},gid={AGENT_UID}"
        return {
            self.workdir: f"size={lim.workspace_size},{agent},mode=0755",
            "/tmp": f"size={lim.tmp_size},mode=1777",
            f"/home/{AGENT_USER}": f"size={lim.home_size},{agent},mode=0755",
        }

    def _cap_add(self) -> list[str]:
        return []

    def _command(self) -> list[str]:
        return ["sleep", "infinity"]

    def start(self) -> Sandbox:
        lim = self.limits
        spec = engine.ContainerSpec(
            image=self.image,
            # PID 1 is docker-init (reaps zombies); its child runs as uid 0 with no capabilities
            # so the agent (uid 1000) cannot signal it and take the sandbox down.
            command=self._command(), user="root", workdir=self.workdir, role=self.role,
            lifetime_s=lim.lifetime_s, mem_limit=lim.memory, pids_limit=lim.pids,
            nano_cpus=int(lim.cpus * 1e9), labels=self.labels, tmpfs_volumes=self._volumes(),
            cap_add=self._cap_add(), stdin_open=self._stdin_open,
        )
        self._id = engine.start_container(spec)
        try:
            snapshot = engine.image_dir_tar(self.image, self.workdir)
            if snapshot:
                engine.put_archive(self._id, self.workdir, snapshot)
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        if self._id is not None:
            engine.remove_container(self._id)
            self._id = None

    def __enter__(self) -> Sandbox:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # ----------------------------------------------------------------------- exec

    def exec(self, cmd: str | list[str], *, timeout: float, workdir: str | None = None,
             env: dict[str, str] | None = None, user: str | None = None,
             max_output_bytes: int = 64_000) -> ExecResult:
        """Run `cmd` (a string goes to `bash -c`; stdout and stderr interleaved), at most `timeout` s.

        The command runs under `timeout -s KILL` inside the container; a host-side guard kills
        every process carrying this exec's marker variable (escaped background jobs too) if the
        output stream is still open GUARD_GRACE_S after the deadline.
        """
        if timeout <= 0:
            raise ValueError("timeout must be positive")
        argv = ["bash", "-c", cmd + "\n", "bash"] if isinstance(cmd, str) else list(cmd)
        wrapped = ["timeout", "-s", "KILL", f"{timeout:.3f}s", *argv]
        run_user = user or AGENT_USER
        refused_until = time.monotonic() + engine.PAUSED_WAIT_S
        while True:
            result, exec_id = self._exec_once(wrapped, timeout=timeout, workdir=workdir, env=env,
                                              user=run_user, max_output_bytes=max_output_bytes)
            # exec_create/exec_stream wait out a 409 "paused", but the engine checks once more
            # after it has answered 200 to the start, so a refusal can also come back as the
            # stream's only text, with no process and no exit code. A container that stopped
            # raises ContainerGone saying why; one that only looked paused (see
            # engine.kill_processes) gets the exec again.
            if result.exit_code is not None or result.timed_out or not engine.exec_never_started(exec_id):
                return result
            engine.wait_until_running(self.container_id, timeout=max(refused_until - time.monotonic(), 0.0))
            if "paused" not in result.output or time.monotonic() >= refused_until:
                return result

    def _exec_once(self, wrapped: list[str], *, timeout: float, workdir: str | None,
                   env: dict[str, str] | None, user: str, max_output_bytes: int) -> tuple[ExecResult, str]:
        marker = uuid.uuid4().hex
        full_env = {**(env or {}), "FLASHPOST_EXEC": marker}
        t0 = time.monotonic()
        exec_id = engine.exec_create(self.container_id, wrapped, user=user,
                                     workdir=workdir or self.workdir, env=full_env)
        buf = _CappedBuffer(max_output_bytes)
        flooded = threading.Event()
        gone: list[engine.ContainerGone] = []

        def pump() -> None:
            try:
                for chunk in engine.exec_stream(exec_id, self.container_id):
                    buf.add(chunk)
                    if buf.total > FLOOD_BYTES and not flooded.is_set():
                        flooded.set()
                        self._kill_marked(marker)
            except engine.ContainerGone as e:  # it could not even start: say why
                gone.append(e)
            except Exception:  # stream torn down (container removed): keep what we have
                pass

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        reader.join(timeout + GUARD_GRACE_S)
        guard_fired = reader.is_alive()
        if guard_fired:
            self._kill_marked(marker)
            reader.join(GUARD_GRACE_S)
        if gone:
            raise gone[0]
        duration = time.monotonic() - t0
        exit_code = None if reader.is_alive() else engine.exec_exit_code(exec_id)
        timed_out = guard_fired or (exit_code == 137 and duration >= timeout * 0.98 and not flooded.is_set())
        if timed_out and not guard_fired:
            self._kill_marked(marker)  # children that escaped the process group (setsid)
        output, truncated = buf.text()
        if flooded.is_set():
            output += f"\n[killed: more than {FLOOD_BYTES} bytes of output]\n"
        return ExecResult(exit_code=None if timed_out else exit_code, output=output,
                          timed_out=timed_out, truncated=truncated or flooded.is_set(),
                          duration_s=duration), exec_id

    def _kill_marked(self, marker: str) -> None:
        # Best effort: if the container itself is gone there is nothing left to kill.
        with contextlib.suppress(Exception):
            engine.kill_processes(self.container_id, env_marker=f"FLASHPOST_EXEC={marker}")

    def kill_all(self) -> int:
        """SIGKILL every agent process (background jobs, a fork bomb); the sandbox stays usable."""
        return engine.kill_processes(self.container_id)

    # ----------------------------------------------------------------------- files

    def _abs(self, path: str) -> PurePosixPath:
        p = PurePosixPath(path)
        return p if p.is_absolute() else PurePosixPath(self.workdir) / p

    def write_file(self, path: str, content: str | bytes) -> None:
        """Write a file owned by the agent (parents created); only writable mounts accept it."""
        p = self._abs(path)
        data = content.encode() if isinstance(content, str) else content
        archive = engine.tar_files({p.name: data}, uid=AGENT_UID, gid=AGENT_UID)
        try:
            engine.put_archive(self.container_id, str(p.parent), archive)
        except engine.PathNotFound:
            self.exec(["mkdir", "-p", str(p.parent)], timeout=10)
            engine.put_archive(self.container_id, str(p.parent), archive)

    def read_file(self, path: str) -> bytes:
        data = engine.get_archive(self.container_id, str(self._abs(path)))
        with tarfile.open(fileobj=io.BytesIO(data)) as tf:
            member = tf.next()
            if member is None or not member.isfile():
                raise IsADirectoryError(path)
            f = tf.extractfile(member)
            assert f is not None
            return f.read()

    def put_tree(self, local_dir: str | Path, dest: str) -> None:
        """Copy local_dir's contents into dest (created by `mkdir -p` as the agent if absent)."""
        dest_p = self._abs(dest)
        self.exec(["mkdir", "-p", str(dest_p)], timeout=10)
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tf:
            def owned(ti: tarfile.TarInfo) -> tarfile.TarInfo:
                ti.uid = ti.gid = AGENT_UID
                ti.uname = ti.gname = AGENT_USER
                return ti
            for child in sorted(Path(local_dir).iterdir()):
                tf.add(child, arcname=child.name, filter=owned)
        engine.put_archive(self.container_id, str(dest_p), buf.getvalue())

    def get_tree(self, src: str) -> bytes:
        """Tar of `src` as the engine returns it (top-level member named after src's basename)."""
        return engine.get_archive(self.container_id, str(self._abs(src)))
