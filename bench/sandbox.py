"""Sandbox/grading benchmark on the local engine; prints one JSON line per measurement.

Measures container start, exec round trip, grading in a fresh grader vs a warm GraderPool,
warm grading throughput with several graders, and agent episodes per minute at 1, 4 and 16
concurrent sandboxes (episode = start a sandbox of the task image, a few execs that apply the
gold patch, grade through the shared pool).
Not a test: it asserts nothing beyond the rewards being right.

Usage: python -m bench.sandbox [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from envs import engine
from envs.fixtures.build import fixture_tasks
from envs.grading import grade_patch, grade_sandbox
from envs.pool import GraderPool, SandboxPool
from envs.sandbox import Sandbox
from envs.task import Task


def emit(metric: str, **fields) -> None:
    # The 1-minute load average tells whether other work shared the machine during a measurement.
    print(json.dumps({"metric": metric, **fields, "loadavg_1m": round(os.getloadavg()[0], 1)}), flush=True)


def pcts(xs: list[float]) -> dict:
    xs = sorted(xs)
    p95 = xs[min(len(xs) - 1, round(0.95 * (len(xs) - 1)))]
    return {
        "n": len(xs),
        "p50_s": round(statistics.median(xs), 4),
        "p95_s": round(p95, 4),
        "mean_s": round(statistics.fmean(xs), 4),
    }


def bench_start(image: str, n: int) -> None:
    starts, stops = [], []
    for _ in range(n):
        t0 = time.monotonic()
        sb = Sandbox(image).start()
        t1 = time.monotonic()
        sb.close()
        starts.append(t1 - t0)
        stops.append(time.monotonic() - t1)
    emit("container_start", image=image, **pcts(starts))
    emit("container_remove", **pcts(stops))


def bench_exec(image: str, n: int) -> None:
    with Sandbox(image) as sb:
        rtts = []
        for _ in range(n):
            t0 = time.monotonic()
            r = sb.exec("true", timeout=10)
            rtts.append(time.monotonic() - t0)
            assert r.exit_code == 0
        emit("exec_round_trip", cmd="true", **pcts(rtts))


def bench_grading(task: Task, n: int) -> None:
    fresh = []
    for _ in range(n):
        r = grade_patch(task, task.gold_patch)
        assert r.reward == 1.0, r.reason
        fresh.append(r.duration_s)
    emit("grading_fresh_container", task=task.task_id, **pcts(fresh))
    with GraderPool(max_graders=1) as pool:
        pool.warm(task.image, 1)
        warm = []
        for i in range(n):
            r = grade_patch(task, task.gold_patch if i % 2 == 0 else "", pool=pool)
            assert r.reward == (1.0 if i % 2 == 0 else 0.0), r.reason
            warm.append(r.duration_s)
        emit("grading_warm_pool", task=task.task_id, pool_stats=pool.stats, **pcts(warm))


def bench_grading_throughput(tasks: list[Task], graders_per_image: int, n: int) -> None:
    """Gradings per minute with warm pools, `graders_per_image` concurrent graders per image."""
    workers = graders_per_image * len(tasks)
    with GraderPool(max_graders=workers, graders_per_image=graders_per_image) as pool:
        for task in tasks:
            pool.warm(task.image, graders_per_image)
        t0 = time.monotonic()
        with ThreadPoolExecutor(workers) as ex:
            rewards = list(ex.map(lambda i: grade_patch(tasks[i % len(tasks)], tasks[i % len(tasks)].gold_patch,
                                                        pool=pool).reward, range(n)))
        wall = time.monotonic() - t0
        assert rewards == [1.0] * n
        emit("grading_throughput_warm", graders=workers, gradings=n, wall_s=round(wall, 2),
             gradings_per_min=round(60 * n / wall, 1), pool_stats=pool.stats, cpus=os.cpu_count())


def episode(pool: SandboxPool, graders: GraderPool, task: Task) -> float:
    with pool.sandbox(task.image) as sb:
        sb.exec("git status --short && head -n 20 " + task.test_files[0], timeout=30)
        sb.write_file("/tmp/fix.patch", task.gold_patch)
        r = sb.exec("git apply /tmp/fix.patch && git diff --stat", timeout=30)
        assert r.exit_code == 0, r.output
        return grade_sandbox(sb, task, pool=graders).reward


def bench_episodes(tasks: list[Task], concurrency: int, n_episodes: int) -> None:
    pool = SandboxPool(max_concurrent=concurrency, reap_stale=False)
    with GraderPool(max_graders=concurrency, graders_per_image=2, wait_s=60) as graders:
        t0 = time.monotonic()
        with ThreadPoolExecutor(concurrency) as ex:
            rewards = list(ex.map(lambda i: episode(pool, graders, tasks[i % len(tasks)]), range(n_episodes)))
        wall = time.monotonic() - t0
        emit(
            "episodes_per_minute",
            concurrency=concurrency,
            episodes=n_episodes,
            wall_s=round(wall, 2),
            episodes_per_min=round(60 * n_episodes / wall, 1),
            mean_reward=statistics.fmean(rewards),
            grader_stats=graders.stats,
            cpus=os.cpu_count(),
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    args = ap.parse_args()
    n = 5 if args.quick else 20
    tasks = fixture_tasks()
    emit(
        "setup",
        engine=engine.client().version()["Version"],
        base_image=engine.base_image_tag(),
        storage=engine.client().info()["Driver"],
    )
    bench_start(tasks[0].image, n)
    bench_exec(tasks[0].image, 2 * n)
    bench_grading(tasks[0], n // 2)
    for per_image in (1, 2):
        bench_grading_throughput(tasks, per_image, 3 * n)
    for c in (1, 4, 16):
        bench_episodes(tasks, c, max(4 if args.quick else 8, 2 * c))


if __name__ == "__main__":
    main()
