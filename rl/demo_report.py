"""The demo's report: report.md and PNG plots in the run folder, from the stages' done.json summaries.

Plots: RL reward over steps (per step and a moving average), held-out pass@1 per stage and family,
and wall time / throughput of each stage. Reads only what rl/stages.py recorded, so it can be
re-made for any finished run. Not here: computing any figure (the stages did).
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def _summary(run_dir: Path, name: str) -> dict | None:
    p = run_dir / name / "done.json"
    return json.loads(p.read_text()) if p.exists() else None


def _moving(xs: list[float], k: int = 10) -> list[float]:
    return [sum(xs[max(0, i - k + 1):i + 1]) / len(xs[max(0, i - k + 1):i + 1]) for i in range(len(xs))]


def make_report(run_dir: Path, out_dir: Path) -> dict:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    stages = {n: _summary(run_dir, n) for n in ("families", "eval_base", "sft", "eval_sft", "rl", "eval_rl")}
    evals = {label: stages[n]["summary"] for label, n in (("base", "eval_base"), ("SFT", "eval_sft"),
                                                          ("RL", "eval_rl")) if stages[n]}  # fmt: skip
    files = []

    if stages["rl"]:
        hist = stages["rl"]["summary"]["history"]
        steps, rewards = [h["step"] for h in hist], [h["reward"] for h in hist]
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(steps, rewards, ".", alpha=0.3, label="mean reward of the step's 32 samples")
        ax.plot(steps, _moving(rewards), "-", label="moving average (10 steps)")
        ax.set(xlabel="RL step", ylabel="reward (pass rate of samples)", title="GRPO on family B (real grading)")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out_dir / "rl_reward.png", dpi=100)
        plt.close(fig)
        files.append("rl_reward.png")

    if evals:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        labels = list(evals)
        for j, fam in enumerate(("A", "B")):
            vals = [evals[lab][fam] for lab in labels]
            xs = [i + (j - 0.5) * 0.38 for i in range(len(labels))]
            ax.bar(xs, vals, width=0.38, label=f"family {fam} ({'demonstrations' if fam == 'A' else 'tests only'})")
            for x, v in zip(xs, vals):
                ax.text(x, v + 0.01, f"{v:.2f}", ha="center", fontsize=8)
        ax.set_xticks(range(len(labels)), labels)
        ax.set(ylabel="held-out pass@1 (greedy)", ylim=(0, 1), title="Held-out pass@1 per stage")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out_dir / "pass_at_1.png", dpi=100)
        plt.close(fig)
        files.append("pass_at_1.png")

    timed = {n: s for n, s in stages.items() if s}
    if timed:
        fig, ax = plt.subplots(figsize=(6, 3.2))
        ax.barh(list(timed), [s["seconds"] for s in timed.values()])
        ax.set(xlabel="wall seconds", title="Stage times")
        fig.tight_layout()
        fig.savefig(out_dir / "stage_times.png", dpi=100)
        plt.close(fig)
        files.append("stage_times.png")

    lines = ["# flashpost demo report", "", f"Run folder: `{run_dir.resolve()}`", ""]
    if evals:
        lines += ["## Held-out pass@1 (greedy, real grading)", "", "| stage | family A (demonstrations) | "
                  "family B (tests only) |", "|---|---|---|"]
        lines += [f"| {lab} | {e['A']:.3f} (n={e['A_detail']['n']}) | {e['B']:.3f} (n={e['B_detail']['n']}) |"
                  for lab, e in evals.items()]
        lines += ["", "![pass@1](pass_at_1.png)", ""]
    if stages["sft"]:
        s = stages["sft"]["summary"]
        lines += ["## SFT on family A", "", f"{s['steps']} steps, {s['tokens']} tokens in {s['seconds']:.0f} s: "
                  f"**{s['tok_s']:.0f} training tokens/s**; loss {s['first_loss']:.2f} -> {s['last_loss']:.2f} "
                  f"(load average {s['load']:.1f}).", ""]
    if stages["rl"]:
        r = stages["rl"]["summary"]
        lines += ["## RL (GRPO) on family B", "",
                  f"{r['steps']} steps ({r['updates']} updates, {r['skipped_groups']} zero-spread groups skipped), "
                  f"{r['samples']} samples in {r['seconds']:.0f} s: **{r['samples_s']:.1f} samples/s**; "
                  f"{r['graded']} real gradings at **{r['gradings_s_while_grading']:.0f} gradings/s** while "
                  f"grading (generation {r['gen_s']:.0f} s, grading {r['grade_s']:.0f} s, training "
                  f"{r['train_s']:.0f} s; load average {r['load']:.1f}).", "", "![reward](rl_reward.png)", ""]
    if timed:
        lines += ["## Stage times", "", "| stage | seconds |", "|---|---|"]
        lines += [f"| {n} | {s['seconds']:.1f} |" for n, s in timed.items()]
        lines += ["", "![times](stage_times.png)", ""]
    lines += [f"Load average when the report was written: {os.getloadavg()[0]:.1f} (2-core machine: timings "
              "under load are pessimistic).", ""]
    (out_dir / "report.md").write_text("\n".join(lines))
    return {"report": str(out_dir / "report.md"), "plots": files,
            "pass_at_1": {lab: {"A": e["A"], "B": e["B"]} for lab, e in evals.items()}}
