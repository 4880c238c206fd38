"""Checks of what a user gives the factory, made before any stage runs: each failure is a
`FactoryInputError` whose message names the problem and the fix (synth/cli.py prints it and exits 2).

- options: a positive budget, concurrency and solver budget, non-negative retries;
- the source: a folder that exists, a git URL `git ls-remote` answers, or a `pypi:` requirement whose
  sdist pip can download (the same fetch ingest makes);
- the output folder: new, empty, or a run of the same source (a rerun resumes it);
- a folder given to stats/show/inspect: a factory run (options.json or a stage journal).
Not here: fetching for real (synth/stages/ingest.py) or running anything.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path

from synth.config import FactoryOptions

_REPO_FORMS = "a local folder, a git URL, pypi:NAME==VERSION or 'sample'"


class FactoryInputError(ValueError):
    """Bad input to the factory; the message says what to change."""


def check_options(opts: FactoryOptions, stage_names: list[str]) -> None:
    for name in ("task_budget", "concurrency", "solver_budget", "solver_attempts", "gold_runs"):
        value = getattr(opts, name)
        if not isinstance(value, int) or value < 1:
            raise FactoryInputError(f"{name} must be a positive integer, got {value!r}")
    for name in ("retries", "flaky_reruns", "history_commits"):
        value = getattr(opts, name)
        if not isinstance(value, int) or value < 0:
            raise FactoryInputError(f"{name} must be 0 or more, got {value!r}")
    for stage, seconds in opts.unit_budget_s.items():
        if stage not in stage_names:
            raise FactoryInputError(f"unit_budget_s names no stage {stage!r}; stages: {', '.join(stage_names)}")
        if not isinstance(seconds, (int, float)) or seconds <= 0:
            raise FactoryInputError(f"unit_budget_s[{stage!r}] must be a positive number of seconds, got {seconds!r}")


def check_build(opts: FactoryOptions, stage_names: list[str], wanted: set[str]) -> None:
    """Everything `run_factory` needs of its options, checked before the first stage starts."""
    check_options(opts, stage_names)
    check_out_dir(opts.out_dir, opts.repo)
    if "ingest" in wanted:
        check_source(opts.source)


def is_url(source: str) -> bool:
    return "://" in source or source.startswith("git@")


def canonical_source(source: str) -> str:
    """What identifies a source across runs: an existing local path resolved, anything else as given."""
    if source == "sample" or is_url(source) or source.startswith("pypi:"):
        return source
    return str(Path(source).expanduser().resolve())


def check_source(source: str) -> None:
    """Fail now if ingest could not fetch `source`."""
    if source.startswith("pypi:"):
        from synth.stages.ingest import FetchError, fetch_pypi

        spec = source[len("pypi:"):]
        if not spec.strip():
            raise FactoryInputError(f"--repo {source!r} names no package; use pypi:NAME==VERSION")
        with tempfile.TemporaryDirectory() as tmp:
            try:
                fetch_pypi(spec, Path(tmp))
            except FetchError as e:
                raise FactoryInputError(f"cannot fetch --repo {source}: {e}; check the name and version on "
                                        "PyPI (the factory needs its sdist)") from None
        return
    if is_url(source):
        try:
            proc = subprocess.run(["git", "ls-remote", "--exit-code", source, "HEAD"], capture_output=True,
                                  text=True, timeout=120)
        except subprocess.TimeoutExpired:
            raise FactoryInputError(f"cannot reach git repository {source} (no answer in 120 s)") from None
        if proc.returncode != 0:
            detail = (proc.stderr.strip().splitlines() or ["no HEAD"])[-1]
            raise FactoryInputError(f"cannot fetch git repository {source}: {detail}; check the URL") from None
        return
    if source == "sample":
        return
    path = Path(source).expanduser()
    if not path.exists():
        raise FactoryInputError(f"--repo {source}: no such folder; give {_REPO_FORMS}")
    if not path.is_dir():
        raise FactoryInputError(f"--repo {source} is a file, not a folder; give {_REPO_FORMS}")


def check_out_dir(out_dir: str | Path, repo: str) -> None:
    """The output folder is new, empty, or an earlier run of the same source."""
    out = Path(out_dir)
    if not out.exists():
        return
    if not out.is_dir():
        raise FactoryInputError(f"--out {out} is a file; give a folder for the run")
    options = out / "options.json"
    if options.exists():
        try:
            earlier = json.loads(options.read_text()).get("repo", "")
        except ValueError:
            raise FactoryInputError(f"{options} is not valid JSON; remove {out} or pick another --out") from None
        if canonical_source(earlier) != canonical_source(repo):
            raise FactoryInputError(f"--out {out} holds a run of {earlier!r}, not {repo!r}; pick another --out "
                                    "(or remove that folder to start over)")
        return
    if any(out.iterdir()):
        raise FactoryInputError(f"--out {out} is not empty and holds no factory run (no options.json); "
                                "pick a new or empty folder")


def check_run_dir(run_dir: str | Path, stage_names: list[str]) -> None:
    """`run_dir` is the output of a factory build (options.json, or at least one stage journal)."""
    run = Path(run_dir)
    if not run.is_dir():
        raise FactoryInputError(f"{run}: no such folder; give the --out folder of a `flashpost-factory build`")
    if not (run / "options.json").exists() and not any((run / s / "records.jsonl").exists() for s in stage_names):
        raise FactoryInputError(f"{run} is not a factory run (no options.json, no stage journals); give the --out "
                                "folder of a `flashpost-factory build`")
