"""SandboxPool: the concurrency cap holds, sandboxes are never reused, stale leaks are reaped."""

from __future__ import annotations

import threading
import time

import pytest

from envs import engine
from envs.pool import SandboxPool
from envs.sandbox import Sandbox, SandboxLimits

pytestmark = [pytest.mark.docker, pytest.mark.usefixtures("engine_ready")]


def test_cap_holds_and_no_reuse():
    pool = SandboxPool(max_concurrent=2)
    seen_live, ids, lock = [], [], threading.Lock()

    def episode(i: int) -> None:
        with pool.sandbox() as sb:
            with lock:
                seen_live.append(pool.live)
                ids.append(sb.container_id)
            # A marker from an earlier episode must never be visible: no reuse.
            assert sb.exec("ls /workspace", timeout=10).output == ""
            sb.write_file("episode.txt", str(i))
            time.sleep(0.3)

    threads = [threading.Thread(target=episode, args=(i,)) for i in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert max(seen_live) <= 2 and len(seen_live) == 5
    assert len(set(ids)) == 5
    assert pool.live == 0 and not any(engine.container_running(i) for i in ids)


def test_startup_reaps_only_stale_containers():
    stale = Sandbox(labels={"flashpost.test": "pool-reap"}, limits=SandboxLimits(lifetime_s=-5)).start()
    fresh = Sandbox(labels={"flashpost.test": "pool-reap"}).start()
    try:
        pool = SandboxPool(max_concurrent=1)
        assert stale.container_id in pool.reaped and fresh.container_id not in pool.reaped
        assert not engine.container_running(stale.container_id)
        assert engine.container_running(fresh.container_id)
    finally:
        stale.close()
        fresh.close()
