"""The demo's report: run_dir/report/report.md and PNG plots, from the jobs' own outputs.

Reads each evaluation's eval.json (held-out pass@1 per family, every episode's turns and tool calls),
each training job's metrics.jsonl (reward, train/rollout log-prob mismatch, DSpark acceptance, tokens/s,
samples/s) and each stage's done.json (wall time), so it can be re-made for any run folder:
`python -m rl.demo_report runs/demo`. Not here: computing any figure (the jobs did).
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import Counter
from pathlib import Path

EVALS = (("base", "eval_base"), ("SFT", "eval_sft"), ("RL", "eval_rl"), ("OPD student", "eval_opd"),
         ("SFT-only student", "eval_student_sft"))  # fmt: skip
TRAIN = ("sft", "rl", "student_sft", "opd")
EDITS = ("edit", "create", "bash")  # tools that change the workspace


def _json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


def _metrics(run_dir: Path, stage: str) -> list[dict]:
    p = run_dir / stage / "metrics.jsonl"
    if not p.exists():
        return []
    by_step: dict[int, dict] = {}  # a resumed job appends again from its checkpoint: keep the last record
    for line in p.read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            by_step[int(r["step"])] = r
    return [by_step[k] for k in sorted(by_step)]


def episode_stats(report: dict) -> dict:
    """Turns per episode, tool-call mix, and how often the agent read a test result before its last edit."""
    eps = [e for t in report["per_task"] for e in t.get("episodes", [])]
    if not eps:
        return {"episodes": 0}
    mix = Counter(name for e in eps for name in e["tools"])
    looked = 0
    for e in eps:
        edits = [i for i, n in enumerate(e["tools"]) if n in EDITS]
        looked += bool(edits) and "run_tests" in e["tools"][: edits[-1]]
    return {"episodes": len(eps), "turns_median": statistics.median(e["turns"] for e in eps),
            "tool_calls_median": statistics.median(len(e["tools"]) for e in eps), "tool_mix": dict(mix.most_common()),
            "tests_read_before_last_edit": looked / len(eps),
            "submitted": sum(e["termination"] == "submit" for e in eps) / len(eps)}  # fmt: skip


def _mean(rows: list[dict], key: str) -> float | None:
    xs = [r[key] for r in rows if key in r]
    return sum(xs) / len(xs) if xs else None


def _fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def _per_wall_s(rows: list[dict], key: str) -> float | None:
    """The job's total of `key` over its wall time: a mean of per-step rates would weigh a step that took
    buffered episodes in a millisecond like one that waited a minute for its own."""
    wall = rows[-1].get("wall_s")
    if not wall or not any(key in r for r in rows):
        return None
    return sum(r.get(key, 0) for r in rows) / wall


def _train_row(stage: str, rows: list[dict]) -> str:
    rew = [r["reward_mean"] for r in rows if "reward_mean" in r]
    acc = [r["dspark_acceptance"] for r in rows if "dspark_acceptance" in r]
    cells = [stage, f"{rows[-1]['step']:.0f}", _fmt(rows[-1].get("wall_s"), ".0f"),
             _fmt(_mean(rows, "learner_tokens_per_s"), ".0f"), _fmt(_per_wall_s(rows, "rollout_tokens"), ".0f"),
             _fmt(_per_wall_s(rows, "trajectories"), ".2f"),
             f"{_fmt(rew[0] if rew else None, '.2f')} → {_fmt(rew[-1] if rew else None, '.2f')}",
             _fmt(_mean(rows, "mismatch_k3"), ".4f"), _fmt(acc[-1] if acc else None, ".2f")]  # fmt: skip
    return "| " + " | ".join(cells) + " |"


def _plots(run_dir: Path, out: Path, evals: dict, train: dict) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    fams = sorted({f for e in evals.values() for f in e["by_family"]})
    if evals and fams:
        fig, ax = plt.subplots(figsize=(7, 3.5))
        width = 0.8 / len(fams)
        for j, fam in enumerate(fams):
            ys = [e["by_family"].get(fam, {}).get("pass@1", 0.0) for e in evals.values()]
            ax.bar([i + j * width for i in range(len(evals))], ys, width, label=f"family {fam}")
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(evals))], list(evals), fontsize=8)
        ax.set_ylabel("held-out pass@1")
        ax.legend(fontsize=8)
        files.append(_save(fig, out, "pass_at_1.png"))
    for name, key, stages in (("rl_reward.png", "reward_mean", ("rl",)), ("mismatch.png", "mismatch_k3", ("rl",)),
                              ("dspark_acceptance.png", "dspark_acceptance", TRAIN)):  # fmt: skip
        series = {s: [(r["step"], r[key]) for r in train[s] if key in r] for s in stages if train.get(s)}
        series = {s: v for s, v in series.items() if v}
        if not series:
            continue
        fig, ax = plt.subplots(figsize=(6, 3))
        for s, pts in series.items():
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", label=s)
        ax.set_xlabel("step")
        ax.set_ylabel(key)
        ax.legend(fontsize=8)
        files.append(_save(fig, out, name))
    times = {n: _json(run_dir / n / "done.json") for n in _stage_names(run_dir)}
    times = {n: d["seconds"] for n, d in times.items() if d}
    if times:
        fig, ax = plt.subplots(figsize=(7, 3.5))
        ax.barh(list(times), list(times.values()))
        ax.set_xlabel("seconds")
        ax.invert_yaxis()
        files.append(_save(fig, out, "stage_times.png"))
    plt.close("all")
    return files


def _save(fig, out: Path, name: str) -> str:
    fig.tight_layout()
    fig.savefig(out / name, dpi=100)
    return name


def _stage_names(run_dir: Path) -> list[str]:
    done = sorted(run_dir.glob("*/done.json"), key=lambda p: p.stat().st_mtime)
    return [p.parent.name for p in done]


def make_report(run_dir: Path, out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    evals = {label: r for label, stage in EVALS if (r := _json(run_dir / stage / "eval.json"))}
    train = {s: _metrics(run_dir, s) for s in TRAIN}
    demo = _json(run_dir / "demo.json") or {}
    fams = sorted({f for e in evals.values() for f in e["by_family"]})
    lines = ["# flashpost demo report", "", f"Run folder `{run_dir}`; every job's command: `commands.md` there.", "",
             "## Held-out pass@1", "", "| stage | " + " | ".join(f"family {f}" for f in fams) + " | all |",
             "|---|" + "---:|" * (len(fams) + 1)]  # fmt: skip
    for label, r in evals.items():
        cells = [_fmt(r["by_family"].get(f, {}).get("pass@1")) for f in fams]
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {_fmt(r['overall']['pass@1'])} |")
    lines += ["", "## Episodes (held-out evaluations)", "",
              "| stage | episodes | median turns | median tool calls | read tests before last edit | submitted "
              "| tool mix | episodes/s | tokens/s |",
              "|---|---:|---:|---:|---:|---:|---|---:|---:|"]  # fmt: skip
    episodes = {}
    for label, r in evals.items():
        e = episodes[label] = episode_stats(r)
        if e["episodes"]:
            mix = ", ".join(f"{k} {v}" for k, v in e["tool_mix"].items())
            speed = r.get("throughput", {})
            lines.append(f"| {label} | {e['episodes']} | {e['turns_median']} | {e['tool_calls_median']} | "
                         f"{e['tests_read_before_last_edit']:.2f} | {e['submitted']:.2f} | {mix} | "
                         f"{_fmt(speed.get('episodes_per_s'), '.2f')} | {_fmt(speed.get('tokens_per_s'), '.1f')} |")
    lines += ["", "## Training jobs", "",
              "| job | steps | wall s | learner tokens/s | rollout tokens per wall s | episodes per wall s "
              "| reward (first → last) | mismatch k3 | DSpark acceptance (teacher-forced, last) |",
              "|---|---:|---:|---:|---:|---:|---|---:|---:|"]  # fmt: skip
    lines += [_train_row(s, rows) for s, rows in train.items() if rows]
    lines += ["", "## Stage times", "", "| stage | seconds | load avg (1 min) at its end |", "|---|---:|---:|"]
    for n in _stage_names(run_dir):
        d = _json(run_dir / n / "done.json")
        lines.append(f"| {n} | {d['seconds']:.0f} | {_fmt(d['summary'].get('load'), '.1f')} |")
    url = demo.get("dashboard_url")
    lines += ["", "## Watching a run", "",
              f"Ray dashboard: {url or 'off (cluster.include_dashboard=false)'}; Ray's token authentication is on, "
              "so it asks for the token in `~/.ray/auth_token` (`ray get-auth-token`). The demo's actors are on its "
              "Actors page and the `flashpost_*` metrics on its Metrics page. TensorBoard: "
              f"`tensorboard --logdir {run_dir}` (each training job writes `<job>/tb`)."]  # fmt: skip
    if (out / "dashboard_actors.png").exists():
        lines += ["", "![Ray dashboard, actors page](dashboard_actors.png)"]
    files = _plots(run_dir, out, evals, train)
    lines += ["", *[f"![{f}]({f})" for f in files]]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    pass_at_1 = {label: {f: round(s["pass@1"], 3) for f, s in r["by_family"].items()} for label, r in evals.items()}
    return {"report": str(out / "report.md"), "pass_at_1": pass_at_1, "episodes": episodes, "plots": files}


if __name__ == "__main__":
    run = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/demo")
    print(make_report(run, run / "report")["report"])
