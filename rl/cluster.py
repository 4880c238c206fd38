"""Start or join the Ray instance a flashpost job runs in.

A local instance (laptop, CI, the demo) is bound to 127.0.0.1 everywhere: node address, GCS,
dashboard, workers. Nothing here dials an outward address: usage-stats reporting (which also
probes cloud metadata endpoints) is switched off before Ray is imported. Joining an existing
cluster (`address="auto"` or `ray://...`) is for multi-node runs started from `infra/ray/`.
This module does not create actors; the trainers do.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

# Ray reads these at import time and when it spawns its daemons, so they are set on import of
# this module, before any `import ray` below.
_LOCAL_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # local instances bind every process to 127.0.0.1
    "RAY_USAGE_STATS_ENABLED": "0",  # no telemetry, no cloud-metadata probing
}


@dataclass(kw_only=True)
class ClusterConfig:
    """Where the job's Ray instance lives.

    address: "local" starts a private instance on this machine; "auto" joins the one started
    by `ray start` here; "ray://host:port" joins a remote cluster through Ray Client.
    learner_gpus / rollout_gpus (per worker) / teacher_gpus: the GPU share each actor asks Ray
    for; 0 keeps it on cpu, a fraction lets several actors share one GPU (conf/cluster/h200.yaml).
    """

    address: str = "local"
    num_cpus: int | None = None
    num_gpus: int | None = None
    include_dashboard: bool = True
    dashboard_port: int = 8265
    object_store_memory_mb: int | None = None
    learner_gpus: float = 0.0
    rollout_gpus: float = 0.0
    teacher_gpus: float = 0.0

    def __post_init__(self) -> None:
        for name in ("learner_gpus", "rollout_gpus", "teacher_gpus"):
            if getattr(self, name) < 0:
                raise ValueError(f"cluster.{name}={getattr(self, name)} must be >= 0 (0 = run that actor on cpu)")


@dataclass(frozen=True)
class RayHandle:
    address: str
    dashboard_url: str | None
    started_here: bool


def apply_local_env() -> None:
    """Export the loopback-only settings into this process (inherited by Ray's daemons)."""
    for key, value in _LOCAL_ENV.items():
        os.environ.setdefault(key, value)


def start_or_join(cfg: ClusterConfig, *, quiet: bool = False) -> RayHandle:
    """Start a local loopback-only Ray instance, or join an existing cluster; print the dashboard URL."""
    apply_local_env()
    import ray

    if ray.is_initialized():
        ctx = ray.get_runtime_context()
        return RayHandle(address=ctx.gcs_address, dashboard_url=_dashboard_url(ray), started_here=False)

    if cfg.address == "local":
        kwargs = dict(
            address="local",
            num_cpus=cfg.num_cpus,
            num_gpus=cfg.num_gpus,
            include_dashboard=cfg.include_dashboard,
            dashboard_host="127.0.0.1",
            dashboard_port=cfg.dashboard_port,
            _node_ip_address="127.0.0.1",
            log_to_driver=not quiet,
            configure_logging=not quiet,
        )
        if cfg.object_store_memory_mb:
            kwargs["object_store_memory"] = cfg.object_store_memory_mb * 1024 * 1024
        ctx = ray.init(**kwargs)
        started = True
    else:
        ctx = ray.init(address=cfg.address, log_to_driver=not quiet)
        started = False
    url = ctx.dashboard_url or None
    if url and not url.startswith("http"):
        url = f"http://{url}"
    print(f"[flashpost] Ray {'started' if started else 'joined'} at {ctx.address_info['gcs_address']}"
          + (f"; dashboard: {url}" if url else "; dashboard off"), flush=True)
    if url and (hint := dashboard_login_hint()):
        print(f"[flashpost] {hint}", flush=True)
    return RayHandle(address=ctx.address_info["gcs_address"], dashboard_url=url, started_here=started)


def dashboard_login_hint() -> str | None:
    """How to get into a dashboard with Ray's token authentication on (its API answers 401 without the
    token); None when it is off."""
    token_path = Path.home() / ".ray" / "auth_token"
    if os.environ.get("RAY_AUTH_MODE", "").lower() != "token":
        return None
    where = os.environ.get("RAY_AUTH_TOKEN_PATH") or str(token_path)
    return (f"the dashboard asks for Ray's authentication token: paste the contents of {where} "
            "(`ray get-auth-token` prints it); API clients send it as `Authorization: Bearer <token>`")


def shutdown(handle: RayHandle) -> None:
    """Stop Ray if this process started it; leave a joined cluster running."""
    import ray

    if ray.is_initialized():
        ray.shutdown()


def _dashboard_url(ray_module) -> str | None:
    try:
        url = ray_module.get_dashboard_url()  # type: ignore[attr-defined]
    except Exception:  # older Ray without the helper: the URL is printed at start only
        return None
    return f"http://{url}" if url and not url.startswith("http") else (url or None)
