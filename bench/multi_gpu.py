"""Data-parallel learner scaling and learner -> rollout weight-sync time, on N GPUs (NCCL) or N CPU
processes (gloo), in one run.

    python -m bench.multi_gpu --cpu-procs 2 --model debug --steps 2     # CPU, gloo (a short run)
    python -m bench.multi_gpu --model small --zero-stage 2              # every visible GPU, NCCL

JSON lines: the model's size; learner tokens/s at 1..N ranks with the same per-rank batch (each rank
its own process and device, DeepSpeed ZeRO of rl/learner.py, SFT steps on random tokens), with the
scaling efficiency against N x the 1-rank rate; weight-sync seconds per version from a learner-side
process on device 0 to a rollout process on device N-1 (rl/weight_sync.NcclWeightGroup: NCCL on GPUs,
gloo on CPU), with GB/s. Every line carries the load average (the machine may be shared).
Models are built without Engram tables (ZeRO refuses their sparse gradients) and trained in fp32.
Not here: rollout throughput and the async speed-up (bench/rl_throughput.py runs the RL loop).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

import torch  # noqa: E402

# NVLink SHARP (NVLS) multicast stays off on the lent machines: NCCL would try to set it up and fail.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")


def _device(rank: int, cpu: bool) -> torch.device:
    if cpu:  # before anything initialises CUDA: the learner then picks gloo even on a GPU machine
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        return torch.device("cpu")
    torch.cuda.set_device(rank)
    return torch.device("cuda", rank)


def _model(flavor: str, device: torch.device):
    from model.config import get_flavor
    from model.transformer import Transformer

    if device.type == "meta":
        with device:
            return Transformer(get_flavor(flavor, engram_layer_ids=()))
    model = Transformer(get_flavor(flavor, engram_layer_ids=()))
    model.init_weights(seed=0)  # on cpu (the tested path; `small` takes about a minute), then moved
    return model.to(device)


def _batches(args: argparse.Namespace, vocab: int, seq: int, rank: int):
    """This rank's micro-batches: `micro_batches` rows of `seq` random tokens, all but the first trained."""
    import math

    from rl.payloads import Trajectory, pack_trajectories

    g = torch.Generator().manual_seed(1000 + rank)
    trajs = [Trajectory(token_ids=torch.randint(32, vocab, (seq,), generator=g).tolist(),
                        loss_mask=[False] + [True] * (seq - 1), logprobs=[math.nan] + [-1.0] * (seq - 1),
                        versions=[-1] + [0] * (seq - 1), turn_starts=[1])
             for _ in range(args.micro_batches)]  # fmt: skip
    return pack_trajectories(trajs, max_tokens=seq)


def learner_rank(rank: int, port: int, queue, world: int, args: argparse.Namespace) -> None:
    """One data-parallel rank: warm-up step, then `steps` timed SFT steps; rank 0 reports."""
    device = _device(rank, args.cpu)  # first: DeepSpeed picks its accelerator on import
    from rl.config import OptimConfig, TrainerConfig
    from rl.learner import Learner

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world))  # fmt: skip
    torch.set_num_threads(args.threads)
    model = _model(args.model, device)
    seq = min(args.seq, model.args.max_seq_len)
    batches = _batches(args, model.args.vocab_size, seq, rank)
    cfg = TrainerConfig(kind="sft", zero_stage=args.zero_stage, optim=OptimConfig(lr=1e-4, muon_lr=1e-3))
    learner = Learner(model, cfg)
    times = []
    with torch.compiler.set_stance("force_eager" if args.cpu else "default"):
        for _ in range(args.steps + 1):  # the first step warms up (allocations, NCCL communicators, compiles)
            if not args.cpu:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            metrics = learner.train_step(batches, "sft")
            if not args.cpu:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    if rank == 0:
        step_s = sum(times[1:]) / args.steps
        tokens = world * len(batches) * seq  # every position is computed, masked or not
        queue.put({"world": world, "seq": seq, "micro_batches_per_rank": len(batches), "step_s": step_s,
                   "tokens_per_s": tokens / step_s, "loss": metrics["loss"]})  # fmt: skip


def sync_member(rank: int, port: int, queue, args: argparse.Namespace, n_devices: int) -> None:
    """Rank 0: a learner-side process on device 0 sending `syncs` versions; rank 1: the rollout process
    on device N-1 receiving them into its own tensors. Rank 1 reports (it sees when a version is whole)."""
    from rl.weight_sync import NcclWeightGroup

    torch.set_num_threads(args.threads)
    device = _device(0 if rank == 0 else n_devices - 1, args.cpu)
    state = _model(args.model, device).state_dict()
    group = NcclWeightGroup("127.0.0.1", port, rank, 2, device=device.index if device.type == "cuda" else "cpu",
                            backend="gloo" if args.cpu else "nccl")  # fmt: skip
    times = []
    for version in range(args.syncs + 1):  # version 0 warms the communicator up
        t0 = time.perf_counter()
        if rank == 0:
            group.send(version, state)
        else:
            got_version, _ = group.receive(state)
            assert got_version == version
        if not args.cpu:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    if rank == 1:
        queue.put({"sync_s": times[1:], "tensors": len(state)})


def _spawn(target, world: int, extra: tuple) -> dict:
    """`world` fresh processes running target(rank, port, queue, *extra); -> what rank 0 or 1 reports."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")  # fresh interpreters: no CUDA or process-group state inherited
    from rl.learner import _free_port  # a loopback port for the ranks' rendezvous

    queue, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=target, args=(rank, port, queue, *extra)) for rank in range(world)]
    for p in procs:
        p.start()
    try:
        result = queue.get(timeout=3600)
    finally:
        for p in procs:
            p.join(timeout=120)
    failed = [p.exitcode for p in procs if p.exitcode]
    if failed:
        raise RuntimeError(f"a rank exited with {failed}")
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu-procs", type=int, default=0, help="N CPU processes with gloo (default: every GPU, NCCL)")
    p.add_argument("--model", default="debug", choices=["debug", "tiny", "small"])
    p.add_argument("--zero-stage", type=int, default=2, choices=[0, 1, 2])
    p.add_argument("--seq", type=int, default=128, help="tokens per micro-batch row (capped at max_seq_len)")
    p.add_argument("--micro-batches", type=int, default=2, help="micro-batches per rank per step")
    p.add_argument("--steps", type=int, default=3, help="timed learner steps (after one warm-up step)")
    p.add_argument("--syncs", type=int, default=3, help="timed weight-sync versions (after one warm-up)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    args = p.parse_args()
    args.cpu = args.cpu_procs > 0
    n = args.cpu_procs or torch.cuda.device_count()
    if n < 1:
        raise SystemExit("no CUDA device visible: pass --cpu-procs N")
    base = {"bench": "multi_gpu", "model": args.model, "backend": "gloo" if args.cpu else "nccl",
            "device": "cpu" if args.cpu else torch.cuda.get_device_name(0), "n_devices": n}  # fmt: skip

    def emit(row: dict) -> None:
        print(json.dumps({**base, **row, "loadavg_1m": os.getloadavg()[0]}), flush=True)

    state = _model(args.model, torch.device("meta")).state_dict()  # shapes and dtypes only
    size = sum(t.numel() * t.element_size() for t in state.values())  # what one weight sync moves
    emit({"what": "model", "params": sum(t.numel() for t in state.values()), "bytes": size})
    one = None
    for world in range(1, n + 1):
        row = _spawn(learner_rank, world, (world, args))
        one = one or row["tokens_per_s"]
        emit({"what": "learner", "zero_stage": args.zero_stage, **row,
              "scaling_efficiency": row["tokens_per_s"] / (world * one)})  # fmt: skip
    if n >= 2:
        row = _spawn(sync_member, 2, (args, n))
        mean = sum(row["sync_s"]) / len(row["sync_s"])
        emit({"what": "weight_sync", "from_device": 0, "to_device": n - 1, "bytes": size, **row,
              "sync_s_mean": mean, "GB_per_s": size / mean / 1e9})  # fmt: skip


if __name__ == "__main__":
    main()
