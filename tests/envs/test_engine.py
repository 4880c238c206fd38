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
