"""NCCL weight broadcast learner → worker (two GPUs, two processes): the worker receives the version and
bit-identical tensors of every dtype of a state dict."""

from __future__ import annotations

import socket

import pytest
import torch

pytestmark = pytest.mark.multigpu


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


def test_nccl_broadcast_delivers_version_and_exact_weights():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs")
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
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
