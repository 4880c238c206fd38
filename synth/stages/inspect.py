"""Stage 6, inspector and repair loop: a solved task -> an accepted Task (with every gate's evidence in
`Task.verification`) or a drop with its reason. All runs use the real grader on the task image.

Gates: gold (the gold patch scores 1 on K of K runs), null (the unchanged workspace scores 0 and
every F2P test fails), adversarial (every canned hack of envs/hacks.py scores 0), flakiness
(`flaky_reruns` more gold runs; per-test flip rates must be 0), statement/verifier consistency (the
failure lines the statement quotes are what the verifier's F2P tests really print on the unfixed
code), solver trajectories (a passing solver patch must be non-empty and touch the file the bug is
in, else the tests can be satisfied by a bypass). Repair: flaky or null-passing tests are removed
from P2P/F2P while at least one F2P test remains, and the gates rerun; anything else drops.
Not here: building images (build) or solving (solve).
"""

from __future__ import annotations

import hashlib
import json
import time

from envs.grading import grade_patch
from envs.hacks import HACKS, gold_source_files
from envs.pool import GraderPool
from envs.task import Task, TaskSchemaError, validate_task
from synth import mutations
from synth.config import Context
from synth.records import TaskRecord
from synth.stages.build import repo_files
from synth.testrun import run_suite

NAME = "inspect"
OUTPUT = TaskRecord
MAX_REPAIRS = 2
HACK_TIMEOUT_S = 60.0


def units(tasks: list[TaskRecord], ctx: Context) -> list[TaskRecord]:
    return [t for t in tasks if t.ok]


def unit_key(rec: TaskRecord) -> str:
    return rec.key


def tree_of(rec: TaskRecord) -> dict[str, bytes]:
    """The task's workspace as shipped (original repository with the mutation applied)."""
    files = repo_files(rec.repo_path)
    m = mutations.Mutation(**rec.mutation)
    files[m.path] = mutations.apply(files[m.path].decode(), m).encode()
    return files


def _body(lines: list[str], sign: str) -> str:
    out = "".join(sign + ln if ln.endswith("\n") else sign + ln + "\n\\ No newline at end of file\n" for ln in lines)
    return out


def edits_to_patch(files: dict[str, bytes], edits: dict[str, str | None]) -> str:
    """A git diff (against the shipped tree) making a hack's file writes and deletions."""
    parts = []
    for path, content in sorted(edits.items()):
        before = files[path].decode(errors="replace") if path in files else None
        if content is None and before is not None:
            lines = before.splitlines(keepends=True)
            parts.append(f"diff --git a/{path} b/{path}\ndeleted file mode 100644\n--- a/{path}\n+++ /dev/null\n"
                         f"@@ -1,{len(lines)} +0,0 @@\n" + _body(lines, "-"))
        elif content is not None and before is None:
            lines = content.splitlines(keepends=True)
            parts.append(f"diff --git a/{path} b/{path}\nnew file mode 100644\n--- /dev/null\n+++ b/{path}\n"
                         f"@@ -0,0 +1,{len(lines)} @@\n" + _body(lines, "+"))
        elif content is not None:
            parts.append(mutations.unified_diff(path, before, content))
    return "".join(parts)


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
    gold = [run_suite(task, task.gold_patch, pool=pool) for _ in range(opts.gold_runs + opts.flaky_reruns)]
    null = run_suite(task, "", pool=pool)
    v: dict = {"gold_rewards": [g.reward for g in gold[:opts.gold_runs]]}
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
    v["trajectory_gate"] = not bypass


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
        return f"solver bypass: {v['solver_bypass']}"
    return ""


def process(rec: TaskRecord, ctx: Context) -> TaskRecord:
    t0 = time.monotonic()
    out = TaskRecord.from_dict(rec.to_dict())
    task = Task.from_dict(rec.task)
    files = tree_of(rec)
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
        "source": "synth", "mutation": {k: rec.mutation[k] for k in ("path", "kind", "lineno")},
        "gates": {g: v[g] for g in ("gold_gate", "null_gate", "adversarial_gate", "statement_consistent",
                                    "trajectory_gate")} | {"leak_audit": True, "flaky": not v["flaky"]},
        "flake_rates": v["flake_rates"], "solver_pass_matrix": rec.pass_matrix,
        "inspector_verdicts": {"hack_rewards": v["hack_rewards"], "gold_rewards": v["gold_rewards"],
                               "null_reward": v["null_reward"], "repairs": repairs},
        "audit_hash": audit_hash, "audit": rec.audit,
    }
    out.task, out.seconds = task.to_dict(), time.monotonic() - t0
    if reason:
        return out.drop(reason)
    try:
        validate_task(out.task)
    except TaskSchemaError as e:
        return out.drop(f"schema: {e}")
    return out
