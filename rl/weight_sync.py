"""Weight sync across GPUs: the learner broadcasts its state dict to rollout workers over NCCL, by version.

On one machine the Ray object store is enough (rl/actors.py: `LearnerActor.get_weights` publishes
`(version, state_dict)` once, each worker reads it). Across GPUs and nodes a broadcast from the learner's
GPU avoids the host round trip: learner (rank 0) and workers (ranks 1..N) join a standalone NCCL group
(its own TCPStore rendezvous, NOT the learner's DeepSpeed default group, which the workers are not in),
then every sync sends the version first and the tensors in the state dict's key order.
`backend="gloo"` runs the same protocol between CPU processes (tests, bench/multi_gpu.py --cpu-procs).
Not here: deciding when to sync (the driver), loading into the engine (InferenceEngine.load_state_dict).
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta

import torch

WEIGHT_SYNC_BACKENDS = ("nccl", "gloo")


def _gloo_group(store, rank: int, world_size: int, host: str, timeout: timedelta):
    from torch.distributed import ProcessGroupGloo

    opts = ProcessGroupGloo._Options()
    opts._timeout = timeout
    # gloo's default device binds the interface the hostname resolves to; a loopback group stays on loopback
    loopback = host in ("127.0.0.1", "localhost", "::1")
    opts._devices = [ProcessGroupGloo.create_device(hostname=host) if loopback else
                     ProcessGroupGloo.create_default_device()]  # fmt: skip
    return ProcessGroupGloo(store, rank, world_size, opts)


class NcclWeightGroup:
    """One member of the learner→workers broadcast group. Every member calls the constructor (rank 0
    hosts the store on `host:port`), then each sync: rank 0 `send(version, weights)`, the others
    `receive(template)` with a state dict of the same keys, shapes and dtypes (their own model's).
    `device`: a CUDA index or device string (NCCL), "cpu" for gloo."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, device: int | str = 0,
                 timeout_s: float = 300.0, backend: str = "nccl"):  # fmt: skip
        from torch.distributed import TCPStore

        if backend not in WEIGHT_SYNC_BACKENDS:
            raise ValueError(f"weight sync backend {backend!r} is not one of {WEIGHT_SYNC_BACKENDS}")
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        if (self.device.type == "cuda") != (backend == "nccl"):
            raise ValueError(f"backend {backend!r} cannot carry {self.device} tensors: nccl is for cuda, gloo for cpu")
        timeout = timedelta(seconds=timeout_s)
        store = TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout)
        if backend == "nccl":
            from torch.distributed import ProcessGroupNCCL

            self.pg = ProcessGroupNCCL(store, rank, world_size)
        else:
            self.pg = _gloo_group(store, rank, world_size, host, timeout)

    def _broadcast(self, t: torch.Tensor) -> None:
        from torch.distributed import BroadcastOptions

        opts = BroadcastOptions()
        opts.rootRank = 0
        self.pg.broadcast([t], opts).wait()

    @torch.no_grad()
    def send(self, version: int, weights: Mapping[str, torch.Tensor]) -> None:
        if self.rank != 0:
            raise RuntimeError("only the learner (rank 0) sends weights")
        self._broadcast(torch.tensor([version], dtype=torch.int64, device=self.device))
        for tensor in weights.values():
            self._broadcast(tensor.detach().to(self.device).contiguous())

    @torch.no_grad()
    def receive(self, template: Mapping[str, torch.Tensor]) -> tuple[int, dict[str, torch.Tensor]]:
        """-> (version, weights) with `template`'s keys, shapes, dtypes, on this member's device."""
        if self.rank == 0:
            raise RuntimeError("rank 0 is the learner: it sends")
        version = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._broadcast(version)
        out = {}
        for name, t in template.items():
            buf = torch.empty(t.shape, dtype=t.dtype, device=self.device)
            self._broadcast(buf)
            out[name] = buf
        return int(version.item()), out
