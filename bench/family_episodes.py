"""Family episodes in sandboxes: how fast a scripted policy runs the demo's multi-turn tasks, and what
each turn costs in tokens. Prints one JSON line per measurement.

Measures, on family-A tasks of synth/families.py in their image:
- `tokens`: the system turn with the tool schemas, the task statement, and each tool call and its
  observation in the chat template's wire format (model/chat_template.py, the default tokenizer);
- `tool_call`: wall time per tool (run_tests through tests/check.py, edit on a line, submit);
- `episodes`: scripted episodes (view -> edit -> run_tests -> submit) per second, either each in a
  fresh sandbox (what RL and evaluation episodes get, envs/pool.py SandboxPool) or in warm sandboxes
  reset between episodes (the demonstration replay, synth.taskset_sources.WarmSandboxes), with
  `--concurrency` at once; grading is not included (envs/batch_grading.py and bench/grading.py measure it).
Not a test: it asserts nothing beyond every scripted episode ending in submit.

Usage: python -m bench.family_episodes [--episodes 16] [--concurrency 2] [--modes warm fresh]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from collections import defaultdict

from envs import engine


def emit(metric: str, **fields) -> None:
    # The 1-minute load average tells whether other work shared the machine during a measurement.
    print(json.dumps({"metric": metric, **fields, "loadavg_1m": round(os.getloadavg()[0], 1)}), flush=True)


def token_costs(demo_messages: list[dict]) -> None:
    """Tokens of one demonstration as its episodes render it: the family tasks' tools in the system turn."""
    from envs.tools import tool_schemas
    from model.chat_template import ChatTemplate
    from model.tokenizer import Tokenizer
    from synth.families import FAMILY_TOOLS

    template, tools = ChatTemplate(Tokenizer.default()), tool_schemas(FAMILY_TOOLS)
    system = template.render(demo_messages[:1], tools=tools).token_ids
    whole = template.render(demo_messages, tools=tools)
    per_turn = defaultdict(list)
    for span in whole.turn_spans[1:]:
        msg = demo_messages[span.message_index]
        name = msg["tool_calls"][0]["name"] if span.role == "assistant" else msg.get("name", span.role)
        per_turn[f"{span.role}:{name}"].append(span.end - span.start)
    emit("tokens", system_with_tools=len(system), whole_episode=len(whole.token_ids),
         assistant=sum(whole.loss_mask), per_turn={k: max(v) for k, v in per_turn.items()})  # fmt: skip


async def _episodes(jobs, factory, concurrency: int):
    from synth.taskset_sources import _replay

    sem = asyncio.Semaphore(concurrency)

    async def one(task, script):
        async with sem:
            return await _replay(task, script, sandbox_factory=factory)

    return await asyncio.gather(*(one(t, s) for t, s in jobs))


def run_mode(mode: str, jobs, concurrency: int) -> list:
    from envs.episode import default_sandbox
    from synth.taskset_sources import WarmSandboxes

    warm = WarmSandboxes(jobs[0][0].image, concurrency) if mode == "warm" else None
    t0 = time.perf_counter()
    try:
        results = asyncio.run(_episodes(jobs, warm.lend if warm else default_sandbox, concurrency))
    finally:
        if warm:
            warm.close()
    wall = time.perf_counter() - t0
    ok = sum(r.transcript.termination == "submit" for r in results)
    assert ok == len(results), [r.transcript.termination for r in results]
    setup = [r.transcript.setup_s for r in results]
    emit("episodes", mode=mode, concurrency=concurrency, n=len(results), wall_s=round(wall, 2),
         episodes_per_s=round(len(results) / wall, 3), setup_p50_s=round(statistics.median(setup), 4),
         agent_p50_s=round(statistics.median(r.transcript.agent_s for r in results), 4))  # fmt: skip
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--episodes", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--modes", nargs="+", default=["warm", "fresh"], choices=["warm", "fresh"])
    args = p.parse_args()
    if not engine.engine_available():
        raise SystemExit("no Docker engine answers: run `bash infra/docker/ensure_engine.sh`")
    from synth.families import demo_splits, family_tasks
    from synth.taskset_sources import family_script

    insts = demo_splits(args.episodes, 0, 0, seed=11)["A_train"]
    tasks = family_tasks(insts)
    jobs = [(t, family_script(i)) for t, i in zip(tasks, insts, strict=True)]
    from synth.taskset_sources import _demo

    tools, first = defaultdict(list), None
    for mode in args.modes:
        results = run_mode(mode, jobs, args.concurrency)
        first = first or results[0]
        for res in results:
            for turn in res.transcript.turns:
                for call, r in zip(turn.calls, turn.results):
                    tools[call.name].append(r.duration_s)
    for name, xs in sorted(tools.items()):
        emit("tool_call", tool=name, n=len(xs), p50_s=round(statistics.median(xs), 4), max_s=round(max(xs), 4))
    token_costs(_demo(tasks[0], jobs[0][1], "gold", first.transcript).messages)


if __name__ == "__main__":
    main()
