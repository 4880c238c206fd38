"""flashpost-eval: held-out pass@1 and pass@k of a policy on a task set, through agent episodes.

Launch:
    flashpost-eval tasks=runs/factory/taskset checkpoint=runs/x/checkpoints/step-00000400/model.safetensors
    flashpost-eval tasks=toy checkpoint=runs/x samples=8 k=4     # a run folder: its latest checkpoint
    flashpost-eval tasks=families model=small cluster=h200 task_filter.families=[A]

Every task of the split (default heldout, conf/eval.yaml) runs `samples` episodes with the rollout
settings (sandbox rows: envs/episode.py in a Docker sandbox, graded in a pristine grader; toy rows:
in process) on one in-process rollout worker (rl/actors.py RolloutWorker, the engine trainers sample
with). pass@k is the unbiased estimator 1 - C(n-c, k) / C(n, k) over the n graded samples of a task, c
of them passing, averaged over tasks, overall and per family and source; infrastructure failures are
not samples (counted apart). Writes OUT/eval.json (with the episodes' throughput: episodes/s, generated
tokens/s, engine forwards and decode steps), OUT/eval.md and OUT/episodes.jsonl (every episode as
text). Not here: training, the format.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import defaultdict
from math import comb
from pathlib import Path

import hydra
from omegaconf import DictConfig
from tqdm import tqdm

from rl.config import EvalConfig, to_eval_config
from synth.taskset import TaskSetError

CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (k > n: the n samples' any-pass)."""
    if n == 0:
        return float("nan")
    k = min(k, n)
    return 1.0 - comb(n - c, k) / comb(n, k)


def checkpoint_file(path: str) -> Path:
    """A model.safetensors, or the latest checkpoint's of a run folder."""
    p = Path(path)
    latest = p / "checkpoints" / "latest"
    if p.is_dir() and latest.exists():
        p = p / "checkpoints" / latest.read_text().strip() / "model.safetensors"
    if not p.exists():
        raise FileNotFoundError(f"checkpoint={path}: no model.safetensors there (nor a run folder with "
                                "checkpoints/latest); pass a trainer's checkpoint file or its run_dir")
    return p


def episode_record(t, template) -> dict:
    """What an episode did, for reports: turns, the tools it called in order (parsed from its generated
    tokens as the episode parsed them), and its reward."""
    tools = [c.name for m in t.transcript if m.get("role") == "assistant" and m.get("token_ids")
             for c in template.parse_assistant(m["token_ids"]).tool_calls]  # fmt: skip
    return {"turns": len(t.turn_starts), "tools": tools, "reward": t.reward,
            "termination": t.verifier.get("termination"), "generated": t.n_generated}  # fmt: skip


def episode_transcript(t, template, sample: int) -> dict:
    """An episode as text, for reading what the policy did: each message's role and content (an assistant
    turn decoded from the tokens it generated), its reward and why it ended."""
    messages = [{"role": m.get("role"), "content": template.tokenizer.decode(m["token_ids"])
                 if m.get("token_ids") else m.get("content", "")} for m in t.transcript]  # fmt: skip
    return {"task_id": t.task_id, "sample": sample, "reward": t.reward, "infra_failed": t.infra_failed,
            "termination": t.verifier.get("termination"), "messages": messages}  # fmt: skip


def _summary(rows: list[dict]) -> dict:
    keys = ("pass@1", "pass@k")
    return {"tasks": len(rows), **{k: sum(r[k] for r in rows) / len(rows) if rows else float("nan") for k in keys}}


def throughput(episodes: int, wall_s: float, tokens: int, engine_before: dict, engine_after: dict) -> dict:
    """How fast an evaluation's episodes ran: episodes and generated tokens per second of the episodes'
    wall time (sandboxes and grading included), and the engine's forwards and decode steps, whose ratio
    shows how well the concurrent episodes shared forwards, and how many turns joined a running batch in
    place (the others rebuilt it)."""
    keys = ("forward_calls", "decode_steps", "rows_joined_in_place")
    steps = {k: engine_after.get(k, 0) - engine_before.get(k, 0) for k in keys}
    return {"episodes": episodes, "wall_s": round(wall_s, 2), "episodes_per_s": round(episodes / max(wall_s, 1e-9), 3),
            "tokens_generated": tokens, "tokens_per_s": round(tokens / max(wall_s, 1e-9), 1), **steps}


def evaluate(cfg: EvalConfig, progress: bool = True) -> dict:
    from rl.actors import RolloutWorker, build_model
    from rl.rollout import RolloutRequest
    from rl.tasks import episode_tasks, read

    ts = read(cfg.tasks, cfg.task_filter, cfg.split, progress=progress)
    payloads = episode_tasks(ts.tasks)
    worker = RolloutWorker(cfg.model, cfg.rollout, cfg.env)
    policy, template = build_model(cfg.model, seed=cfg.init_seed)
    if cfg.checkpoint:
        from model.checkpoint import load_checkpoint

        load_checkpoint(policy, checkpoint_file(cfg.checkpoint))
    weights = {k: v.detach().clone() for k, v in policy.state_dict().items()}
    del policy
    per_task, transcripts = [], []
    speed: dict[str, float] = {}

    async def run() -> None:
        await worker.set_weights((0, weights))
        engine0, tokens0, t0 = dict(worker.engine.stats), worker.tokens_generated, time.perf_counter()
        # every task's episodes in one rollout_group call: one batcher, so all of them decode in one batch
        # (env.max_concurrent sandboxes at a time) instead of one task's samples at a time
        reqs = [RolloutRequest(key=f"{row.id}/{m}", group_id=row.id, task_id=row.id, env=task["env"],
                               seed=cfg.seed * 1_000_003 + m, task=task["task"])
                for row, task in zip(ts.tasks, payloads) for m in range(cfg.samples)]  # fmt: skip
        # one bar over every episode of the batch, the pass count beside it
        bar = tqdm(total=len(reqs), desc=f"eval {cfg.split} episodes", unit="episode", disable=not progress)
        passed = 0

        def tick(t) -> None:
            nonlocal passed
            passed += bool(t.verifier.get("passed")) and not t.infra_failed
            bar.set_postfix(passed=passed, refresh=False)
            bar.update(1)

        try:
            done = await worker.rollout_group(reqs, on_episode=tick)
        finally:
            bar.close()
        speed.update(throughput(len(reqs), time.perf_counter() - t0, worker.tokens_generated - tokens0,
                                engine0, worker.engine.stats))  # fmt: skip
        for i, row in enumerate(ts.tasks):
            trajs = done[i * cfg.samples:(i + 1) * cfg.samples]
            transcripts.extend(episode_transcript(t, template, m) for m, t in enumerate(trajs))
            graded = [t for t in trajs if not t.infra_failed]
            c = sum(bool(t.verifier.get("passed")) for t in graded)
            per_task.append({"task_id": row.id, "family": row.family,
                             "source": row.source.get("repo") or row.source.get("generator", ""),
                             "samples": len(graded), "passed": c, "infra_failed": len(trajs) - len(graded),
                             "pass@1": pass_at_k(len(graded), c, 1), "pass@k": pass_at_k(len(graded), c, cfg.k),
                             "rewards": [t.reward for t in graded],
                             "episodes": [episode_record(t, template) for t in graded]})  # fmt: skip

    try:
        asyncio.run(run())
    finally:
        worker.close()
    scored = [r for r in per_task if r["samples"]]
    groups: dict[str, dict[str, list[dict]]] = {"family": defaultdict(list), "source": defaultdict(list)}
    for r in scored:
        groups["family"][r["family"]].append(r)
        groups["source"][r["source"]].append(r)
    report = {
        "tasks": cfg.tasks, "split": cfg.split, "checkpoint": cfg.checkpoint, "samples": cfg.samples, "k": cfg.k,
        "overall": _summary(scored), "unscored_tasks": [r["task_id"] for r in per_task if not r["samples"]],
        "by_family": {k: _summary(v) for k, v in sorted(groups["family"].items())},
        "by_source": {k: _summary(v) for k, v in sorted(groups["source"].items())},
        "throughput": speed, "per_task": per_task,
    }  # fmt: skip
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "eval.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "eval.md").write_text(markdown(report))
    with open(out / "episodes.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in transcripts)
    return report


def markdown(report: dict) -> str:
    k = report["k"]
    lines = [f"# flashpost-eval: `{report['tasks']}` ({report['split']})", "",
             f"checkpoint `{report['checkpoint'] or 'seeded initialisation'}`, {report['samples']} sample(s) per task; "
             f"pass@{k} is the unbiased estimator.", "",
             f"| group | tasks | pass@1 | pass@{k} |", "|---|---:|---:|---:|"]  # fmt: skip
    o = report["overall"]
    lines.append(f"| all | {o['tasks']} | {o['pass@1']:.3f} | {o['pass@k']:.3f} |")
    for kind in ("family", "source"):
        for name, s in report[f"by_{kind}"].items():
            lines.append(f"| {kind} {name} | {s['tasks']} | {s['pass@1']:.3f} | {s['pass@k']:.3f} |")
    if t := report.get("throughput"):
        lines += ["", f"{t['episodes']} episodes in {t['wall_s']:.1f} s ({t['episodes_per_s']:.2f} episodes/s, "
                  f"{t['tokens_per_s']:.1f} generated tokens/s; {t['forward_calls']} engine forwards, "
                  f"{t['decode_steps']} of them decode steps; {t.get('rows_joined_in_place', 0)} turns joined a "
                  "running batch in place)"]  # fmt: skip
    if report["unscored_tasks"]:
        lines += ["", f"Not scored (every sample an infrastructure failure): {', '.join(report['unscored_tasks'])}"]
    return "\n".join(lines) + "\n"


@hydra.main(config_path=CONF_DIR, config_name="eval", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from rl.cluster import apply_local_env

    ecfg = to_eval_config(cfg)
    apply_local_env()
    try:
        report = evaluate(ecfg)
    except (TaskSetError, FileNotFoundError) as e:  # bad input: the message names the fix; no traceback
        raise SystemExit(f"error: {e}") from None
    o = report["overall"]
    print(f"[flashpost-eval] {o['tasks']} task(s): pass@1 {o['pass@1']:.3f}, pass@{ecfg.k} {o['pass@k']:.3f} -> "
          f"{Path(ecfg.out_dir) / 'eval.json'}, eval.md")


if __name__ == "__main__":
    main()
