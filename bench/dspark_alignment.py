"""Does a DSpark drafter trained along RL keep its acceptance rate while the policy moves, where a frozen
one loses it? Two RL runs through rl/rl_loop.py from one start (real Ray local instance on 127.0.0.1,
DeepSpeed learner, InferenceEngine rollout workers; CPU).

    python -m bench.dspark_alignment                     # seed 0: 20 synchronous RL steps per run, point every 4
    python -m bench.dspark_alignment --steps 8 --every 2 # a quick look

Start: the policy of bench/rl_learning.py (a short SFT of `tiny` on toy-family format demonstrations
with random targets: it solves ~25% and RL moves it a lot), then `--dspark-steps` updates of
trainer=dspark (LearnerActor.train_dspark: backbone frozen, only `mtp.*` trains) on the same
demonstrations, so the drafter matches that policy. From these weights, RL twice with the same seeds:
(a) trainer.dspark_weight=1 (the drafter trains along on the detached backbone features), (b)
dspark_weight=0 (the drafter frozen); synchronous (max_policy_lag 0) and without gradient clipping,
so the two runs move the policy identically and differ only in the drafter. Each run checkpoints
every `--every` versions; each checkpoint is measured after the run: greedy
`InferenceEngine.generate_speculative` on a fixed prompt set (the held-out toy prompts, up to
`--new-tokens` tokens, the template's stop ids), acceptance = accepted / drafted draft tokens over all
sessions (`speculation_stats`). The engine gets a cost model under
which a full block (k = dspark_block_size) is always drafted and speculation never switches itself
off, so every point measures the same thing.

One JSON line per (run, version): {run: "trained"|"frozen", version, acceptance_rate, drafted,
mean_accepted, greedy_pass (replies containing their prompt's target), moved (fraction of greedy
replies that differ from the start policy's: how far the policy has moved)}; then a summary with both
curves, per run the learner's teacher-forced `dspark_acceptance` of each trained batch and the largest
change of any `mtp.*` weight, and the load average. Not here: decode speed (bench/decode.py --speculative).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

import torch  # noqa: E402

from bench.rl_learning import MODEL, add_rl_args, load_policy, rl_job, sft_start  # noqa: E402
from rl.cluster import ClusterConfig, shutdown, start_or_join  # noqa: E402
from rl.config import OptimConfig, TrainerConfig  # noqa: E402
from rl.rl_loop import run_async  # noqa: E402
from rl.rollout import TOY_TARGETS, toy_tasks  # noqa: E402


def align_drafter(ns: argparse.Namespace, start: Path, out_dir: Path) -> tuple[Path, list[float]]:
    """trainer=dspark from `start`: the drafter alone against the frozen policy, on the SFT's kind of
    demonstrations. -> (model.safetensors with the aligned drafter, teacher-forced acceptance per step)."""
    import random

    import ray

    from rl.actors import LearnerActor, build_model
    from rl.sft_loop import DemoStream, demonstrations
    from synth.taskset_sources import toy_messages

    rng = random.Random(ns.seed + 1)
    tasks = [vars(t) for t in toy_tasks(ns.n_tasks, n_turns=ns.turns)]
    _, template = build_model(MODEL)
    drawn = [{**t, "target": rng.choice(TOY_TARGETS)} for t in tasks for _ in range(16)]
    demos = demonstrations([toy_messages(t) for t in drawn], [t["task_id"] for t in drawn], "toy", template)
    optim = OptimConfig(lr=ns.dspark_lr, sinkhorn_lr=ns.dspark_lr, muon_lr=10 * ns.dspark_lr)
    trainer = TrainerConfig(kind="dspark", max_steps=ns.dspark_steps, batch_size=16, seed=ns.seed,
                            micro_batch_tokens=2048, global_batch_tokens=2048, optim=optim)  # fmt: skip
    learner = ray.remote(LearnerActor).options(num_cpus=1).remote(MODEL, trainer, init_seed=ns.seed,
                                                                  init_checkpoint=str(start))  # fmt: skip
    stream = DemoStream(demos, ns.seed)
    try:
        acc = [ray.get(learner.train_dspark.remote(stream.take(16)))["dspark_acceptance"]
               for _ in range(ns.dspark_steps)]  # fmt: skip
        path = Path(ray.get(learner.save.remote(str(out_dir))))
    finally:
        ray.kill(learner)
    return path / "model.safetensors", acc


def acceptance(weights: Path, prompts: list[list[int]], targets: list[str], new_tokens: int,
               reference: list[str] | None = None) -> dict:  # fmt: skip
    """Greedy speculative decoding of `prompts` with the policy+drafter in `weights`: accepted/drafted,
    the replies ("texts"), and how many differ from `reference` replies."""
    from model.engine import InferenceEngine
    from model.speculative import CostModel, SpeculativeConfig

    policy, template = load_policy(MODEL, 0, weights)
    k = policy.args.dspark_block_size
    # verification of any k costs less than a plain step: the full block is always drafted, and the
    # modelled speedup never falls below min_speedup=0, so speculation never switches itself off
    spec = SpeculativeConfig(cost=CostModel(t_verify=[1.0] + [0.5] * k, t_draft=0.0), min_speedup=0.0)
    engine = InferenceEngine(policy, template, max_sessions=len(prompts) + 1, speculative=spec)
    sids = [engine.start(p) for p in prompts]
    outs = engine.generate_speculative(sids, new_tokens, temperature=0.0)
    stats = [engine.speculation_stats(s) for s in sids]
    drafted, accepted = sum(s["drafted"] for s in stats), sum(s["accepted"] for s in stats)
    steps = sum(s["steps"] for s in stats)
    return {
        "acceptance_rate": round(accepted / drafted, 4) if drafted else None, "drafted": drafted,
        "mean_accepted": round(accepted / steps, 3) if steps else None,
        "generated": sum(len(o.token_ids) for o in outs),
        "greedy_pass": round(sum(t in o.text for o, t in zip(outs, targets)) / len(outs), 4),
        "moved": None if reference is None else round(sum(o.text != r for o, r in zip(outs, reference)) / len(outs), 4),
        "texts": [o.text for o in outs],
    }  # fmt: skip


def mtp_changed(a: Path, b: Path) -> float:
    """Largest |Δ| over the drafter's (`mtp.*`) tensors between two checkpoints."""
    from safetensors.torch import load_file

    wa, wb = load_file(str(a)), load_file(str(b))
    return max(float((wa[k].float() - wb[k].float()).abs().max()) for k in wa if k.startswith("mtp."))


def run_curve(ns: argparse.Namespace, name: str, weight: float, start: Path, prompts, targets, reference,
              root: Path) -> dict:  # fmt: skip
    # no gradient clipping: the global norm includes the drafter's gradients, so clipping would make the
    # backbone's update depend on the DSpark term; without it, and synchronous (lag 0), both runs train
    # the same policy bit for bit and only the drafter differs
    job = rl_job(ns, ns.seed, dspark_weight=weight, checkpoint_every=ns.every, grad_clip=0.0)
    run_dir = root / name
    t0 = time.perf_counter()
    hist = run_async(job, run_dir, progress=False, ray_metrics=False, init_checkpoint=str(start))
    t_rl = time.perf_counter() - t0
    points = [(0, start)] + sorted((int(p.name.split("-")[1]), p / "model.safetensors")
                                   for p in (run_dir / "checkpoints").glob("step-*"))  # fmt: skip
    curve = []
    for version, weights in points:
        row = {"bench": "dspark_alignment", "run": name, "dspark_weight": weight, "version": version,
               **acceptance(weights, prompts, targets, ns.new_tokens, reference)}  # fmt: skip
        texts = row.pop("texts")
        print(json.dumps({**row, "sample": texts[:4]}), flush=True)
        curve.append(row)
    return {
        "run": name, "rl_s": round(t_rl, 1),
        "acceptance": [r["acceptance_rate"] for r in curve], "versions": [r["version"] for r in curve],
        "teacher_forced_acceptance": [round(r.get("dspark_acceptance", float("nan")), 4) for r in hist],
        "train_reward": [round(r["reward_mean"], 3) for r in hist],
        "mtp_max_abs_change": mtp_changed(start, points[-1][1]),
        "greedy_pass": [r["greedy_pass"] for r in curve], "texts_final": texts,
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--every", type=int, default=4, help="checkpoint (curve point) every this many versions")
    p.add_argument("--dspark-steps", type=int, default=20)
    p.add_argument("--dspark-lr", type=float, default=3e-3)
    p.add_argument("--eval-prompts", type=int, default=64, help="held-out toy prompts decoded at each point")
    p.add_argument("--new-tokens", type=int, default=16)
    add_rl_args(p)
    # this bench's curves were measured with the earlier RL settings (20 steps, point every 4); keep them
    p.set_defaults(lag=0, steps=20, lr=1e-3, muon_lr=1e-2, n_tasks=8)
    ns = p.parse_args()
    torch.set_num_threads(1)
    handle = start_or_join(ClusterConfig(num_cpus=4, include_dashboard=False), quiet=True)
    try:
        with tempfile.TemporaryDirectory() as d:
            root = Path(d)
            t0 = time.perf_counter()
            sft = sft_start(ns, ns.seed, root / "sft")
            start, tf_acc = align_drafter(ns, sft, root / "dspark")
            t_start = time.perf_counter() - t0
            _, template = load_policy(MODEL, 0, None)
            tasks = toy_tasks(ns.n_tasks + ns.eval_prompts)[ns.n_tasks :]
            prompts = [template.render([{"role": "user", "content": t.prompt}], add_generation_prompt=True).token_ids
                       for t in tasks]  # fmt: skip
            targets = [t.target for t in tasks]
            before, aligned = (acceptance(w, prompts, targets, ns.new_tokens) for w in (sft, start))
            reference = aligned.pop("texts")
            before.pop("texts")
            print(json.dumps({"bench": "dspark_alignment", "stage": "start", "start_s": round(t_start, 1),
                              "drafter_after_sft": before, "drafter_after_dspark": aligned,
                              "dspark_teacher_forced": [round(a, 4) for a in tf_acc]}), flush=True)  # fmt: skip
            runs = [run_curve(ns, name, w, start, prompts, targets, reference, root)
                    for name, w in (("trained", 1.0), ("frozen", 0.0))]  # fmt: skip
        trained, frozen = runs
        same_policy = trained.pop("texts_final") == frozen.pop("texts_final")
        gaps = [round(a - b, 4) for a, b in zip(trained["acceptance"], frozen["acceptance"])]
        print(json.dumps({"bench": "dspark_alignment", "summary": True, "seed": ns.seed, "runs": runs,
                          "same_final_greedy_replies": same_policy, "gap_trained_minus_frozen": gaps,
                          "trained_higher_after_start": all(g > 0 for g in gaps[1:]),
                          "loadavg": [round(x, 2) for x in os.getloadavg()]}), flush=True)  # fmt: skip
    finally:
        shutdown(handle)


if __name__ == "__main__":
    main()
