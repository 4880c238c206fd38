"""`make bench`: every CPU benchmark in turn, each printing its own JSON lines.

GPU benchmarks (kernels, `small` model steps) run on the lent H200 instead; see bench/README.md.
A benchmark that fails is reported and the others still run; the exit code says whether all passed.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
CPU_BENCHES = [
    ["accounting.py", "flash"],
    ["model_step.py", "--flavor", "debug", "--flavor", "tiny"],
    ["decode.py", "--flavor", "debug", "--flavor", "tiny"],
    ["prefill.py", "--flavor", "tiny", "--lengths", "256", "1024"],
    ["sandbox.py", "--quick"],
    ["rl_throughput.py"],
    ["rl_learning.py"],
    ["dspark_alignment.py"],
]


def main() -> int:
    failed = []
    for script, *args in CPU_BENCHES:
        print(f"# bench/{script} {' '.join(args)}", flush=True)
        t0 = time.perf_counter()
        module = f"bench.{script.removesuffix('.py')}"  # -m from the repo root: imports resolve without installs
        rc = subprocess.call([sys.executable, "-m", module, *args], cwd=BENCH.parent)
        print(f"# bench/{script}: exit {rc} after {time.perf_counter() - t0:.1f} s", flush=True)
        if rc:
            failed.append(script)
    if failed:
        print(f"# failed: {failed}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
