"""The demo's report: report.md and PNG plots in the run folder, from the stages' done.json summaries.

Plots: held-out pass@1 per stage and family (base, SFT, RL, the OPD student, the SFT-only student),
RL reward over steps, DSpark acceptance over SFT and RL training, train/rollout log-prob mismatch
over RL steps, tokens/s per stage, and stage wall times. Reads only what rl/stages.py recorded, so it
can be re-made for any finished run. Not here: computing any figure (the stages did).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from rl.demo_config import TASK_FAMILIES

STAGES = (
    "sandbox_check",
    "families",
    "factory",
    "eval_base",
    "sft",
    "eval_sft",
    "rl",
    "eval_rl",
    "student_sft",
    "opd",
    "eval_opd",
    "eval_student_sft",
)
EVALS = (
    ("base", "eval_base"),
    ("SFT", "eval_sft"),
    ("RL", "eval_rl"),
    ("OPD student", "eval_opd"),
    ("SFT-only student", "eval_student_sft"),
)


def _summary(run_dir: Path, name: str) -> dict | None:
    p = run_dir / name / "done.json"
    return json.loads(p.read_text()) if p.exists() else None


def _moving(xs: list[float], k: int = 10) -> list[float]:
    return [sum(xs[max(0, i - k + 1) : i + 1]) / len(xs[max(0, i - k + 1) : i + 1]) for i in range(len(xs))]


def _save(fig, out_dir: Path, name: str, files: list[str]) -> None:
    fig.tight_layout()
    fig.savefig(out_dir / name, dpi=100)
    files.append(name)


def _fams(evals: dict) -> list[str]:
    """Families every evaluation scored (F only in runs with the factory stage)."""
    return [f for f in TASK_FAMILIES if all(f in e for e in evals.values())]


def _plot_pass(plt, evals: dict, out_dir: Path, files: list[str]) -> None:
    fig, ax = plt.subplots(figsize=(7.5, 3.6))
    labels, fams = list(evals), _fams(evals)
    width = 0.8 / len(fams)
    for j, fam in enumerate(fams):
        vals = [evals[lab][fam] for lab in labels]
        xs = [i + (j - (len(fams) - 1) / 2) * width for i in range(len(labels))]
        ax.bar(xs, vals, width=width, label=f"family {fam} ({TASK_FAMILIES[fam]})")
        for x, v in zip(xs, vals):
            ax.text(x, v + 0.01, f"{v:.2f}", ha="center", fontsize=7)
    ax.set_xticks(range(len(labels)), labels, fontsize=8)
    ax.set(ylabel="held-out pass@1 (greedy)", ylim=(0, 1), title="Held-out pass@1 per stage")
    ax.legend(fontsize=8)
    _save(fig, out_dir, "pass_at_1.png", files)
    plt.close(fig)


def _plot_rl(plt, rl: dict, out_dir: Path, files: list[str]) -> None:
    hist = rl["history"]
    steps, rewards = [h["step"] for h in hist], [h["reward"] for h in hist]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, rewards, ".", alpha=0.3, label="mean reward of the step's samples")
    ax.plot(steps, _moving(rewards), "-", label="moving average (10 steps)")
    ax.set(xlabel="RL step", ylabel="reward (pass rate of samples)", title="GRPO on family B (real grading)")
    ax.legend(fontsize=8)
    _save(fig, out_dir, "rl_reward.png", files)
    plt.close(fig)
    upd = [h for h in hist if h.get("mismatch_abs") is not None]
    if upd:
        fig, ax = plt.subplots(figsize=(6, 3.2))
        for lag, mark in ((0, "o"), (1, ".")):  # lag 0: same weights (numerics); lag 1: one update apart too
            pts = [h for h in upd if h.get("lag", 0) == lag]
            if pts:
                ax.plot([h["step"] for h in pts], [h["mismatch_abs"] for h in pts], mark,
                        label=f"mean |Δ log p| per token, lag {lag}")  # fmt: skip
                ax.plot([h["step"] for h in pts], [h["mismatch_k3"] for h in pts], mark, alpha=0.6,
                        label=f"KL estimate (k3), lag {lag}")  # fmt: skip
        ax.set_yscale("log")
        ax.set(xlabel="RL step", ylabel="rollout vs train log-prob", title="Train/rollout mismatch (GRPO updates)")
        ax.legend(fontsize=8)
        _save(fig, out_dir, "mismatch.png", files)
        plt.close(fig)


def _plot_dspark(plt, stages: dict, evals: dict, out_dir: Path, files: list[str]) -> None:
    fig, ax = plt.subplots(figsize=(6.5, 3.4))
    offset = 0
    if stages["sft"]:
        log = [d for d in stages["sft"]["summary"].get("log", []) if d.get("dspark_acceptance") is not None]
        ax.plot([d["step"] for d in log], [d["dspark_acceptance"] for d in log], "-", label="SFT (teacher-forced)")
        offset = stages["sft"]["summary"]["steps"]
    if stages["rl"]:
        hist = [h for h in stages["rl"]["summary"]["history"] if h.get("dspark_acceptance") is not None]
        ax.plot(
            [offset + h["step"] for h in hist],
            _moving([h["dspark_acceptance"] for h in hist]),
            "-",
            label="RL (teacher-forced on samples, moving avg)",
        )
    for lab, e in evals.items():
        acc = (e.get("speculative") or {}).get("acceptance")
        if acc is not None:
            x = {"base": 0, "SFT": offset}.get(lab, offset + (stages["rl"]["summary"]["steps"] if stages["rl"] else 0))
            ax.plot([x], [acc], "o", label=f"speculative decoding after {lab}: {acc:.2f}")
    ax.set(
        xlabel="training step (SFT, then RL)",
        ylabel="draft acceptance",
        ylim=(0, 1),
        title="DSpark acceptance over training",
    )
    ax.legend(fontsize=7)
    _save(fig, out_dir, "dspark_acceptance.png", files)
    plt.close(fig)


def _throughput(stages: dict, evals: dict) -> list[tuple[str, float, str]]:
    rows = []
    if stages["sft"]:
        rows.append(("SFT (teacher)", stages["sft"]["summary"]["tok_s"], "training tokens/s"))
    if stages["rl"] and "gen_tok_s" in stages["rl"]["summary"]:
        rows.append(("RL rollout", stages["rl"]["summary"]["gen_tok_s"], "sampled tokens/s while generating"))
    if stages["student_sft"]:
        rows.append(("SFT (student)", stages["student_sft"]["summary"]["tok_s"], "training tokens/s"))
    if stages["opd"]:
        rows.append(("OPD (student)", stages["opd"]["summary"]["sampled_tok_s"], "distilled sampled tokens/s"))
    for lab, e in evals.items():
        tok = [e[f"{f}_detail"].get("gen_tok_s") for f in ("A", "B")]
        if all(t is not None for t in tok):
            rows.append((f"eval {lab}", sum(tok) / 2, "greedy generated tokens/s"))
    return rows


def make_report(run_dir: Path, out_dir: Path) -> dict:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    stages = {n: _summary(run_dir, n) for n in STAGES}
    evals = {label: stages[n]["summary"] for label, n in EVALS if stages[n]}
    files: list[str] = []
    if evals:
        _plot_pass(plt, evals, out_dir, files)
    if stages["rl"]:
        _plot_rl(plt, stages["rl"]["summary"], out_dir, files)
    if stages["sft"] or stages["rl"]:
        _plot_dspark(plt, stages, evals, out_dir, files)
    tput = _throughput(stages, evals)
    if tput:
        fig, ax = plt.subplots(figsize=(6.5, 3.2))
        ax.barh([t[0] for t in tput], [t[1] for t in tput])
        ax.set(xlabel="tokens/s", title=f"Throughput per stage ({_device(evals)})")
        _save(fig, out_dir, "tokens_per_s.png", files)
        plt.close(fig)
    timed = {n: s for n, s in stages.items() if s}
    if timed:
        fig, ax = plt.subplots(figsize=(6, 3.6))
        ax.barh(list(timed), [s["seconds"] for s in timed.values()])
        ax.set(xlabel="wall seconds", title="Stage times")
        _save(fig, out_dir, "stage_times.png", files)
        plt.close(fig)
    lines = _markdown(run_dir, stages, evals, tput, files)
    (out_dir / "report.md").write_text("\n".join(lines))
    return {
        "report": str(out_dir / "report.md"),
        "plots": files,
        "pass_at_1": {lab: {f: e[f] for f in _fams(evals)} for lab, e in evals.items()},
    }


def _device(evals: dict) -> str:
    """Where the policy ran (eval summaries record it; older runs: 2 CPU threads)."""
    return next((e["device"] for e in evals.values() if e.get("device")), "cpu, 2 threads")


def _markdown(run_dir: Path, stages: dict, evals: dict, tput: list, files: list[str]) -> list[str]:
    lines = ["# flashpost demo report", "", f"Run folder: `{run_dir.resolve()}`; device: {_device(evals)}", ""]
    fams = _fams(evals)
    if evals:
        lines += [
            "## Held-out pass@1 (greedy, real grading)",
            "",
            "| stage | parameters (no drafter) | "
            + " | ".join(f"family {f} ({TASK_FAMILIES[f]})" for f in fams) + " |",
            "|---|---|" + "---|" * len(fams),
        ]
        lines += [
            f"| {lab} | {e.get('params', '')} | " + " | ".join(f"{e[f]:.3f} (n={e[f + '_detail']['n']})" for f in fams)
            + " |"
            for lab, e in evals.items()
        ]
        lines += [
            "",
            "Seed-to-seed spread of these numbers: README (`make demo` at seeds 0, 1, 2: `trainer.seed=N`).",
            "",
            "![pass@1](pass_at_1.png)",
            "",
        ]
    if stages["factory"] and not stages["factory"]["summary"].get("off"):
        f = stages["factory"]["summary"]
        from synth.runner import STAGES as FACTORY_STAGES  # the funnel in stage order (done.json sorts keys)

        funnel = ", ".join(f"{st.NAME} {f['funnel'][st.NAME].get('out', '?')}" for st in FACTORY_STAGES
                           if st.NAME in f["funnel"])  # fmt: skip
        lines += [
            "## Family F: the environment factory on the sample repository",
            "",
            f"The factory's six stages built and verified {f['factory_tasks']} tasks in {f['factory_seconds']:.0f} s "
            f"(records out per stage: {funnel}; search solver pass rate {f['search_solver_pass_rate']}). "
            f"{f['F_train']} became train tasks (the solver's fix is an SFT demonstration) and {f['F_heldout']} "
            f"held-out tasks, graded with the repository's whole test suite; {len(f['left_out'])} left out "
            f"(not one short edit inside one short function: {sorted(set(f['left_out'].values()))}).",
            "",
        ]
    if stages["sft"]:
        s = stages["sft"]["summary"]
        lines += [
            "## SFT on family A" + (" (and family F's train demonstrations)" if stages["factory"]
                                    and stages["factory"]["summary"].get("F_train") else ""),
            "",
            f"{s['steps']} steps, {s['tokens']} tokens in {s['seconds']:.0f} s: "
            f"**{s['tok_s']:.0f} training tokens/s**; loss {s['first_loss']:.2f} -> {s['last_loss']:.2f} "
            f"(load average {s['load']:.1f}).",
            "",
        ]
    if stages["rl"]:
        r = stages["rl"]["summary"]
        lines += [
            "## RL (GRPO) on family B",
            "",
            f"{r['steps']} steps ({r['updates']} updates, {r['skipped_groups']} zero-spread groups skipped), "
            f"{r['samples']} samples in {r['seconds']:.0f} s: **{r['samples_s']:.1f} samples/s**; "
            f"{r['graded']} real gradings at **{r['gradings_s_while_grading']:.0f} gradings/s** while "
            f"grading (the rollout worker generated for {r['gen_s']:.0f} s, of which the learner waited "
            f"{r.get('gen_wait_s', r['gen_s']):.0f} s: asynchronous, max policy lag {r.get('max_policy_lag', 0)}; "
            f"grading {r['grade_s']:.0f} s, training {r['train_s']:.0f} s; load average {r['load']:.1f}).",
            "",
            "![reward](rl_reward.png)",
            "",
        ]
        if "mismatch.png" in files:
            lines += [
                "Train/rollout mismatch: the rollout worker's log-probs of the sampled tokens (KV-cached "
                "decode) against the learner's teacher-forced forward before each update. At lag 0 the "
                "weights are the same (numerics only); at lag 1 the batch was sampled one update earlier, "
                "so the difference also holds that update (corrected by the truncated importance weight).",
                "",
                "![mismatch](mismatch.png)",
                "",
            ]
    if stages["opd"] and "OPD student" in evals:
        o, st = stages["opd"]["summary"], stages["student_sft"]["summary"]
        e_o, e_s = evals["OPD student"], evals.get("SFT-only student")
        lines += [
            "## OPD: a half-width student distilled from the RL'd policy",
            "",
            f"The SFT-only student is trained by SFT alone on family A ({st['steps']} steps, "
            f"{st['seconds']:.0f} s, final loss {st['last_loss']:.2f}). The OPD student continues from it for "
            f"{o['seconds']:.0f} s of on-policy reverse-KL distillation from the RL'd policy on families A and B "
            f"({o['steps']} steps, {o['sampled_tokens']} sampled tokens, reverse KL {o['first_kl']:.3f} -> "
            f"{o['last_kl']:.3f}, plus an SFT term on family-A demonstrations).",
            "",
        ]
        if e_s:
            lines += [
                "| student | family A | family B |",
                "|---|---|---|",
                f"| OPD | {e_o['A']:.3f} | {e_o['B']:.3f} |",
                f"| SFT only | {e_s['A']:.3f} | {e_s['B']:.3f} |",
                "",
            ]
    if "dspark_acceptance.png" in files:
        acc = {lab: (e.get("speculative") or {}).get("acceptance") for lab, e in evals.items()}
        acc = ", ".join(f"{lab} {a:.2f}" for lab, a in acc.items() if a is not None)
        lines += [
            "## DSpark drafter",
            "",
            "Trained with the policy's SFT (its alignment term on assistant tokens) "
            "and kept aligned during RL (the same term on sampled tokens). Acceptance of drafted tokens in "
            f"greedy speculative decoding of held-out prompts: {acc}.",
            "",
            "![dspark](dspark_acceptance.png)",
            "",
        ]
    if tput:
        lines += ["## Throughput", "", "| stage | tokens/s | what |", "|---|---|---|"]
        lines += [f"| {n} | {v:.0f} | {w} |" for n, v, w in tput]
        lines += ["", "![tokens/s](tokens_per_s.png)", ""]
    timed = {n: s for n, s in stages.items() if s}
    if timed:
        lines += ["## Stage times", "", "| stage | seconds |", "|---|---|"]
        lines += [f"| {n} | {s['seconds']:.1f} |" for n, s in timed.items()]
        lines += [f"| all | {sum(s['seconds'] for s in timed.values()):.1f} |", "", "![times](stage_times.png)", ""]
    lines += [
        f"Load average when the report was written: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPU cores "
        "(timings taken under load are pessimistic).",
        "",
    ]
    return lines
