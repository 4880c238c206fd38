"""Shared set-up of the rl tests: launching a test file as N torch.distributed ranks on 127.0.0.1."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def launch_ranks(script: str, world: int, args: list[str], timeout_s: float = 500, **env_extra: str) -> None:
    """Run `python script *args` as `world` gloo ranks (MASTER_* / RANK / WORLD_SIZE set, a free
    loopback port) and wait for all; a rank that fails fails the test with its stderr tail."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(world):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                   LOCAL_RANK=str(rank), WORLD_SIZE=str(world), PYTHONPATH=str(ROOT), **env_extra)  # fmt: skip
        procs.append(subprocess.Popen([sys.executable, script, *args], env=env, cwd=ROOT,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))  # fmt: skip
    try:
        for p in procs:
            _, err = p.communicate(timeout=timeout_s)
            assert p.returncode == 0, err.decode()[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


@pytest.fixture(scope="session")
def ranks_launcher():
    """`launch_ranks` as a fixture (test modules are imported by path and cannot import each other)."""
    return launch_ranks
