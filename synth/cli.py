"""`flashpost-factory`: build verified tasks from a repository, and look at what a run produced.

  flashpost-factory build --repo <path|git-url|pypi:NAME==VERSION|sample> --out DIR --budget N --concurrency C
  flashpost-factory build --source families|fixtures|toy --out DIR [--budget N]
  flashpost-factory inspect DIR [--rerun]   per-task gate results (--rerun: run the inspector again)
  flashpost-factory show DIR TASK_ID        every stage's record of one task, and its task-set row
  flashpost-factory stats DIR               the stage funnel with drop reasons, and the task set's counts
  flashpost-factory tasks merge OUT SET...  one task set from several (task ids must not repeat)
  flashpost-factory tasks filter SET OUT [--split S] [--family F ...] [--source R ...]
                                         [--min-difficulty X] [--max-difficulty Y]

`build` writes its task set (synth/taskset.py) to DIR/taskset: `--source repo` (the default) runs the
factory on --repo, `families` writes the demo's families (--budget family-A tasks with
demonstrations, --n-b family-B, --n-heldout held out of each), `fixtures` the fixture tasks, `toy`
the in-process toy family (--budget tasks). Trainers and flashpost-eval read it with
`tasks=DIR/taskset`.

Bad input (an unfetchable --repo, a non-positive budget, an --out of another repository's run, a folder
that is no run) exits 2 before any stage runs, naming the fix; Ctrl-C keeps finished units and exits 130.
Flag names follow `rl.config.SynthConfig` (repo, out_dir, task_budget, concurrency, flaky_reruns).
Not here: stage logic (synth/stages) or sequencing (synth/runner.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
from pathlib import Path
from typing import NoReturn

from synth import taskset, validate
from synth.config import FactoryOptions
from synth.records import StageStore
from synth.runner import STAGES, run_factory, stats
from synth.stages import inspect
from synth.taskset_sources import SOURCES
from synth.validate import FactoryInputError

TASKSET_DIR = "taskset"  # build writes DIR/taskset


def _build(args: argparse.Namespace) -> int:
    opts = FactoryOptions(repo=args.repo, out_dir=args.out, task_budget=args.budget, concurrency=args.concurrency,
                          flaky_reruns=args.flaky_reruns, gold_runs=args.gold_runs, seed=args.seed,
                          solver_attempts=args.solver_attempts, run_slow_hacks=args.slow_hacks,
                          history_commits=args.history_commits, unit_budget_s=_unit_budgets(args.unit_budget))
    if args.llm_base_url:
        opts.solvers.llm.base_url, opts.solvers.llm.model = args.llm_base_url, args.llm_model
    if args.policy_checkpoint:
        pol = opts.solvers.policy
        pol.checkpoint, pol.device, pol.max_turns = args.policy_checkpoint, args.policy_device, args.policy_max_turns
        pol.max_new_tokens = args.policy_max_new_tokens
    out = Path(args.out) / TASKSET_DIR
    if args.source != "repo":
        kwargs = {"toy": {"n": args.budget, "seed": args.seed}, "fixtures": {},
                  "families": {"n_a": args.budget, "n_b": args.n_b or max(1, args.budget // 2),
                               "n_heldout": args.n_heldout or max(1, args.budget // 4),
                               "recovery_share": args.recovery_share, "seed": args.seed}}
        ts = SOURCES[args.source](**kwargs[args.source])
        taskset.save(ts, out)
        print(f"{len(ts.tasks)} task(s), {len(ts.demos)} demonstration(s) from source {args.source} -> {out}")
        return 0
    result = run_factory(opts, stages=args.stages or None)
    _print_funnel(result)
    journal = Path(args.out) / "tasks.json"
    print(f"{result['tasks_saved']} task(s) passed every gate in {result['seconds']} s -> {journal}")
    if not result["tasks"]:
        return 1
    ts = SOURCES["repo"](args.out)
    taskset.save(ts, out)
    print(f"task set: {len(ts.tasks)} task(s), {len(ts.demos)} verified demonstration(s) -> {out}")
    return 0


def _print_funnel(result: dict) -> None:
    print(f"{'stage':<12}{'in':>6}{'out':>6}  drop reasons")
    for name, f in result["funnel"].items():
        drops = ", ".join(f"{k} x{n}" for k, n in f["drops"].items())
        print(f"{name:<12}{f['in']:>6}{f['out']:>6}  {drops}")
        _print_drop_examples(f)
    for name, rate in result.get("solver_pass_rates", {}).items():
        print(f"{name} solver pass rate: {rate}")


def _print_drop_examples(f: dict) -> None:
    """One real reason per drop category, with the unit key `show` takes."""
    for category, example in f.get("examples", {}).items():
        print(f"{'':<26}{category}, e.g. {example}")


def _inspect(args: argparse.Namespace) -> int:
    out = Path(args.dir)
    if args.rerun:
        shutil.rmtree(out / inspect.NAME, ignore_errors=True)
        opts_doc = json.loads((out / "options.json").read_text()) if (out / "options.json").exists() else {}
        opts = FactoryOptions.from_dict(opts_doc)
        opts.out_dir = str(out)
        run_factory(opts, stages=[inspect.NAME])
    records = StageStore(out, inspect.NAME, inspect.OUTPUT).load().values()
    for r in records:
        v = r.verdicts
        gates = "".join("+" if v.get(g) else "-" for g in ("gold_gate", "null_gate", "adversarial_gate",
                                                            "statement_consistent", "trajectory_gate"))
        print(f"{r.status:<8} {gates} flaky={len(v.get('flaky', []))} {r.key}  {r.drop_reason[:100]}")
    print("gates: gold null adversarial statement trajectory")
    return 0


def _taskset_counts(ts: taskset.TaskSet) -> str:
    from collections import Counter

    c = Counter((r.family, r.split) for r in ts.tasks)
    return ", ".join(f"{fam}/{split} {n}" for (fam, split), n in sorted(c.items()))


def _show(args: argparse.Namespace) -> int:
    found = False
    ts_dir = Path(args.dir) / TASKSET_DIR
    if (ts_dir / taskset.META_FILE).exists():
        ts = taskset.load(ts_dir)
        for row in (r for r in ts.tasks if r.id == args.task_id):
            found = True
            print(f"== task set: {row.split} {row.family}")
            print(json.dumps(dataclasses.asdict(row), indent=2)[: args.max_chars])
        for d in (d for d in ts.demos if d.task_id == args.task_id):
            print(f"== demonstration {d.id}: {len(d.messages)} message(s)")
    for stage in STAGES if _factory_run(args.dir) else []:
        rec = StageStore(args.dir, stage.NAME, stage.OUTPUT).load().get(args.task_id)
        if rec is not None:
            found = True
            print(f"== {stage.NAME}: {rec.status} {rec.drop_reason}")
            print(json.dumps(rec.to_dict(), indent=2)[: args.max_chars])
    if not found:
        print(f"no record with key {args.task_id!r} in {args.dir}", file=sys.stderr)
    return 0 if found else 1


def _factory_run(out: str) -> bool:
    """Whether `out` holds factory journals (a `--source families|fixtures|toy` folder has only its set)."""
    return any((Path(out) / s.NAME / "records.jsonl").exists() for s in STAGES)


def _stats(args: argparse.Namespace) -> int:
    result = stats(args.dir) if _factory_run(args.dir) else {"funnel": {}, "tasks": 0}
    ts_dir = Path(args.dir) / TASKSET_DIR
    if (ts_dir / taskset.META_FILE).exists():
        ts = taskset.load(ts_dir)
        result["taskset"] = {"path": str(ts_dir), "tasks": len(ts.tasks), "demonstrations": len(ts.demos),
                             "counts": _taskset_counts(ts)}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _print_funnel(result)
        print(f"tasks: {result['tasks']}")
        if "taskset" in result:
            t = result["taskset"]
            print(f"task set {t['path']}: {t['tasks']} task(s), {t['demonstrations']} demonstration(s); {t['counts']}")
    return 0


def _merge(args: argparse.Namespace) -> int:
    sets = [taskset.load(p) for p in args.sets]
    ts = taskset.merge(sets)
    taskset.save(ts, args.out)
    print(f"{len(ts.tasks)} task(s), {len(ts.demos)} demonstration(s) -> {args.out}; {_taskset_counts(ts)}")
    return 0


def _filter(args: argparse.Namespace) -> int:
    flt = taskset.TaskFilter(split=args.split, families=args.family, sources=args.source,
                             min_difficulty=args.min_difficulty, max_difficulty=args.max_difficulty)
    ts = taskset.select(taskset.load(args.set), flt, args.set)
    taskset.save(ts, args.out)
    print(f"{len(ts.tasks)} task(s), {len(ts.demos)} demonstration(s) -> {args.out}; {_taskset_counts(ts)}")
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="flashpost-factory", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="run the pipeline (resumes an interrupted run in the same --out)")
    b.add_argument("--source", default="repo", choices=sorted(SOURCES),
                   help="repo: the factory on --repo; families / fixtures / toy: those task sources")
    b.add_argument("--repo", default="sample", help="local path, git URL, pypi:NAME==VERSION, or 'sample'")
    b.add_argument("--out", default="runs/factory")
    b.add_argument("--budget", type=_positive_int, default=20, help="verified tasks wanted (task_budget)")
    b.add_argument("--concurrency", type=_positive_int, default=2)
    b.add_argument("--flaky-reruns", type=int, default=3)
    b.add_argument("--gold-runs", type=int, default=2)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--solver-attempts", type=_positive_int, default=1)
    b.add_argument("--slow-hacks", action="store_true", help="also run hacks that hit the grader timeout")
    b.add_argument("--stages", nargs="*", choices=[s.NAME for s in STAGES])
    b.add_argument("--llm-base-url", default="", help="OpenAI-compatible endpoint for the LLM solver")
    b.add_argument("--llm-model", default="")
    b.add_argument("--policy-checkpoint", default="", help="solvers.policy.checkpoint: a flashpost .safetensors "
                   "checkpoint run through the inference engine as a solver")
    b.add_argument("--policy-device", default="cpu")
    b.add_argument("--policy-max-turns", type=int, default=8)
    b.add_argument("--policy-max-new-tokens", type=int, default=256)
    b.add_argument("--unit-budget", nargs="*", default=[], metavar="STAGE=SECONDS",
                   help="time budget per unit of a stage (default: each stage's BUDGET_S), e.g. solve=600")
    b.add_argument("--history-commits", type=int, default=50, help="newest commits of a git source to invert")
    b.add_argument("--n-b", type=int, default=0, help="--source families: family-B train tasks (default budget/2)")
    b.add_argument("--n-heldout", type=int, default=0,
                   help="--source families: held-out tasks per family (default budget/4)")
    b.add_argument("--recovery-share", type=float, default=0.25,
                   help="--source families: share of demonstrations with a failed first edit and its recovery")
    b.set_defaults(fn=_build)
    i = sub.add_parser("inspect", help="per-task gate results")
    i.add_argument("dir")
    i.add_argument("--rerun", action="store_true")
    i.set_defaults(fn=_inspect)
    s = sub.add_parser("show", help="one task's records")
    s.add_argument("dir")
    s.add_argument("task_id")
    s.add_argument("--max-chars", type=int, default=20000)
    s.set_defaults(fn=_show)
    t = sub.add_parser("stats", help="stage funnel with drop reasons")
    t.add_argument("dir")
    t.add_argument("--json", action="store_true")
    t.set_defaults(fn=_stats)
    ts = sub.add_parser("tasks", help="merge or filter task sets").add_subparsers(dest="tasks_cmd", required=True)
    m = ts.add_parser("merge", help="one task set from several")
    m.add_argument("out")
    m.add_argument("sets", nargs="+")
    m.set_defaults(fn=_merge)
    f = ts.add_parser("filter", help="the tasks of a set that match, with their demonstrations")
    f.add_argument("set")
    f.add_argument("out")
    f.add_argument("--split", default="", choices=["", *taskset.SPLITS])
    f.add_argument("--family", action="append", default=[], help="keep this family (repeatable)")
    f.add_argument("--source", action="append", default=[], help="keep this repository or generator (repeatable)")
    f.add_argument("--min-difficulty", type=float, default=0.0)
    f.add_argument("--max-difficulty", type=float, default=1.0)
    f.set_defaults(fn=_filter)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        _check_args(args)
        return args.fn(args)
    except (FactoryInputError, taskset.TaskSetError) as e:
        print(f"flashpost-factory {args.cmd}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return _interrupted(args)


def _check_args(args: argparse.Namespace) -> None:
    """Bad input fails here, before any stage runs (build's options are checked by run_factory)."""
    if args.cmd in ("stats", "show") and (Path(args.dir) / TASKSET_DIR / taskset.META_FILE).exists():
        return  # a task set written by `build --source families|fixtures|toy` has no stage journals
    if args.cmd in ("stats", "show", "inspect"):
        validate.check_run_dir(args.dir, [s.NAME for s in STAGES])


def _interrupted(args: argparse.Namespace) -> NoReturn:
    """Ctrl-C: finished units are in the journals; remove this process's containers and say how to resume."""
    from envs import engine

    if engine.engine_available():
        engine.reap_containers({engine.LABEL_OWNER: engine.owner_id()})
    if args.cmd == "build":
        print(f"interrupted; finished units are kept in {args.out}: rerun the same command to resume",
              file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    # abandoned units may hold executor threads that interpreter shutdown would wait for (minutes)
    os._exit(130)


def _unit_budgets(items: list[str]) -> dict[str, float]:
    """`--unit-budget solve=120 inspect=600` -> {"solve": 120.0, "inspect": 600.0} (values checked by run_factory)."""
    out = {}
    for item in items:
        stage, sep, seconds = item.partition("=")
        try:
            out[stage] = float(seconds)
        except ValueError:
            raise FactoryInputError(f"--unit-budget {item!r}: give STAGE=SECONDS, e.g. solve=600") from None
    return out


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


if __name__ == "__main__":
    raise SystemExit(main())
