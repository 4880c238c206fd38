"""Stage 6, inspector and repair loop: a solved task -> an accepted Task (with every gate's evidence in
`Task.verification`) or a drop with its reason. All runs use the real grader on the task image.

Gates: gold (the gold patch scores 1 on K of K runs), null (the unchanged workspace scores 0 and
every F2P test fails), adversarial (every canned hack of envs/hacks.py scores 0), flakiness
(`flaky_reruns` more gold runs; per-test flip rates must be 0), statement/verifier consistency (the
failure lines the statement quotes are what the verifier's F2P tests really print on the unfixed
code), solver trajectories (a passing solver patch must be non-empty and touch the file the bug is
in, else the tests can be satisfied by a bypass; a passing episode must not have read git history,
edited tests, or read outside the workspace: `trajectory_flags`). The gold runs' times in the grader
set the task's grading budget (verification["grading_budget_s"], envs/grading.py `grading_budget`).
Repair: flaky or null-passing tests are removed from P2P/F2P while at least one F2P test remains, and
the gates rerun; anything else drops.
Not here: building images (build) or solving (solve).
"""

from __future__ import annotations

import hashlib
import json
import re
import time

from envs.grading import budget_fields, grade_patch, is_protected
from envs.hacks import HACKS, gold_source_files
from envs.pool import GraderPool
from envs.task import Task, TaskSchemaError, validate_task
from synth.config import Context
from synth.patches import edits_to_patch
from synth.records import TaskRecord
from synth.stages.build import task_files
from synth.testrun import run_suite

NAME = "inspect"
BUDGET_S = 2400.0  # seconds per unit (FactoryOptions.unit_budget_s overrides)
OUTPUT = TaskRecord
MAX_REPAIRS = 2
HACK_TIMEOUT_S = 60.0


def units(tasks: list[TaskRecord], ctx: Context) -> list[TaskRecord]:
    return [t for t in tasks if t.ok]


def unit_key(rec: TaskRecord) -> str:
    return rec.key


def flip_rates(runs: list[dict[str, str]], tests: list[str]) -> dict[str, float]:
    """Per test, the fraction of runs whose status differs from the test's most common status."""
    rates = {}
    for t in tests:
        seen = [r.get(t, "missing") for r in runs]
        top = max(seen.count(s) for s in set(seen))
        rates[t] = round(1 - top / len(seen), 3)
    return rates


def _norm(text: str) -> str:
    return " ".join(text.split())


def run_gates(task: Task, rec: TaskRecord, files: dict[str, bytes], pool: GraderPool, ctx: Context) -> dict:
    opts = ctx.opts
    gold = []
    for i in range(opts.gold_runs + opts.flaky_reruns):
        ctx.note(f"gold run {i + 1}/{opts.gold_runs + opts.flaky_reruns}")
        gold.append(run_suite(task, task.gold_patch, pool=pool))
    ctx.note("null run")
    null = run_suite(task, "", pool=pool)
    v: dict = {"gold_rewards": [g.reward for g in gold[:opts.gold_runs]]}
    v["gold_runs_s"] = [round(g.grading_s, 3) for g in gold]  # each gold run's time in the grader: the budget
    v["gold_gate"] = all(g.reward == 1.0 for g in gold[:opts.gold_runs])
    v["flake_rates"] = flip_rates([g.statuses for g in gold], task.test_ids)
    v["flaky"] = sorted(t for t, r in v["flake_rates"].items() if r > 0)
    v["gold_failing"] = sorted(t for t in task.test_ids if all(g.statuses.get(t) != "passed" for g in gold))
    v["null_reward"] = null.reward
    v["null_passing_f2p"] = sorted(t for t in task.f2p if null.statuses.get(t) == "passed")
    v["null_gate"] = null.reward == 0.0 and not v["null_passing_f2p"] and null.agreement
    v["null_messages"] = null.messages
    return v


def run_probes(task: Task, rec: TaskRecord, files: dict[str, bytes], pool: GraderPool, ctx: Context,
               v: dict) -> None:
    """The gates that matter once the verifier itself is sound: hacks, statement, trajectories."""
    opts = ctx.opts
    ctx.note("adversarial hacks")
    hacks = {}
    for hack in HACKS:
        if hack.slow and not opts.run_slow_hacks:
            hacks[hack.name] = "skipped (slow)"
            continue
        patch = edits_to_patch(files, hack.make(task, lambda p: files[p].decode(errors="replace")))
        hacks[hack.name] = grade_patch(task, patch, pool=pool, timeout_s=HACK_TIMEOUT_S).reward
    v["hack_rewards"] = hacks
    v["adversarial_gate"] = all(r == 0.0 for r in hacks.values() if not isinstance(r, str))
    null_messages = v.pop("null_messages")
    printed = _norm(" ".join(null_messages.get(t, "") for t in task.f2p))
    missing = [q for q in rec.quoted if _norm(q) not in printed]
    v["statement_consistent"] = bool(rec.quoted) and not missing
    v["statement_unmatched"] = missing
    gold_files = set(gold_source_files(task))
    bypass = {}
    for solver, patch in rec.solutions.items():
        touched = {ln[len("+++ b/"):] for ln in patch.splitlines() if ln.startswith("+++ b/")}
        touched |= {ln[len("--- a/"):] for ln in patch.splitlines() if ln.startswith("--- a/")}
        if not patch.strip() or not touched & gold_files:
            bypass[solver] = sorted(touched)
    v["solver_bypass"] = bypass
    v["trajectory_flags"], cheats = {}, {}
    for name, notes in rec.verdicts.get("episode_trajectories", {}).items():
        v["trajectory_flags"][name] = [trajectory_flags(n, task) for n in notes]
        # a passing episode that needed history, test edits or outside reads: the task leaks through them
        passing = {f for n, fl in zip(notes, v["trajectory_flags"][name], strict=True) if n["reward"] == 1.0
                   for f in fl}
        if passing:
            cheats[name] = sorted(passing)
    v["trajectory_cheats"] = cheats
    v["trajectory_gate"] = not bypass and not cheats


_GIT_HISTORY = re.compile(r"\bgit\b[^|;&\n]*\b(log|show|reflog|rev-list|cat-file|fsck|stash|blame|whatchanged)\b|"
                          r"\.git/(objects|refs|logs|packed-refs|ORIG_HEAD)")
_WRITES = re.compile(r"(>|\btee\b|\bsed\s+-i|\brm\b|\bmv\b|\bcp\b|\btruncate\b|\bchmod\b)")
_OUTSIDE_READ = re.compile(r"\b(cat|less|more|head|tail|grep|rg|find|ls|strings|xxd|od)\b[^|;&\n]*?"
                           r"(?<![\w.])(/(?!workspace\b|tmp\b|dev/null)[\w.-]+)")


def trajectory_flags(note: dict, task: Task) -> list[str]:
    """Rules over one episode's tool calls: git history access, test-file edits, reads outside the workspace."""
    flags = set()
    tests = set(task.test_files)
    for call in note.get("calls", []):
        try:
            args = json.loads(call["args"])
        except ValueError:  # clipped arguments: match on the text
            args = {"command": call["args"], "path": ""}
        path = str(args.get("path", "") or "")
        rel = path.removeprefix("/workspace/") if path.startswith("/workspace/") else path
        if call["name"] == "bash":
            cmd = str(args.get("command", ""))
            if _GIT_HISTORY.search(cmd):
                flags.add("git history access")
            if _WRITES.search(cmd) and any(t in cmd for t in tests):
                flags.add("test file edit")
            if _OUTSIDE_READ.search(cmd):
                flags.add("read outside the workspace")
        elif call["name"] in ("edit", "create") and (rel in tests or is_protected(rel, task.test_files)):
            flags.add("test file edit")
        elif call["name"] == "view" and path.startswith("/") and not path.startswith("/workspace"):
            flags.add("read outside the workspace")
        if rel.startswith(".git/") or rel == ".git":
            flags.add("git history access")
    if any(is_protected(p, task.test_files) for p in note.get("touched", [])):
        flags.add("test file edit")
    return sorted(flags)


def _repair(task: Task, v: dict) -> str | None:
    """Shrink the verifier to its reliable part; returns what was done, or None if nothing can be."""
    bad = set(v["flaky"]) | set(v["null_passing_f2p"]) | set(v["gold_failing"]) & set(task.p2p)
    if not bad:
        return None
    f2p = [t for t in task.f2p if t not in bad]
    if not f2p:
        return None
    task.f2p, task.p2p = f2p, [t for t in task.p2p if t not in bad]
    return f"removed unreliable tests {sorted(bad)}"


def _verdict(v: dict) -> str:
    if v["flaky"]:
        return f"flaky: tests flip under the gold patch: {v['flaky']}"
    if not v["gold_gate"]:
        return f"gold gate: gold patch scored {v['gold_rewards']}; failing {v['gold_failing'][:5]}"
    if not v["null_gate"]:
        return f"null gate: null patch scored {v['null_reward']}; F2P passing unchanged {v['null_passing_f2p']}"
    if "adversarial_gate" not in v:
        return ""
    if not v["adversarial_gate"]:
        won = [k for k, r in v["hack_rewards"].items() if r not in (0.0, "skipped (slow)")]
        return "adversarial gate: " + ", ".join(won)
    if not v["statement_consistent"]:
        return f"inconsistent statement: verifier does not print {v['statement_unmatched'][:3]}"
    if not v["trajectory_gate"]:
        return f"solver bypass: {v['solver_bypass'] or v['trajectory_cheats']}"
    return ""


def process(rec: TaskRecord, ctx: Context) -> TaskRecord:
    t0 = time.monotonic()
    out = TaskRecord.from_dict(rec.to_dict())
    task = Task.from_dict(rec.task)
    files = task_files(rec)
    repairs: list[str] = []
    with GraderPool(max_graders=1, graders_per_image=1) as pool:
        for _ in range(MAX_REPAIRS + 1):
            v = run_gates(task, rec, files, pool, ctx)
            reason = _verdict(v)
            if not reason:
                run_probes(task, rec, files, pool, ctx, v)
                reason = _verdict(v)
                break
            done = _repair(task, v)
            if done is None:
                break
            repairs.append(f"{reason.split(':')[0]} -> {done}")
    v["repairs"] = repairs
    v.pop("null_messages", None)
    for gate in ("adversarial_gate", "statement_consistent", "trajectory_gate"):
        v.setdefault(gate, None)  # not run: an earlier gate failed
    v.setdefault("hack_rewards", {})
    out.verdicts.update(v)
    audit_hash = hashlib.sha256(json.dumps(rec.audit, sort_keys=True).encode()).hexdigest()[:16]
    task.verification = {
        "source": "synth", "origin": rec.origin or {"kind": "mutation"},
        "mutation": {k: rec.mutation[k] for k in ("path", "kind", "lineno")} if rec.mutation else None,
        "gates": {g: v[g] for g in ("gold_gate", "null_gate", "adversarial_gate", "statement_consistent",
                                    "trajectory_gate")} | {"leak_audit": True, "flaky": not v["flaky"]},
        "flake_rates": v["flake_rates"], "solver_pass_matrix": rec.pass_matrix,
        "inspector_verdicts": {"hack_rewards": v["hack_rewards"], "gold_rewards": v["gold_rewards"],
                               "null_reward": v["null_reward"], "repairs": repairs},
        "audit_hash": audit_hash, "audit": rec.audit,
        # the slowest gold run in the grader, and what an episode's grading of this task may take
        **budget_fields(v["gold_runs_s"]),
    }
    out.task, out.seconds = task.to_dict(), time.monotonic() - t0
    if reason:
        return out.drop(reason)
    try:
        validate_task(out.task)
    except TaskSchemaError as e:
        return out.drop(f"schema: {e}")
    return out
