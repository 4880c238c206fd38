"""rl/demo_rollout.py: the demo's rollout worker process answers in request order with the weights of
the last version sent before each job, and samples exactly what the same engine does in-process (on
the CPU, and on a GPU where the weights travel as CUDA IPC handles)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from model.engine import InferenceEngine
from rl.demo_learning import build_policy, generate, greedy_families
from rl.demo_rollout import RolloutProcess
from synth.families import action_ruled_out, demo_splits

DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
    ),
]


@pytest.mark.parametrize("device", DEVICES)
def test_worker_uses_the_last_version_sent_before_each_job(device):
    torch.manual_seed(0)
    model, template, args = build_policy(seed=3)
    model.to(device)
    insts = demo_splits(0, 2, 0)["B_train"]
    v0 = {k: v.clone() for k, v in model.state_dict().items()}
    v1 = {k: (v + 0.05 * torch.randn_like(v) if v.is_floating_point() else v) for k, v in v0.items()}
    with RolloutProcess(args, device=device) as worker:
        worker.send_weights(0, v0)
        worker.wait_ready()
        worker.submit(insts, 2, 1.0, seed=11)
        worker.send_weights(1, v1)  # sent after job 1, before job 2: job 1 keeps version 0
        worker.submit(insts, 2, 1.0, seed=11)
        first, second = worker.result(), worker.result()
    assert {v for g in first for v in g.policy_versions} == {0}
    assert {v for g in second for v in g.policy_versions} == {1}
    # The in-process engine at the worker's one thread: the same kernels in the same order (another thread
    # count may block MKL's sums differently, and under the demo's QAT a reordered sum can round a value
    # the other way), so tokens and log-probs agree bit for bit on the CPU; 1e-5 covers the GPU's IPC path.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for state, got in ((v0, first), (v1, second)):
            model.load_state_dict(state)
            model.eval()
            engine = InferenceEngine(model, template, max_sessions=64, device=device)
            want = generate(engine, template, insts, 2, 1.0, seed=11)
            assert [g.token_ids for g in got] == [g.token_ids for g in want]
            for a, b in zip(got, want):
                torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(threads)
    assert [g.token_ids for g in first] != [g.token_ids for g in second]  # the versions really differ


def test_worker_error_reaches_the_learner():
    _, _, args = build_policy()
    with RolloutProcess(args) as worker:
        worker.send_weights(0, {"no.such.weight": torch.zeros(1)})
        with pytest.raises(RuntimeError, match="no.such.weight"):
            worker.wait_ready()


def test_leaving_with_unread_requests_does_not_hold_up_exit():
    # a job still pending (the worker is killed) with 4 MB of requests queued behind it that nobody
    # will read: the interpreter must still exit, not wait on the queue's feeder thread
    script = textwrap.dedent("""
        from rl.demo_learning import build_policy
        from rl.demo_rollout import RolloutProcess
        from synth.families import demo_splits
        model, template, args = build_policy(seed=3)
        with RolloutProcess(args) as worker:
            worker.send_weights(0, model.state_dict())
            worker.wait_ready()
            worker.submit(demo_splits(0, 2, 0)["B_train"], 2, 1.0, seed=1)
            for _ in range(4):
                worker._requests.put(("weights", (1, {"ballast": b"x" * 1_000_000})))
        print("left")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "left", done.stderr[-2000:]


@pytest.mark.parametrize("device", DEVICES)
def test_split_evaluation_answers_as_one_process_does(device):
    # greedy_families answers the largest family in a helper process and the others here, each on one
    # thread: the answers must be this process's own greedy answers, family by family
    model, template, _ = build_policy(seed=5)
    model.to(device)
    splits = demo_splits(0, 0, 6)
    families = {"A": splits["A_heldout"], "B": splits["B_heldout"][:4]}
    threads = torch.get_num_threads()
    gens, gen_s = greedy_families(model, template, families)
    assert torch.get_num_threads() == threads  # restored after the split
    assert set(gen_s) == {"A", "B"} and all(s > 0 for s in gen_s.values())
    model.eval()
    for fam, insts in families.items():
        engine = InferenceEngine(model, template, max_sessions=64, device=device)
        want = generate(engine, template, insts, 1, 0.0, seed=0, stop_when=action_ruled_out)
        assert [g.token_ids for g in gens[fam]] == [g.token_ids for g in want], fam
    assert any(g.finish_reason == "stop" and g.stop is None for g in gens["A"])  # stop_when reached the helper
