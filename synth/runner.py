"""The factory runner: sequences the stages, runs each stage's units in parallel with retries, skips
units whose records are already in the stage's journal (so a rerun resumes), shows progress, and
reports the funnel. It knows nothing about what a stage does.

Not here: any stage logic (synth/stages/*.py) or argument parsing (synth/cli.py).
"""

from __future__ import annotations

import json
import math
import signal
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from pathlib import Path
from types import ModuleType

from tqdm import tqdm

from envs import engine
from envs.task import Task, save_tasks
from synth import validate
from synth.config import Context, FactoryOptions
from synth.records import Record, StageStore, funnel
from synth.stages import build, feasibility, ingest, inspect, solve, specify

STAGES: list[ModuleType] = [ingest, feasibility, specify, build, solve, inspect]
POSTFIX_EVERY_S = 1.0  # the progress bar's sign of life
INTERRUPT_GRACE_S = 5.0  # on Ctrl-C, in-flight units finishing within this are kept
MAX_ROUNDS = 4  # specify -> inspect rounds refilling what the later stages dropped


def _key(stage: ModuleType, unit) -> str:
    return stage.unit_key(unit) if hasattr(stage, "unit_key") else unit[0]


def unit_budget_s(stage: ModuleType, opts: FactoryOptions) -> float:
    return float(opts.unit_budget_s.get(stage.NAME, stage.BUDGET_S))


def _spawn(name: str, fn: Callable, *args) -> Future:
    """`fn(*args)` on a daemon thread: a unit over its budget, or left running at an interrupt, is
    abandoned (its result ignored) and never holds the process open or a worker slot."""
    fut: Future = Future()
    fut.set_running_or_notify_cancel()

    def run() -> None:
        try:
            fut.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            fut.set_exception(e)

    threading.Thread(target=run, daemon=True, name=name).start()
    return fut


class _CtrlC:
    """Ctrl-C as a flag while a stage waits on its units (main thread only). The default handler raises
    KeyboardInterrupt wherever the main thread is, also inside `concurrent.futures.wait` while it holds
    the futures' locks; the grace wait after it can then block for good on a lock the interrupted wait
    never released. The stage loop checks `hit` after every wait (at most POSTFIX_EVERY_S apart) and
    raises KeyboardInterrupt there, where no lock is held."""

    def __init__(self) -> None:
        self.hit = threading.Event()
        self._previous = None

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, lambda *_: self.hit.set())

    def restore(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None


def _blank(record_type: type[Record], key: str) -> Record:
    return record_type.from_dict({"key": key, "source": "", "path": "", "task_id": key, "repo_key": ""})


def run_stage(stage: ModuleType, inputs: list, ctx: Context, *, target_ok: int | None = None,
              limit: int | None = None, progress: bool = True) -> list[Record]:
    """Run `stage` over the units of `inputs`; returns the records of every unit processed (this run
    or an earlier one). Stops submitting once `target_ok` ok records exist, or after `limit` new units
    (an interruption, for tests). A unit that raises is retried `opts.retries` times, then dropped; a
    unit past its time budget is dropped ("<stage>: over its N s budget") and abandoned. On Ctrl-C the
    units that finish within `INTERRUPT_GRACE_S` are journaled, then KeyboardInterrupt propagates."""
    store = StageStore(ctx.out_dir, stage.NAME, stage.OUTPUT)
    done = {k: r for k, r in store.load().items() if not r.drop_reason.startswith("error:")}  # errors: retry
    units = stage.units(inputs, ctx)
    keys = [_key(stage, u) for u in units]
    records = {k: done[k] for k in keys if k in done}
    n_ok = sum(r.ok for r in records.values())
    todo = [(k, u) for k, u in zip(keys, units, strict=True) if k not in done]
    bar = tqdm(total=target_ok or len(units), initial=min(n_ok if target_ok else len(records), target_ok or 10**9),
               desc=f"{stage.NAME:>11}", unit="ok" if target_ok else "unit", disable=not progress, leave=True)
    budget = unit_budget_s(stage, ctx.opts)
    started = 0
    live: dict[Future, tuple[str, float]] = {}  # future -> (unit key, deadline)

    def finish(rec: Record) -> None:
        nonlocal n_ok
        store.append(rec)
        records[rec.key] = rec
        n_ok += rec.ok
        bar.update(1 if (rec.ok or not target_ok) else 0)

    it = iter(todo)
    ctrl_c = _CtrlC()
    ctrl_c.install()
    try:
        while True:
            while len(live) < ctx.opts.concurrency and (target_ok is None or n_ok < target_ok) and \
                    (limit is None or started < limit):
                nxt = next(it, None)
                if nxt is None:
                    break
                fut = _spawn(f"{stage.NAME}:{nxt[0]}", _attempt, stage.process, nxt[1], ctx, nxt[0], stage.OUTPUT)
                live[fut] = (nxt[0], time.monotonic() + budget)
                started += 1
            if not live:
                break
            now = time.monotonic()
            timeout = max(0.0, min(POSTFIX_EVERY_S, min(d for _, d in live.values()) - now))
            finished, _ = wait(live, timeout=timeout, return_when=FIRST_COMPLETED)
            if ctrl_c.hit.is_set():
                raise KeyboardInterrupt
            for fut in finished:
                live.pop(fut)
                finish(fut.result())
            now = time.monotonic()
            for fut, (key, deadline) in list(live.items()):
                if now >= deadline:  # its thread runs on unobserved; its containers go with the process
                    live.pop(fut)
                    last = ctx.unit_note(key)
                    finish(_blank(stage.OUTPUT, key).drop(
                        f"{stage.NAME}: over its {budget:g} s budget" + (f" (was: {last})" if last else "")))
            bar.set_postfix_str(_postfix(ctx, n_ok, len(records) - n_ok, [k for k, _ in live.values()]),
                                refresh=True)
    except KeyboardInterrupt:
        ctx.stopping.set()
        finished, _ = wait(live, timeout=INTERRUPT_GRACE_S)
        for fut in finished:
            if fut.exception() is None:
                finish(fut.result())
        bar.close()
        raise
    finally:
        ctrl_c.restore()
    bar.close()
    ordered = [records[k] for k in keys if k in records]
    if limit is None:
        store.finalize(ordered)
    return ordered


def _postfix(ctx: Context, n_ok: int, n_dropped: int, live: list[str]) -> str:
    """ok/dropped counts and what each in-flight unit is doing (its last `ctx.note`) with its age."""
    now = [f"{k[-24:]}: {ctx.unit_note(k) or 'starting'}" for k in live]
    return f"ok={n_ok} dropped={n_dropped}" + ("; " + " | ".join(now) if now else "")


def _attempt(process: Callable, unit, ctx: Context, key: str, record_type: type[Record]) -> Record:
    error = ""
    ctx.begin_unit(key)
    try:
        for _ in range(ctx.opts.retries + 1):
            try:
                return process(unit, ctx)
            except Exception as e:  # noqa: BLE001 - infrastructure errors become a drop reason
                error = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1200:]}"
        return _blank(record_type, key).drop(f"error: {error}"[:2000])
    finally:
        ctx.end_unit(key)


def run_factory(opts: FactoryOptions, *, stages: Iterable[str] | None = None, progress: bool = True,
                hooks: dict | None = None) -> dict:
    """Run every stage (or the named ones, reading earlier stages' records from disk); returns stats.
    Bad options, an unfetchable source or a foreign output folder raise FactoryInputError first.

    `task_budget` is the number of verified tasks wanted: specify aims at `spec_margin` x what is
    still missing, build follows, solve and inspect stop at the budget; while tasks are missing and a
    round brought something new, another round refills (every stage resumes from its journal)."""
    wanted = set(stages or [s.NAME for s in STAGES])
    validate.check_build(opts, [s.NAME for s in STAGES], wanted)
    out = Path(opts.out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    ctx = Context(opts, out, hooks=dict(hooks or {}))
    # containers left by an interrupted earlier run (owner process gone) would otherwise linger
    reaped = engine.reap_containers(only_stale=True) if engine.engine_available() else []
    (out / "options.json").write_text(json.dumps(opts.to_dict(), indent=2) + "\n")
    t0 = time.monotonic()
    timings: dict[str, float] = {}
    try:
        accepted = 0
        for _ in range(MAX_ROUNDS):
            before = (_n_ok(out, specify), accepted)
            accepted = _one_round(ctx, wanted, accepted, timings, progress)
            if accepted >= opts.task_budget or specify.NAME not in wanted or (_n_ok(out, specify), accepted) == before:
                break  # the budget is met, or a round brought nothing new
    finally:
        ctx.close()
    accepted_tasks = [Task.from_dict(r.task) for r in StageStore(out, inspect.NAME, inspect.OUTPUT).load().values()
                      if r.ok]
    # units in flight when inspect reached the budget finish and stay in its journal; tasks.json holds the budget
    save_tasks(accepted_tasks[:opts.task_budget], out / "tasks.json")
    result = stats(out)
    result["tasks_saved"] = min(len(accepted_tasks), opts.task_budget)
    result["seconds"] = round(time.monotonic() - t0, 1)
    result["reaped_stale_containers"] = len(reaped)
    result["stage_seconds"] = timings
    (out / "stats.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def _n_ok(out: Path, stage: ModuleType) -> int:
    return sum(r.ok for r in StageStore(out, stage.NAME, stage.OUTPUT).load().values())


def _one_round(ctx: Context, wanted: set[str], accepted: int, timings: dict[str, float], progress: bool) -> int:
    """Every stage once; returns the verified tasks after it."""
    opts = ctx.opts
    inputs: list = [opts.source]
    for stage in STAGES:
        t = time.monotonic()
        if stage.NAME in wanted:
            target = None
            if stage is specify:
                target = _specify_target(ctx.out_dir, opts.task_budget, accepted, opts.spec_margin)
            elif stage is solve:  # enough solved tasks for the budget, past those inspect has dropped
                target = opts.task_budget + _n_dropped(ctx.out_dir, inspect)
            elif stage is inspect:
                target = opts.task_budget
            inputs = run_stage(stage, inputs, ctx, target_ok=target, progress=progress)
            ctx.close()  # a stage's shared graders are not needed by the next one
        else:
            inputs = list(StageStore(ctx.out_dir, stage.NAME, stage.OUTPUT).load().values())
        timings[stage.NAME] = round(timings.get(stage.NAME, 0.0) + time.monotonic() - t, 1)
    return _n_ok(ctx.out_dir, inspect)


def _n_dropped(out: Path, stage: ModuleType) -> int:
    return sum(not r.ok for r in StageStore(out, stage.NAME, stage.OUTPUT).load().values())


def _specify_target(out: Path, budget: int, accepted: int, margin: float) -> int:
    """Total ok specs wanted: those already made, plus `margin` x the missing tasks, less the specs still
    in the pipe (ok in specify, not dropped by build, solve or inspect, not yet accepted)."""
    n_spec = _n_ok(out, specify)
    dropped = sum(_n_dropped(out, s) for s in (build, solve, inspect))
    in_pipe = max(n_spec - dropped - accepted, 0)
    return n_spec + max(math.ceil(max(budget - accepted, 0) * margin) - in_pipe, 0)


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
