"""The rollout's V4.1 inference path, feature by feature, in one process (CPU `tiny` by default): what each
`rollout:` switch costs or saves, and how close the learner's log-probs are to the rollout's.

    python -m bench.rollout_features                         # tiny, 2 groups of 4, 3-turn toy episodes
    python -m bench.rollout_features --flavor debug --groups 1 --group-size 2 --max-new-tokens 8   # seconds

JSON lines:
  {"kind": "rollout", "features": ...}  one per configuration (all off; CED; CED + prefix cache; CED +
      prefix cache + packed caches + DSpark speculation = the default; CED + packed caches): episodes/s
      and generated tokens/s of whole groups through one RolloutWorker (rl/actors.py), tokens fed to the
      model, CED replay tokens, prefix-cache hits per session start, DSpark drafting and acceptance,
      packed cache bytes per token. Every configuration runs the same groups (same seeds) after one warm-up group.
  {"kind": "mismatch", "simulate_replay": ..., "routing_replay": ...}  learner vs rollout log-probs at the
      same weights (rl/losses.py same_version_mismatch, the number trainers log): mean |Δ log p| and k3,
      with the learner's simulated decoder replay on and off, and its routing replay (trainer.routing_replay)
      on and off, all four on the same episodes: the default configuration run again with an engine that
      records every token's experts (its own "rollout" row, features "default+record_routing").
  {"kind": "wire_format"}  tokens per tool call of the chat template's tool-call block, per tool.
The weights are a seeded initialisation: acceptance of an untrained drafter is near 0, so speculation
measures its loss and switches itself off; on trained weights (an SFT/DSpark checkpoint, --checkpoint)
it drafts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

import torch  # noqa: E402

from rl.actors import RolloutWorker, build_model, pack_for_learner  # noqa: E402
from rl.config import ModelChoice, OptimConfig, PolicyLossConfig, RolloutConfig, TrainerConfig  # noqa: E402
from rl.losses import mismatch_means, same_version_mismatch  # noqa: E402
from rl.rollout import RolloutRequest, toy_tasks  # noqa: E402

TOKENIZER_FIT = {"vocab_size": 4096, "engram_compressed_vocab_size": 2742}
VERSION = 1
# name -> RolloutConfig switches; "default" is what conf/rollout/default.yaml runs
CONFIGS: dict[str, dict] = {
    "all_off": dict(prefill_mode="full", prefix_cache=False, packed_cache=False, speculative=False),
    "ced": dict(prefill_mode="ced", prefix_cache=False, packed_cache=False, speculative=False),
    "ced+prefix": dict(prefill_mode="ced", prefix_cache=True, packed_cache=False, speculative=False),
    "default": dict(prefill_mode="ced", prefix_cache=True, packed_cache=True, speculative=True),
    "ced+packed": dict(prefill_mode="ced", prefix_cache=False, packed_cache=True, speculative=False),
}


def _requests(args: argparse.Namespace, first_group: int) -> list[list[RolloutRequest]]:
    tasks = toy_tasks(args.groups + 1, n_turns=args.turns)
    out = []
    for g in range(first_group, first_group + args.groups):
        task = vars(tasks[g % len(tasks)])
        out.append([RolloutRequest(key=f"g{g}/{m}", group_id=f"g{g}", task_id=task["task_id"], env="toy",
                                   seed=g * 1000 + m, task=task) for m in range(args.group_size)])  # fmt: skip
    return out


def run_config(choice: ModelChoice, weights: dict, switches: dict, args: argparse.Namespace,
               record_routing: bool = False):  # fmt: skip
    rollout = RolloutConfig(temperature=args.temperature, max_new_tokens=args.max_new_tokens,
                            threads_per_worker=args.threads, **switches)  # fmt: skip
    worker = RolloutWorker(choice, rollout, record_routing=record_routing)

    async def main():
        await worker.set_weights((VERSION, weights))
        await worker.rollout_group(_requests(args, 1000)[0])  # warm-up: cost-model measurement, allocator
        stats0 = dict(worker.engine.stats)
        t0 = time.perf_counter()
        trajs = []
        for reqs in _requests(args, 0):
            trajs += await worker.rollout_group(reqs)
        return trajs, time.perf_counter() - t0, stats0

    trajs, seconds, stats0 = asyncio.run(main())
    delta = {k: worker.engine.stats[k] - stats0[k] for k in stats0}
    total: dict[str, float] = {}
    for t in trajs:
        for k, v in t.rollout_stats.items():
            total[k] = total.get(k, 0.0) + v
    generated = sum(t.n_generated for t in trajs)
    lookups = total.get("prefix_global_hit", 0.0) + total.get("prefix_global_miss", 0.0)
    record = {
        "episodes": len(trajs), "seconds": round(seconds, 3), "episodes_per_s": len(trajs) / seconds,
        "generated_tokens": generated, "tokens_per_s": generated / seconds,
        "tokens_fed": delta["tokens_fed"], "replay_tokens": delta["replay_tokens"],
        "forward_calls": delta["forward_calls"],
        "prefix_hit_rate": total.get("prefix_global_hit", 0.0) / lookups if lookups else None,
        "cache_bytes_per_token": sum(t.rollout_stats["cache_bytes_per_token"] * len(t) for t in trajs)
        / sum(len(t) for t in trajs),
    }  # fmt: skip
    if "spec_drafted" in total:
        steps = total["spec_steps"] + total["spec_plain_steps"]
        record |= {"dspark_drafting_frac": total["spec_steps"] / max(steps, 1),
                   "dspark_acceptance": total["spec_accepted"] / total["spec_drafted"] if total["spec_drafted"]
                   else None}  # fmt: skip
    return trajs, record


def mismatch(choice: ModelChoice, weights: dict, trajs, replay: bool, routing: bool, temperature: float) -> dict:
    from rl.learner import Learner

    policy, _ = build_model(choice, seed=0)
    policy.load_state_dict(weights)
    n_tok = max(len(t) for t in trajs)
    # the learner's log-probs at the temperature the rollout sampled at (as JobConfig sets it)
    cfg = TrainerConfig(kind="rl", simulate_replay=replay, routing_replay=routing, micro_batch_tokens=n_tok,
                        global_batch_tokens=n_tok, optim=OptimConfig(),
                        policy_loss=PolicyLossConfig(temperature=temperature))  # fmt: skip
    learner = Learner(policy, cfg)
    sums = [same_version_mismatch(learner.logprobs(b), b.logprobs, b.versions, b.loss_mask, VERSION)
            for b in pack_for_learner(trajs, cfg)]  # fmt: skip
    return mismatch_means(sums)


def wire_format() -> dict:
    """Tokens of one generated tool-call block (the call and the turn's <|end|>) for typical calls."""
    from model.chat_template import ChatTemplate
    from model.tokenizer import Tokenizer

    template = ChatTemplate(Tokenizer.default())
    calls = {"view": {"path": "src/calc.py"}, "edit": {"path": "src/calc.py", "old": "a - b", "new": "a + b"},
             "run_tests": {}, "submit": {}, "bash": {"command": "ls -la"}}  # fmt: skip
    per_call = {}
    for name, arguments in calls.items():
        msg = {"role": "assistant", "content": None, "tool_calls": [{"name": name, "arguments": arguments}]}
        body = template.generation_ids(msg)
        values = sum(len(template.tokenizer.encode(str(v))) for v in arguments.values())
        per_call[name] = {"tokens": len(body), "name_and_values": len(template.tokenizer.encode(name)) + values}
    overhead = [c["tokens"] - c["name_and_values"] for c in per_call.values()]
    return {"kind": "wire_format", "per_call": per_call, "framing_tokens_min": min(overhead),
            "framing_tokens_max": max(overhead)}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flavor", default="tiny")
    p.add_argument("--checkpoint", default=None, help="model.safetensors of trained weights (default: seeded init)")
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--configs", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    choice = ModelChoice(flavor=args.flavor, overrides=dict(TOKENIZER_FIT))
    model, _ = build_model(choice, seed=1)
    if args.checkpoint:
        from model.checkpoint import load_checkpoint

        load_checkpoint(model, args.checkpoint)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    meta = {"flavor": args.flavor, "groups": args.groups, "group_size": args.group_size, "turns": args.turns,
            "max_new_tokens": args.max_new_tokens, "threads": args.threads, "loadavg": os.getloadavg()[0]}
    print(json.dumps(wire_format()), flush=True)
    for name in args.configs:
        _, record = run_config(choice, weights, CONFIGS[name], args)
        print(json.dumps({"kind": "rollout", "features": name, **CONFIGS[name], **record, **meta}), flush=True)
    if "default" in args.configs:
        # the default path again, recording each token's experts, so routing replay has something to replay
        trajs, record = run_config(choice, weights, CONFIGS["default"], args, record_routing=True)
        print(json.dumps({"kind": "rollout", "features": "default+record_routing", **CONFIGS["default"], **record,
                          **meta}), flush=True)  # fmt: skip
        for replay in (True, False):
            for routing in (True, False):
                m = mismatch(choice, weights, trajs, replay, routing, args.temperature)
                print(json.dumps({"kind": "mismatch", "simulate_replay": replay, "routing_replay": routing,
                                  "rollout": "default+record_routing", **m, **meta}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
