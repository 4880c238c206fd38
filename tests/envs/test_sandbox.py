"""Sandbox against a real engine: exec semantics, the hardened profile, limits under attack."""

from __future__ import annotations

import io
import socket
import tarfile
import threading
import time

import pytest

from envs import engine
from envs.sandbox import Sandbox, SandboxLimits

pytestmark = [pytest.mark.docker, pytest.mark.usefixtures("engine_ready")]


def test_exec_returns_output_and_exit_code():
    with Sandbox() as sb:
        r = sb.exec("echo out; echo err >&2; exit 3", timeout=10)
        assert r.exit_code == 3 and not r.timed_out and not r.truncated
        assert "out" in r.output and "err" in r.output
        r = sb.exec(["python3", "-c", "import os; print(os.getuid(), os.getcwd())"], timeout=10)
        assert r.exit_code == 0 and r.output.split() == ["1000", "/workspace"]
        r = sb.exec("pwd; echo $FOO", timeout=10, workdir="/tmp", env={"FOO": "bar"})
        assert r.output.split() == ["/tmp", "bar"]


def test_hardened_profile():
    with Sandbox() as sb:
        status = sb.exec("grep -E '^(CapEff|CapBnd|NoNewPrivs)' /proc/self/status", timeout=10).output
        fields = dict(line.split(":\t") for line in status.strip().splitlines())
        assert int(fields["CapEff"], 16) == 0 and int(fields["CapBnd"], 16) == 0
        assert fields["NoNewPrivs"].strip() == "1"
        # Even exec as root has no capabilities: it cannot write the agent's files or the image.
        r = sb.exec("touch /workspace/x && chmod 600 /workspace/x", timeout=10)
        assert r.exit_code == 0
        r = sb.exec("cat /workspace/x", timeout=10, user="root")
        assert r.exit_code != 0 and "Permission denied" in r.output
        info = engine.client().api.inspect_container(sb.container_id)["HostConfig"]
        assert info["NetworkMode"] == "none" and info["ReadonlyRootfs"] is True
        assert info["Memory"] == info["MemorySwap"] == 512 * 2**20
        assert info["PidsLimit"] == 128 and info["NanoCpus"] == 10**9


def test_no_network_inside():
    host_srv = socket.socket()
    host_srv.bind(("127.0.0.1", 0))
    host_srv.listen()
    port = host_srv.getsockname()[1]
    probe = f"""
import os, socket
print("ifaces", sorted(os.listdir("/sys/class/net")))
for addr in [("127.0.0.1", {port}), ("10.0.0.1", 80), ("8.8.8.8", 53)]:
    s = socket.socket(); s.settimeout(2)
    try:
        s.connect(addr); print("CONNECTED", addr)
    except OSError as e:
        print("failed", addr, type(e).__name__)
try:
    socket.getaddrinfo("deb.debian.org", 80); print("RESOLVED")
except OSError:
    print("no dns")
"""
    try:
        with Sandbox() as sb:
            r = sb.exec(["python3", "-c", probe], timeout=20)
    finally:
        host_srv.close()
    assert r.exit_code == 0, r.output
    assert "ifaces ['lo']" in r.output
    assert "CONNECTED" not in r.output and "RESOLVED" not in r.output
    assert r.output.count("failed") == 3


def test_timeout_kills_the_process_quickly():
    with Sandbox() as sb:
        t0 = time.monotonic()
        r = sb.exec("echo started; sleep 60; echo never", timeout=1.5)
        elapsed = time.monotonic() - t0
        assert r.timed_out and r.exit_code is None
        assert "started" in r.output and "never" not in r.output
        assert elapsed < 10  # 1.5 s timeout + at most the 3 s guard, with slack for a loaded host
        # Children that escaped the process group are gone too.
        r = sb.exec("setsid sleep 300 >/dev/null 2>&1 </dev/null & sleep 300", timeout=1)
        assert r.timed_out
        assert "sleep 300" not in sb.exec("ps -eo args", timeout=10).output
        assert sb.exec("echo alive", timeout=10).output == "alive\n"


def test_output_is_capped_head_and_tail():
    with Sandbox() as sb:
        r = sb.exec("echo FIRST; head -c 1000000 /dev/zero | tr '\\0' x; echo; echo LAST", timeout=20,
                    max_output_bytes=1000)
        assert r.exit_code == 0 and r.truncated
        assert r.output.startswith("FIRST") and r.output.rstrip().endswith("LAST")
        assert len(r.output) < 1200 and "truncated" in r.output


def test_writes_outside_workspace_fail_and_quota_holds():
    with Sandbox(limits=SandboxLimits(workspace_size="32m")) as sb:
        for path in ["/usr/evil", "/etc/evil", "/evil", "/home/evil"]:
            r = sb.exec(f"echo x > {path}", timeout=10)
            assert r.exit_code != 0, path
        r = sb.exec("echo ok > /workspace/f && echo ok > /tmp/f && echo ok > ~/f", timeout=10)
        assert r.exit_code == 0, r.output
        r = sb.exec("dd if=/dev/zero of=/workspace/fill bs=1M count=100", timeout=30)
        assert r.exit_code != 0 and "No space left" in r.output
        size = int(sb.exec("stat -c %s /workspace/fill", timeout=10).output)
        assert size <= 32 * 2**20
        assert sb.exec("echo alive", timeout=10).exit_code == 0


def _responsive_while(attack: str, limits: SandboxLimits, timeout: float, watch_s: float = 0.0):
    """Run `attack` in one sandbox while timing execs in another; returns (attack result,
    slowest bystander round trip, most processes seen in the victim). After the attack (and
    `watch_s` more seconds) the victim is cleaned with kill_all() and must answer again."""
    with Sandbox(limits=limits) as victim, Sandbox() as bystander:
        result: dict = {}
        t = threading.Thread(target=lambda: result.setdefault("r", victim.exec(attack, timeout=timeout)))
        t.start()
        rtts, n_procs = [], []
        time.sleep(0.5)
        deadline = time.monotonic() + watch_s
        while t.is_alive() or time.monotonic() < deadline:
            t0 = time.monotonic()
            r = bystander.exec("echo pong", timeout=10)
            assert r.exit_code == 0 and r.output == "pong\n"
            rtts.append(time.monotonic() - t0)
            n_procs.append(len(engine.client().api.top(victim.container_id)["Processes"]))
            time.sleep(0.2)
        t.join()
        victim.kill_all()
        assert victim.exec("echo alive", timeout=10).output == "alive\n"
        return result["r"], max(rtts, default=0.0), max(n_procs, default=0)


def test_fork_bomb_is_contained():
    # The bomb's first shell returns at once; its descendants keep forking in the background.
    r, max_rtt, max_procs = _responsive_while(":(){ :|:& };:", SandboxLimits(pids=64), timeout=10,
                                              watch_s=3.0)
    assert "Resource temporarily unavailable" in r.output  # fork failed: the pids cap bit
    assert max_procs <= 64
    assert max_rtt < 8.0, f"bystander sandbox stalled {max_rtt:.1f}s during the fork bomb"


def test_memory_hog_is_killed():
    hog = "python3 -c 'a = []\nwhile True: a.append(bytearray(32 * 2**20))'"
    r, max_rtt, _ = _responsive_while(hog, SandboxLimits(memory="256m"), timeout=30)
    assert not r.timed_out and r.exit_code == 137, r  # SIGKILL from the cgroup OOM killer
    assert max_rtt < 8.0


def test_files_in_and_out(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text("VALUE = 42\n")
    (tmp_path / "top.txt").write_text("top\n")
    with Sandbox() as sb:
        sb.write_file("notes/a.txt", "hello")
        assert sb.read_file("/workspace/notes/a.txt") == b"hello"
        sb.write_file("/tmp/b.bin", b"\x00\x01")
        assert sb.read_file("/tmp/b.bin") == b"\x00\x01"
        sb.put_tree(tmp_path, "/workspace/proj")
        r = sb.exec("cd proj && python3 -c 'import pkg.mod; print(pkg.mod.VALUE)' && stat -c %U top.txt",
                    timeout=10)
        assert r.output.split() == ["42", "agent"]
        with tarfile.open(fileobj=io.BytesIO(sb.get_tree("/workspace/proj"))) as tf:
            names = set(tf.getnames())
        assert {"proj/top.txt", "proj/pkg/mod.py"} <= names
        with pytest.raises(engine.PathNotFound):
            sb.read_file("/workspace/missing")
        with pytest.raises(PermissionError):
            sb.write_file("/etc/evil", "x")


def test_teardown_removes_container_even_on_error():
    cid = None
    with pytest.raises(RuntimeError, match="boom"):
        with Sandbox() as sb:
            cid = sb.container_id
            assert engine.container_running(cid)
            raise RuntimeError("boom")
    assert cid is not None and not engine.container_running(cid)
    assert not engine.list_containers({"flashpost.test": None, engine.LABEL_OWNER: engine.owner_id()})


def test_reap_removes_only_stale_containers():
    fresh = Sandbox(labels={"flashpost.test": "reap"}).start()
    stale = Sandbox(labels={"flashpost.test": "reap"}, limits=SandboxLimits(lifetime_s=-1)).start()
    try:
        removed = engine.reap_containers({"flashpost.test": "reap"}, only_stale=True)
        assert removed == [stale.container_id]
        assert engine.container_running(fresh.container_id)
    finally:
        fresh.close()
        stale.close()
