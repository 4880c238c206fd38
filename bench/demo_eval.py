"""The demo's held-out generation: one process against two (`rl.demo_learning.greedy_families`).

    python -m bench.demo_eval --run-dir runs/demo                 # the SFT'd policy of a finished demo
    python -m bench.demo_eval --run-dir runs/demo --checkpoint rl/policy.safetensors --repeats 3

What an evaluation stage generates, timed without grading (no Docker needed): greedy answers to every
held-out family of the run (A, B and F when the factory ran), with the checkpoint's weights.
  in_turn: greedy_families(split=False): each family in turn in this process, on `--threads` threads
           (the evaluation before the split);
  split:   greedy_families: the largest family in a helper process, the rest here, one thread each
           (the helper's start and weight transfer included).
The two run alternately in one process, `--repeats` times each. Rows: {bench: "demo_eval", mode,
repeat, seconds, answers, tokens, families: {name: seconds}}; then one {bench: "demo_eval_summary",
in_turn_s, split_s (medians), speedup, same_answers (every answer token for token equal between
the modes)}. Needs a run folder whose `families` (and `factory`) stages are done and the checkpoint.
Not here: grading or pass@1 (the demo's eval stages).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run-dir", default="runs/demo", help="a demo run folder (families stage done)")
    p.add_argument("--checkpoint", default="sft/policy.safetensors", help="relative to --run-dir")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=2, help="torch threads of the in-turn mode (the demo's)")
    args = p.parse_args()

    from rl.demo_config import DemoConfig
    from rl.demo_learning import greedy_families
    from rl.demo_stages import _families, _instances, _policy

    run = Path(args.run_dir)
    if not (run / args.checkpoint).exists():
        raise SystemExit(f"no checkpoint {run / args.checkpoint}: run the demo first (make demo) or pass --run-dir")
    sets = _instances(run)
    if not sets:
        raise SystemExit(f"{run} has no families/instances.json: its families stage has not run")
    families = {f: sets[f"{f}_heldout"] for f in _families(sets)}
    cfg = DemoConfig(threads=args.threads)
    model, template = _policy(cfg, run / args.checkpoint)

    modes = {"in_turn": False, "split": True}
    times: dict[str, list[float]] = {m: [] for m in modes}
    answers: dict[str, list] = {}
    for r in range(args.repeats):
        for mode, split in modes.items():
            torch.set_num_threads(args.threads)
            t0 = time.perf_counter()
            gens, secs = greedy_families(model, template, families, split=split)
            dt = time.perf_counter() - t0
            times[mode].append(dt)
            answers.setdefault(mode, [g.token_ids for f in families for g in gens[f]])
            n_tok = sum(len(g.token_ids) for f in families for g in gens[f])
            print(json.dumps({"bench": "demo_eval", "mode": mode, "repeat": r, "seconds": round(dt, 2),
                              "answers": sum(map(len, families.values())), "tokens": n_tok,
                              "families": {f: round(s, 2) for f, s in secs.items()}}), flush=True)  # fmt: skip
    t_in, t_split = statistics.median(times["in_turn"]), statistics.median(times["split"])
    print(json.dumps({"bench": "demo_eval_summary", "checkpoint": str(run / args.checkpoint),
                      "in_turn_s": round(t_in, 2), "split_s": round(t_split, 2), "speedup": round(t_in / t_split, 2),
                      "same_answers": answers["in_turn"] == answers["split"]}))  # fmt: skip


if __name__ == "__main__":
    main()
