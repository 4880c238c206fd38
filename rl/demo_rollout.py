"""The demo's rollout worker: a separate process that owns an InferenceEngine copy of the policy and
samples answers while the learner grades and trains, so the demo's RL is asynchronous on 2 cores.

Requests are served in order from one queue: weights (a version of the policy's state) and generate
jobs. A generate job is answered with the weights of the last version sent before it, so with
`max_policy_lag` 1 the learner submits batch t+1, trains on batch t and then sends version t+1:
batch t+1 is sampled by version t and trained at version t+1 (a lag of exactly one), and the
generation overlaps grading and training. Lag 0 submits after the update (synchronous).
Each generated token carries the version that produced it (model.engine.Generation.policy_versions).

Not here: the RL loop and its importance-sampling correction (rl/demo_learning.py). The Ray rollout
workers of `flashpost-train trainer=rl` are rl/actors.py; this worker is one local process because
Ray and DeepSpeed start-up would eat a large share of the demo's 2-core, minutes-long budget.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
import traceback
from collections.abc import Mapping

import torch


def _serve(args, threads: int, device: str, tf32: bool, requests, results) -> None:
    """Child process: build the policy of `args` on `device`, then answer requests until None arrives."""
    torch.set_num_threads(threads)
    torch.backends.cuda.matmul.allow_tf32 = tf32  # the learner's matmul precision: sample what it trains
    from model.engine import InferenceEngine
    from rl.demo_learning import generate, policy_of_args

    model, template = policy_of_args(args, seed=None)  # every weight arrives (strictly) before any job
    model.eval()
    engine = InferenceEngine(model, template, max_sessions=64, device=device)
    parent = mp.parent_process()
    while True:
        try:
            req = requests.get(timeout=5)
        except queue.Empty:
            if parent is not None and not parent.is_alive():  # the learner was killed: do not linger
                return
            continue
        if req is None:
            return
        kind, payload = req
        try:
            if kind == "weights":
                version, state = payload
                engine.load_state_dict(state, version)
                results.put(("ok", version))
            else:
                insts, n, temperature, seed, stop_when = payload
                t0 = time.perf_counter()
                gens = generate(engine, template, insts, n, temperature, seed, stop_when=stop_when)
                results.put(("gens", (gens, time.perf_counter() - t0)))
        except Exception:  # the learner raises it: a dead worker must not leave the loop waiting
            results.put(("error", traceback.format_exc()))


class RolloutProcess:
    """`with RolloutProcess(model.args) as w: w.send_weights(v, state); w.submit(...); w.result()`.

    Weights go as a cloned state dict (the learner keeps training its own tensors in place). On a GPU
    the clone stays on the device and the queue passes CUDA IPC handles (torch.multiprocessing's
    reductions), so a version costs one device-to-device copy, not a trip through host memory."""

    def __init__(self, args, threads: int = 1, device: str | torch.device = "cpu"):
        ctx = mp.get_context("spawn")  # fork after torch's thread pools start can deadlock
        self._requests, self._results = ctx.Queue(), ctx.Queue()
        serve_args = (args, threads, str(device), torch.backends.cuda.matmul.allow_tf32, self._requests, self._results)
        self._proc = ctx.Process(target=_serve, args=serve_args, daemon=True)
        self._pending: list[str] = []  # reply kinds still owed, in request order
        self.last_gen_s = 0.0  # the worker's generation time for the last job returned

    def __enter__(self) -> RolloutProcess:
        self._proc.start()
        return self

    def __exit__(self, *exc) -> None:
        if "gens" in self._pending:  # a job nobody will read: do not wait for it
            self._proc.kill()
        else:
            self._requests.put(None)
        self._proc.join(timeout=30)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()
        # Requests the worker never read would hold up this process's exit: each queue's feeder
        # thread waits to flush them into a pipe nobody drains any more (the H200 demo hung there
        # after its report, with a version's CUDA IPC handles queued behind a killed job).
        for q in (self._requests, self._results):
            q.cancel_join_thread()
            q.close()

    def send_weights(self, version: int, state: Mapping[str, torch.Tensor]) -> None:
        self._requests.put(("weights", (version, {k: v.detach().clone() for k, v in state.items()})))
        self._pending.append("ok")

    def submit(self, insts: list, n: int, temperature: float, seed: int, stop_when=None) -> None:
        """Queue a generate job (rl.demo_learning.generate's arguments; `stop_when` must be a module-level
        function: it travels by name)."""
        self._requests.put(("generate", (insts, n, temperature, seed, stop_when)))
        self._pending.append("gens")

    def wait_ready(self) -> None:
        """Block until the worker has loaded every version sent so far (no job may be pending)."""
        assert "gens" not in self._pending, "wait_ready() with a generate job pending"
        while self._pending:
            self._pending.pop(0)
            self._get()

    def result(self) -> list:
        """The generations of the oldest submitted job (weight acknowledgements before it are consumed)."""
        while self._pending:
            want = self._pending.pop(0)
            kind, payload = self._get()
            assert kind == want, (kind, want)
            if kind == "gens":
                gens, self.last_gen_s = payload
                return gens
        raise RuntimeError("RolloutProcess.result() without a submitted job")

    def _get(self) -> tuple[str, object]:
        """The next reply; a worker's error or death is raised here."""
        while True:
            try:
                kind, payload = self._results.get(timeout=5)
            except queue.Empty:
                if not self._proc.is_alive():
                    raise RuntimeError(f"demo rollout worker died (exit code {self._proc.exitcode})") from None
                continue
            if kind == "error":
                raise RuntimeError(f"demo rollout worker failed:\n{payload}")
            return kind, payload


def worker_threads() -> int:
    """Torch threads of the worker: one core of two (generation is per-op overhead bound)."""
    return max(1, (os.cpu_count() or 2) // 2)
