"""The stage runner without containers: per-unit time budgets, the progress postfix's sign of life,
Ctrl-C keeping finished work, and how many specs specify is asked for (the budget is verified tasks)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from types import SimpleNamespace

from synth import runner
from synth.config import Context, FactoryOptions
from synth.records import RepoRecord, SpecRecord, StageStore, TaskRecord


def fake_stage(seconds: dict[str, float], budget: float = 60.0) -> SimpleNamespace:
    def process(unit, ctx):
        ctx.note(f"sleeping {seconds[unit[0]]} s")
        time.sleep(seconds[unit[0]])
        return RepoRecord(key=unit[0], source=unit[1])

    return SimpleNamespace(NAME="ingest", OUTPUT=RepoRecord, BUDGET_S=budget, process=process,
                           units=lambda inputs, ctx: [(k, k) for k in inputs])


def test_a_unit_over_its_budget_is_dropped_with_a_clear_reason(tmp_path):
    ctx = Context(FactoryOptions(out_dir=str(tmp_path), concurrency=2, unit_budget_s={"ingest": 0.5}), tmp_path)
    stage = fake_stage({"fast": 0.0, "slow": 30.0})
    t0 = time.monotonic()
    recs = {r.key: r for r in runner.run_stage(stage, ["fast", "slow"], ctx, progress=False)}
    assert time.monotonic() - t0 < 10  # the runner does not wait for the abandoned unit
    assert recs["fast"].ok
    assert recs["slow"].drop_reason == "ingest: over its 0.5 s budget (was: sleeping 30.0 s)"
    journal = StageStore(tmp_path, "ingest", RepoRecord).load()
    assert journal["slow"].drop_reason.startswith("ingest: over its 0.5 s budget")  # a rerun does not retry it


def test_the_postfix_says_what_each_unit_is_doing(tmp_path):
    ctx = Context(FactoryOptions(out_dir=str(tmp_path)), tmp_path)
    ctx.begin_unit("repo-1")
    ctx.note("baseline run 1/2")
    assert runner._postfix(ctx, 3, 1, ["repo-1", "repo-2"]) == \
        "ok=3 dropped=1; repo-1: baseline run 1/2 | repo-2: starting"
    ctx.end_unit("repo-1")
    assert ctx.unit_note("repo-1") == ""


SIGINT_SCRIPT = textwrap.dedent('''
    import sys, time
    from types import SimpleNamespace
    from pathlib import Path
    from synth import runner
    from synth.config import Context, FactoryOptions
    from synth.records import RepoRecord
    out = Path(sys.argv[1])
    def process(unit, ctx):
        time.sleep({"quick": 1.5, "stuck": 600}[unit[0]])
        return RepoRecord(key=unit[0], source=unit[1])
    stage = SimpleNamespace(NAME="ingest", OUTPUT=RepoRecord, BUDGET_S=900, process=process,
                            units=lambda inputs, ctx: [(k, k) for k in inputs])
    ctx = Context(FactoryOptions(out_dir=str(out), concurrency=2), out)
    print("started", flush=True)
    try:
        runner.run_stage(stage, ["quick", "stuck"], ctx, progress=False)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
        sys.exit(130)
''')


def test_ctrl_c_stops_within_seconds_and_keeps_finished_units(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    proc = subprocess.Popen([sys.executable, "-c", SIGINT_SCRIPT, str(tmp_path)], stdout=subprocess.PIPE,
                            text=True, env=env)
    assert proc.stdout.readline().strip() == "started"
    time.sleep(0.5)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    rc = proc.wait(timeout=60)
    # the grace is 5 s: the quick unit (1.5 s) finishes inside it, the stuck one is abandoned
    assert time.monotonic() - t0 < runner.INTERRUPT_GRACE_S + 10
    assert rc == 130 and "interrupted" in proc.stdout.read()
    journal = StageStore(tmp_path, "ingest", RepoRecord).load()
    assert set(journal) == {"quick"} and journal["quick"].ok


def test_specify_is_asked_for_what_is_missing(tmp_path):
    assert runner._specify_target(tmp_path, budget=8, accepted=0, margin=1.5) == 12  # a fresh run
    spec = StageStore(tmp_path, "specify", SpecRecord)
    for i in range(12):
        spec.append(SpecRecord(key=f"t{i}", task_id=f"t{i}", repo_key="r"))
    for i in range(3):  # build dropped 3, inspect accepted 7 and dropped 2
        StageStore(tmp_path, "build", TaskRecord).append(TaskRecord(key=f"t{i}").drop("image leak: x"))
    for i in range(3, 5):
        StageStore(tmp_path, "inspect", TaskRecord).append(TaskRecord(key=f"t{i}").drop("null gate: x"))
    # 1 task missing: 2 more specs (1.5 x 1, rounded up); none is still in the pipe
    assert runner._specify_target(tmp_path, budget=8, accepted=7, margin=1.5) == 14
    # a resumed run whose 12 specs have not reached the later stages yet asks for no more
    assert runner._specify_target(tmp_path / "fresh", budget=8, accepted=0, margin=1.5) == 12
    fresh = StageStore(tmp_path / "fresh", "specify", SpecRecord)
    for i in range(12):
        fresh.append(SpecRecord(key=f"t{i}", task_id=f"t{i}", repo_key="r"))
    assert runner._specify_target(tmp_path / "fresh", budget=8, accepted=0, margin=1.5) == 12
    assert runner._specify_target(tmp_path, budget=8, accepted=8, margin=1.5) == 12  # met: nothing more
