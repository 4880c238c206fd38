"""The demo tests that grade need a live Docker engine and the base image (as tests/envs do)."""

from __future__ import annotations

import pytest

from envs import engine


@pytest.fixture(scope="session")
def engine_ready():
    if not engine.engine_available():
        pytest.skip("no Docker engine answers: run `bash infra/docker/ensure_engine.sh` (or `make test`)")
    tag = engine.ensure_base_image(build=True)
    yield tag
    left = engine.list_containers({engine.LABEL_OWNER: engine.owner_id()})
    engine.reap_containers({engine.LABEL_OWNER: engine.owner_id()})
    assert not left, f"containers leaked by this test session: {[c['Id'][:12] for c in left]}"
