"""Task-factory benchmark; prints one JSON line per measurement.

  python -m bench.factory --only mutations         mutation finding on a generated module (CPU only)
  python -m bench.factory --repo pypi:NAME==VER --budget 8 --concurrency 2 --out runs/bench-NAME
                                                  one factory build: funnel, wall time, tasks/hour (Docker)
  python -m bench.factory --only testenv --repo pypi:NAME==VER --tests tests/test_x.py
                                                  the library's test environment (declared test wheels),
                                                  and the given test files' outcomes in it (Docker)

`mutations`: seconds per 1,000 lines to parse and index a file once (`SourceIndex`), to query 20 of
its lines (what the search solver asks per task), and to scan it whole (what specify does per file),
at two module sizes, so a line that does not grow with the size shows the query does not either.
Not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import time


def emit(metric: str, **fields) -> None:
    # The 1-minute load average tells whether other work shared the machine during a measurement.
    print(json.dumps({"metric": metric, **fields, "loadavg_1m": round(os.getloadavg()[0], 1)}), flush=True)


def generated_module(n_lines: int) -> str:
    """A module of at least n_lines: classes of small methods (the shape of a large real library file), each
    method's last line distinct (a fix must be findable text, as in a real file)."""
    out = ['"""Generated."""\n', "from __future__ import annotations\n"]
    i = 0
    while len(out) < n_lines:
        out += [f"\n\nclass C{i}:\n", f'    """Class {i}."""\n', "\n"]
        for j in range(8):
            out += [f"    def m{j}(self, xs, limit={j}):\n", "        total = 0\n",
                    "        for k in range(len(xs)):\n", "            if xs[k] < limit and k % 2 == 0:\n",
                    f"                total += xs[k] * {j + 1}\n",
                    f"        return max(total, limit) - 1  # C{i}.m{j}\n", "\n"]
        i += 1
    return "".join(out)


def bench_mutations(sizes: tuple[int, ...] = (2_000, 10_000)) -> None:
    from synth import mutations

    for n in sizes:
        source = generated_module(n)
        lines = source.count("\n")
        t0 = time.perf_counter()
        index = mutations.SourceIndex("big.py", source)
        t1 = time.perf_counter()
        wanted = set(range(lines // 2, lines // 2 + 40, 2))
        found = index.find(wanted)
        t2 = time.perf_counter()
        everything = index.find()
        t3 = time.perf_counter()
        per_k = 1000 / lines
        emit("mutations", lines=lines, index_s_per_1k_lines=round((t1 - t0) * per_k, 4),
             query_20_lines_s=round(t2 - t1, 4), query_candidates=len(found),
             full_scan_s_per_1k_lines=round((t3 - t2) * per_k, 4), full_scan_mutations=len(everything))


def bench_build(repo: str, out: str, budget: int, concurrency: int) -> None:
    from synth.config import FactoryOptions
    from synth.runner import run_factory

    t0 = time.monotonic()
    result = run_factory(FactoryOptions(repo=repo, out_dir=out, task_budget=budget, concurrency=concurrency),
                         progress=False)
    wall = time.monotonic() - t0
    funnel = {k: {"in": f["in"], "out": f["out"], "drops": f["drops"]} for k, f in result["funnel"].items()}
    emit("factory_build", repo=repo, budget=budget, concurrency=concurrency, cores=os.cpu_count(),
         tasks=result["tasks"], wall_s=round(wall, 1), tasks_per_hour=round(result["tasks"] * 3600 / wall, 2),
         stage_seconds=result["stage_seconds"], funnel=funnel)


def bench_testenv(repo: str, tests: list[str]) -> None:
    import tempfile
    from collections import Counter
    from pathlib import Path

    from synth import testenv
    from synth.stages.build import build_tree_image, repo_files
    from synth.stages.ingest import fetch_pypi, source_key
    from synth.testrun import probe_task, run_suite

    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        files = repo_files(fetch_pypi(repo.removeprefix("pypi:"), Path(tmp)) if repo.startswith("pypi:") else repo)
    files = {k: v for k, v in files.items() if ".egg-info/" not in k}
    env = testenv.resolve(files)
    image = build_tree_image(files, f"flashpost/synth-repo:bench-testenv-{source_key(repo)}")
    run = run_suite(probe_task(image, tests, p2p=tests), "", timeout_s=600)
    emit("factory_testenv", repo=repo, requirements=env.requirements, skipped=env.skipped, wheels=sorted(env.wheels),
         tests=tests, outcomes=dict(Counter(s for t, s in run.statuses.items() if t not in tests)),
         seconds=round(time.monotonic() - t0, 1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", choices=["mutations", "build", "testenv"], default=None)
    p.add_argument("--repo", default="")
    p.add_argument("--out", default="runs/bench-factory")
    p.add_argument("--budget", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--tests", nargs="*", default=[], help="test files to run (--only testenv)")
    args = p.parse_args()
    if args.only in (None, "mutations"):
        bench_mutations()
    if args.only == "build" or (args.only is None and args.repo):
        if not args.repo:
            p.error("--only build needs --repo (a path, git URL or pypi:NAME==VERSION)")
        bench_build(args.repo, args.out, args.budget, args.concurrency)
    if args.only == "testenv":
        if not args.repo or not args.tests:
            p.error("--only testenv needs --repo and --tests")
        bench_testenv(args.repo, args.tests)


if __name__ == "__main__":
    main()
