"""Warm-pool grading throughput on the fixture tasks; prints one JSON line per measurement.

Gradings per minute through `envs.grading.grade_patch` with a warm `GraderPool` (one grader per
fixture image, every task in turn, gold and empty patches alternating so both verdict paths are
timed), and the per-grading latency percentiles. This is the figure the grader's hardening
(patch parsing, canaries, static screen) must keep within 25% of. Not a test: it asserts only
that the rewards are right.

Usage: python -m bench.grading [--rounds N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from envs.fixtures.build import fixture_tasks
from envs.grading import grade_patch
from envs.pool import GraderPool


def emit(metric: str, **fields) -> None:
    # The 1-minute load average tells whether other work shared the machine during a measurement.
    print(json.dumps({"metric": metric, **fields, "loadavg_1m": round(os.getloadavg()[0], 1)}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4, help="gold+empty gradings per task")
    args = ap.parse_args()
    tasks = fixture_tasks()
    jobs = [(t, p, want) for _ in range(args.rounds) for t in tasks for p, want in ((t.gold_patch, 1.0), ("", 0.0))]
    with GraderPool(max_graders=len(tasks), graders_per_image=1, wait_s=60) as pool:
        for t in tasks:
            pool.warm(t.image, 1)
        grade_patch(tasks[0], "", pool=pool)  # first grading pays one-off imports in the host process

        def one(job):
            task, patch, want = job
            r = grade_patch(task, patch, pool=pool)
            assert r.reward == want, (task.task_id, r.reason)
            return r.duration_s

        t0 = time.monotonic()
        with ThreadPoolExecutor(len(tasks)) as ex:
            lat = sorted(ex.map(one, jobs))
        wall = time.monotonic() - t0
    emit("grading_throughput_warm", tasks=len(tasks), graders=len(tasks), gradings=len(jobs),
         wall_s=round(wall, 2), gradings_per_min=round(60 * len(jobs) / wall, 1),
         p50_s=round(statistics.median(lat), 3), p95_s=round(lat[round(0.95 * (len(lat) - 1))], 3),
         pool_stats=pool.stats, cpus=os.cpu_count())


if __name__ == "__main__":
    main()
