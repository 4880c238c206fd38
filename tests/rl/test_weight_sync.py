"""Weight broadcast learner → worker, two processes: over NCCL (two GPUs) and over gloo (CPU, the same
protocol) the worker receives the version and bit-identical tensors of every dtype of a state dict."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch


def _state(device: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"embed.weight": torch.randn(64, 32, generator=g).to(torch.bfloat16).to(device),
            "head.weight": torch.randn(64, 32, generator=g).to(device),
            "layers.0.ffn.gate.bias": torch.randn(8, generator=g).to(device)}  # fmt: skip


def _member(rank: int, port: int, queue) -> None:
    from rl.weight_sync import NcclWeightGroup

    torch.cuda.set_device(rank)
    group = NcclWeightGroup("127.0.0.1", port, rank, 2, device=rank)
    if rank == 0:
        group.send(5, _state("cuda:0"))
        return
    template = {k: torch.zeros_like(v) for k, v in _state("cuda:1").items()}
    version, got = group.receive(template)
    expected = _state("cuda:1")
    queue.put((version, all(torch.equal(got[k], expected[k]) and got[k].dtype == expected[k].dtype for k in expected)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.multigpu
def test_nccl_broadcast_delivers_version_and_exact_weights():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs")
    import torch.multiprocessing as mp

    port = _free_port()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_member, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    version, same = queue.get(timeout=120)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert version == 5 and same


def _gloo_member(rank: int, port: int, out: Path) -> None:
    """Run as a script (one process per rank): two syncs, the worker saves what it received."""
    from rl.weight_sync import NcclWeightGroup

    group = NcclWeightGroup("127.0.0.1", port, rank, 2, device="cpu", timeout_s=60, backend="gloo")
    state = _state("cpu")
    if rank == 0:
        group.send(5, state)
        group.send(6, {k: v + 1 for k, v in state.items()})
        return
    first = group.receive({k: torch.zeros_like(v) for k, v in state.items()})
    second = group.receive({k: torch.zeros_like(v) for k, v in state.items()})
    torch.save([first, second], out)


def test_gloo_broadcast_delivers_versions_and_exact_weights(tmp_path):
    port, out = _free_port(), tmp_path / "received.pt"
    root = Path(__file__).resolve().parents[2]
    procs = [subprocess.Popen([sys.executable, __file__, str(r), str(port), str(out)], cwd=root,
                              env=dict(os.environ, PYTHONPATH=str(root)), stderr=subprocess.PIPE)
             for r in range(2)]  # fmt: skip
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err.decode()[-2000:]
    (v1, got1), (v2, got2) = torch.load(out)
    state = _state("cpu")
    assert (v1, v2) == (5, 6)
    for k, v in state.items():
        assert got1[k].dtype == v.dtype and torch.equal(got1[k], v)
        assert torch.equal(got2[k], v + 1)


def test_backend_must_match_the_device():
    from rl.weight_sync import NcclWeightGroup

    with pytest.raises(ValueError, match="gloo for cpu"):
        NcclWeightGroup("127.0.0.1", _free_port(), 0, 1, device="cpu", backend="nccl")
    with pytest.raises(ValueError, match="not one of"):
        NcclWeightGroup("127.0.0.1", _free_port(), 0, 1, device="cpu", backend="mpi")


if __name__ == "__main__":
    _gloo_member(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
