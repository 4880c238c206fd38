"""The factory runner: sequences the stages, runs each stage's units in parallel with retries, skips
units whose records are already in the stage's journal (so a rerun resumes), shows progress, and
reports the funnel. It knows nothing about what a stage does.

Not here: any stage logic (synth/stages/*.py) or argument parsing (synth/cli.py).
"""

from __future__ import annotations

import json
import math
import time
import traceback
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from types import ModuleType

from tqdm import tqdm

from envs import engine
from envs.task import Task, save_tasks
from synth.config import Context, FactoryOptions
from synth.records import Record, StageStore, funnel
from synth.stages import build, feasibility, ingest, inspect, solve, specify

STAGES: list[ModuleType] = [ingest, feasibility, specify, build, solve, inspect]


def _key(stage: ModuleType, unit) -> str:
    return stage.unit_key(unit) if hasattr(stage, "unit_key") else unit[0]


def run_stage(stage: ModuleType, inputs: list, ctx: Context, *, target_ok: int | None = None,
              limit: int | None = None, progress: bool = True) -> list[Record]:
    """Run `stage` over the units of `inputs`; returns the records of every unit processed (this run
    or an earlier one). Stops submitting once `target_ok` ok records exist, or after `limit` new units
    (an interruption, for tests). A unit that raises is retried `opts.retries` times, then dropped."""
    store = StageStore(ctx.out_dir, stage.NAME, stage.OUTPUT)
    done = {k: r for k, r in store.load().items() if not r.drop_reason.startswith("error:")}  # errors: retry
    units = stage.units(inputs, ctx)
    keys = [_key(stage, u) for u in units]
    records = {k: done[k] for k in keys if k in done}
    n_ok = sum(r.ok for r in records.values())
    todo = [(k, u) for k, u in zip(keys, units, strict=True) if k not in done]
    bar = tqdm(total=target_ok or len(units), initial=min(n_ok if target_ok else len(records), target_ok or 10**9),
               desc=f"{stage.NAME:>11}", unit="ok" if target_ok else "unit", disable=not progress, leave=True)
    started = 0
    with ThreadPoolExecutor(max(1, ctx.opts.concurrency), thread_name_prefix=stage.NAME) as ex:
        pending: dict[Future, str] = {}
        it = iter(todo)
        while True:
            while len(pending) < ctx.opts.concurrency and (target_ok is None or n_ok < target_ok) and \
                    (limit is None or started < limit):
                nxt = next(it, None)
                if nxt is None:
                    break
                pending[ex.submit(_attempt, stage.process, nxt[1], ctx, nxt[0], stage.OUTPUT)] = nxt[0]
                started += 1
            if not pending:
                break
            finished, _ = wait(pending, return_when=FIRST_COMPLETED)
            for fut in finished:
                pending.pop(fut)
                rec = fut.result()
                store.append(rec)
                records[rec.key] = rec
                n_ok += rec.ok
                bar.update(1 if (rec.ok or not target_ok) else 0)
                bar.set_postfix(ok=n_ok, dropped=len(records) - n_ok)
    bar.close()
    ordered = [records[k] for k in keys if k in records]
    if limit is None:
        store.finalize(ordered)
    return ordered


def _attempt(process: Callable, unit, ctx: Context, key: str, record_type: type[Record]) -> Record:
    error = ""
    for _ in range(ctx.opts.retries + 1):
        try:
            return process(unit, ctx)
        except Exception as e:  # noqa: BLE001 - infrastructure errors become a drop reason
            error = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1200:]}"
    rec = record_type.from_dict({"key": key, "source": "", "path": "", "task_id": key, "repo_key": ""})
    return rec.drop(f"error: {error}"[:2000])


def run_factory(opts: FactoryOptions, *, stages: Iterable[str] | None = None, progress: bool = True,
                hooks: dict | None = None) -> dict:
    """Run every stage (or the named ones, reading earlier stages' records from disk); returns stats."""
    out = Path(opts.out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    ctx = Context(opts, out, hooks=dict(hooks or {}))
    # containers left by an interrupted earlier run (owner process gone) would otherwise linger
    reaped = engine.reap_containers(only_stale=True) if engine.engine_available() else []
    (out / "options.json").write_text(json.dumps(opts.to_dict(), indent=2) + "\n")
    wanted = set(stages or [s.NAME for s in STAGES])
    inputs: list = [opts.source]
    t0 = time.monotonic()
    timings = {}
    try:
        for stage in STAGES:
            t = time.monotonic()
            if stage.NAME in wanted:
                target = math.ceil(opts.task_budget * opts.spec_margin) if stage is specify else None
                inputs = run_stage(stage, inputs, ctx, target_ok=target, progress=progress)
                ctx.close()  # a stage's shared graders are not needed by the next one
            else:
                inputs = list(StageStore(out, stage.NAME, stage.OUTPUT).load().values())
            timings[stage.NAME] = round(time.monotonic() - t, 1)
    finally:
        ctx.close()
    accepted = [Task.from_dict(r.task) for r in StageStore(out, inspect.NAME, inspect.OUTPUT).load().values() if r.ok]
    save_tasks(accepted, out / "tasks.json")
    result = stats(out)
    result["seconds"] = round(time.monotonic() - t0, 1)
    result["reaped_stale_containers"] = len(reaped)
    result["stage_seconds"] = timings
    (out / "stats.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def stats(out_dir: str | Path) -> dict:
    """The funnel: per stage, units in/out and drop reasons (from the journals)."""
    out = Path(out_dir)
    result = {"funnel": {}}
    for stage in STAGES:
        store = StageStore(out, stage.NAME, stage.OUTPUT)
        result["funnel"][stage.NAME] = funnel(list(store.load().values()))
    final = StageStore(out, inspect.NAME, inspect.OUTPUT).load().values()
    result["tasks"] = sum(r.ok for r in final)
    rows: dict[str, list[float]] = {}
    for r in StageStore(out, solve.NAME, solve.OUTPUT).load().values():
        for name, row in r.pass_matrix.items():
            rows.setdefault(name, []).extend(row)
    result["solver_pass_rates"] = {name: round(sum(xs) / len(xs), 3) for name, xs in sorted(rows.items()) if xs}
    result["search_solver_pass_rate"] = result["solver_pass_rates"].get("search")
    return result
