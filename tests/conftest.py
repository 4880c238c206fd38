"""Fixtures for every Docker-backed test (envs, demo, rl): a live engine, the base image, and a leak check.

Tests that need the engine use `engine_ready`; it skips them (with the reason) only when no
engine answers. At the end of the session it asserts that no container labelled with this
process as owner is left behind.
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def engine_ready():
    # imported here: the Docker client library is absent where only GPU tests run (the lent GPU host)
    from envs import engine

    if not engine.engine_available():
        pytest.skip("no Docker engine answers: run `bash infra/docker/ensure_engine.sh` (or `make test`)")
    tag = engine.ensure_base_image(build=True)
    yield tag
    left = engine.list_containers({engine.LABEL_OWNER: engine.owner_id()})
    engine.reap_containers({engine.LABEL_OWNER: engine.owner_id()})
    assert not left, f"containers leaked by this test session: {[c['Id'][:12] for c in left]}"


@pytest.fixture(scope="session")
def base_image(engine_ready) -> str:
    return engine_ready
