"""Engine helpers: the base-image tag rule shared with the build script, and the clear error
when no engine answers."""

from __future__ import annotations

import subprocess

import pytest

from envs import engine


def test_tag_rule_matches_build_script():
    out = subprocess.run(["bash", str(engine.BUILD_SCRIPT), "--print-tag"], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == engine.base_image_tag()
    assert out.startswith("flashpost/sandbox-base:") and len(out.split(":")[1]) == 12


def test_missing_engine_gives_actionable_error(monkeypatch, tmp_path):
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-such.sock")
    engine.client.cache_clear()
    try:
        assert not engine.engine_available()
        with pytest.raises(engine.EngineUnavailable, match="ensure_engine.sh"):
            engine.client()
    finally:
        engine.client.cache_clear()


@pytest.mark.docker
def test_base_image_is_built_and_hardened(engine_ready):
    assert engine_ready == engine.base_image_tag() and engine.image_exists(engine_ready)
    cfg = engine.client().images.get(engine_ready).attrs["Config"]
    assert cfg["User"] == "agent" and cfg["WorkingDir"] == "/workspace"
    # A second build run is a cache hit and fast.
    proc = subprocess.run(["bash", str(engine.BUILD_SCRIPT)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0 and "cached" in proc.stderr and proc.stdout.strip() == engine_ready


@pytest.mark.docker
def test_ensure_engine_is_idempotent(engine_ready):
    proc = subprocess.run(["bash", str(engine.ENSURE_SCRIPT)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0 and "already running" in proc.stderr
    assert subprocess.run(["ip", "link", "show", "docker0"], capture_output=True).returncode != 0


# ------------------------------------------------- paused-state races (fake API, no engine)


class _FakeAPI:
    """Just enough of docker's APIClient for exec_create/_unpause/wait_until_running: `states`
    is the sequence of inspect answers (the last repeats), `conflicts` how many calls fail 409."""

    def __init__(self, states, *, create_conflicts=0, unpause_conflicts=0):
        self.states = list(states)
        self.create_conflicts = create_conflicts
        self.unpause_conflicts = unpause_conflicts
        self.calls: list[str] = []

    @staticmethod
    def _conflict(msg):
        import docker.errors
        import requests

        resp = requests.Response()
        resp.status_code = 409
        return docker.errors.APIError("409 Conflict", response=resp, explanation=msg)

    def inspect_container(self, cid):
        self.calls.append("inspect")
        return {"State": self.states.pop(0) if len(self.states) > 1 else self.states[0]}

    def exec_create(self, cid, argv, **kw):
        self.calls.append("exec_create")
        if self.create_conflicts:
            self.create_conflicts -= 1
            raise self._conflict(f"Container {cid} is paused, unpause the container before exec")
        return {"Id": "exec1"}

    def unpause(self, cid):
        self.calls.append("unpause")
        if self.unpause_conflicts:
            self.unpause_conflicts -= 1
            raise self._conflict(f"Container {cid} is not paused")


RUNNING = {"Status": "running", "Running": True, "Paused": False}
PAUSED = {"Status": "paused", "Running": True, "Paused": True}
OOM = {"Status": "exited", "Running": False, "Paused": False, "ExitCode": 137, "OOMKilled": True,
       "Error": "", "FinishedAt": "2026-01-01T00:00:00Z"}


@pytest.fixture
def fake_api(monkeypatch):
    def install(api):
        monkeypatch.setattr(engine, "client", lambda: type("C", (), {"api": api})())
        return api
    return install


def test_exec_create_waits_out_a_stale_paused_state(fake_api):
    # The engine re-applies a late "paused" event after an unpause: exec_create gets 409 once.
    api = fake_api(_FakeAPI([PAUSED, PAUSED, RUNNING], create_conflicts=1))
    assert engine.exec_create("c" * 64, ["true"], user="agent", workdir="/", env={}) == "exec1"
    assert api.calls.count("exec_create") == 2 and api.calls.count("inspect") == 3


def test_exec_create_names_why_the_container_died(fake_api):
    fake_api(_FakeAPI([OOM], create_conflicts=1))
    with pytest.raises(engine.ContainerGone, match=r"exit code 137, OOMKilled=True"):
        engine.exec_create("c" * 64, ["true"], user="agent", workdir="/", env={})


def test_exec_create_gives_up_on_a_container_that_stays_paused(fake_api, monkeypatch):
    monkeypatch.setattr(engine, "PAUSED_WAIT_S", 0.2)
    fake_api(_FakeAPI([PAUSED], create_conflicts=10**6))
    with pytest.raises(TimeoutError, match="still 'paused'"):
        engine.exec_create("c" * 64, ["true"], user="agent", workdir="/", env={})


def test_unpause_retries_while_a_late_resume_event_hides_the_pause(fake_api):
    # Our pause froze it, then a late "resumed" event of an earlier cycle cleared the engine's
    # flag: unpause says "not paused" until our own "paused" event lands; then it must unpause.
    api = fake_api(_FakeAPI([RUNNING, PAUSED], unpause_conflicts=2))
    engine._unpause("c" * 64)
    assert api.calls.count("unpause") == 3


def test_sandbox_exec_reruns_an_exec_whose_start_was_refused_as_paused(monkeypatch):
    from envs.sandbox import ExecResult, Sandbox

    sb = Sandbox(image="unused")
    sb._id = "c" * 64
    refused = ExecResult(exit_code=None, output=f"Container {sb._id} is paused, unpause the container "
                         "before exec\r\n", timed_out=False, truncated=False, duration_s=0.0)
    ok = ExecResult(exit_code=0, output="alive\n", timed_out=False, truncated=False, duration_s=0.0)
    results = [refused, ok]
    monkeypatch.setattr(sb, "_exec_once", lambda *a, **k: (results.pop(0), "exec1"))
    monkeypatch.setattr(engine, "exec_never_started", lambda exec_id: True)
    waited = []
    monkeypatch.setattr(engine, "wait_until_running", lambda cid, timeout: waited.append(timeout))
    assert sb.exec("echo alive", timeout=5) == ok and len(waited) == 1
