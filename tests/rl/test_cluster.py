"""A local Ray instance round-trips a task and keeps every socket on loopback."""

from __future__ import annotations

import ipaddress

import psutil
import pytest

from rl.cluster import ClusterConfig, shutdown, start_or_join

pytestmark = pytest.mark.ray

ALL_INTERFACES = {"0.0.0.0", "::"}


def _is_loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip.split("%")[0])
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped:
        addr = addr.ipv4_mapped
    return addr.is_loopback


def _ray_pids() -> set[int]:
    """This test process and every process it spawned (Ray's daemons and workers)."""
    me = psutil.Process()
    return {me.pid} | {p.pid for p in me.children(recursive=True)}


@pytest.fixture(scope="module")
def ray_local():
    handle = start_or_join(ClusterConfig(num_cpus=2, include_dashboard=True), quiet=True)
    yield handle
    shutdown(handle)


def test_task_round_trip_and_dashboard_on_loopback(ray_local):
    import ray

    @ray.remote
    def square(x: int) -> int:
        return x * x

    assert ray.get([square.remote(i) for i in range(8)]) == [i * i for i in range(8)]
    assert ray_local.started_here
    assert ray_local.dashboard_url is not None and "127.0.0.1" in ray_local.dashboard_url
    assert ray_local.address.startswith("127.0.0.1:")


def test_every_ray_socket_is_loopback(ray_local):
    import ray

    @ray.remote
    class Echo:
        def ping(self, x):
            return x

    echo = Echo.remote()
    assert ray.get(echo.ping.remote("x")) == "x"
    pids = _ray_pids()
    assert len(pids) > 3, "expected Ray daemons (gcs_server, raylet, workers) among our children"
    checked = 0
    for conn in psutil.net_connections(kind="inet"):
        if conn.pid not in pids:
            continue
        checked += 1
        local_ip = conn.laddr.ip
        assert _is_loopback(local_ip) or local_ip in ALL_INTERFACES, f"pid {conn.pid} bound {conn.laddr}"
        if conn.raddr:
            assert _is_loopback(conn.raddr.ip), f"pid {conn.pid} dialled {conn.raddr}"
    assert checked > 0, "no Ray sockets were found to check"


def test_gpu_shares_are_validated_and_h200_layout_loads():
    """A negative GPU share is refused with the field's name; conf/cluster/h200.yaml puts the learner,
    the rollout workers and the teacher on shares of one GPU that add up to at most 1."""
    from pathlib import Path

    import yaml

    with pytest.raises(ValueError, match="cluster.rollout_gpus"):
        ClusterConfig(rollout_gpus=-0.5)
    raw = yaml.safe_load((Path(__file__).resolve().parents[2] / "conf/cluster/h200.yaml").read_text())
    cfg = ClusterConfig(**raw)
    assert 0 < cfg.learner_gpus and 0 < cfg.rollout_gpus and 0 < cfg.teacher_gpus
    assert cfg.learner_gpus + cfg.rollout_gpus + cfg.teacher_gpus <= cfg.num_gpus


def test_actors_without_a_gpu_share_stay_on_cpu():
    import torch

    from rl.actors import actor_device

    assert actor_device() == torch.device("cpu")  # outside Ray, or a share of 0


def test_demo_gauges_reach_the_metrics_endpoint(ray_local):
    # what the demo sets (rl.metrics.DemoGauges) is served by the node's metrics agent, which the
    # dashboard and Prometheus read
    import time
    import urllib.request

    import ray

    from rl.metrics import DemoGauges

    gauges = DemoGauges()
    assert gauges.pass_at_1 is not None
    gauges.held_out("eval_sft", "B", 0.25)
    port = next(n["MetricsExportPort"] for n in ray.nodes() if n["Alive"])
    text, deadline = "", time.time() + 90
    while "flashpost_demo_heldout_pass_at_1" not in text and time.time() < deadline:
        time.sleep(2)
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    lines = [ln for ln in text.splitlines() if "flashpost_demo_" in ln and not ln.startswith("#")]
    assert any("heldout_pass_at_1" in ln and 'family="B"' in ln and ln.endswith(" 0.25") for ln in lines), lines
