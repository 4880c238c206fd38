"""bench/engine_throughput.py's CPU quick mode runs as users run it (a subprocess from the repository
root) and reports one forward per decode step for sessions of mixed prompt lengths, and one CED
prefill for all of them; bench/engine_joins.py times a join both ways; bench/decode_ops.py counts a
decode step's ops by part."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_quick_mode_decodes_mixed_lengths_in_one_forward_per_step():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "bench.engine_throughput", "--device", "cpu", "--flavor", "debug", "--quick",
           "--threads", "1"]  # fmt: skip
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=True).stdout
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert [(r["sessions"], r["prefill_mode"]) for r in rows] == [(1, "full"), (1, "ced"), (4, "full"), (4, "ced")]
    mixed = rows[3]
    assert mixed["prompt_lens"][2] > 1, "the quick mode's prompts must have different lengths"
    assert mixed["prefill_forwards"] == 1  # one ragged CED prefill for every length
    assert all(r["forwards_per_decode_step"] == 1 for r in rows)
    assert all(r["decode_tokens_per_s"] > 0 and r["floor_ms_per_step"] > 0 for r in rows)


def test_profile_rows_follow_their_engine_rows_and_leave_them_as_they_were():
    """--profile adds a row after its engine's; --repeats reports the median of its timed runs."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "bench.engine_throughput", "--device", "cpu", "--flavor", "debug", "--quick",
           "--threads", "1", "--sessions", "4", "--prefill-mode", "full", "--profile", "--repeats", "3"]  # fmt: skip
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=True).stdout
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert [r["engine"] for r in rows] == ["flashpost", "profile"]
    engine, prof = rows
    # three timed runs, the row's figure their median
    runs = engine["ms_per_step_runs"]
    assert len(runs) == 3 and engine["ms_per_step"] == sorted(runs)[1]
    # the profiled steps come after the row's counters are read: still one forward per decode step
    assert engine["forwards_per_decode_step"] == 1
    assert prof["sessions"] == 4 and prof["steps"] > 0 and prof["wall_ms_per_step"] > 0
    assert prof["kernel_busy_ms_per_step"] == 0 and prof["top_kernels"] == []  # no device kernels on CPU
    names = [name for name, _, _ in prof["top_host"]]
    assert len(names) > 0 and all(ms >= 0 for _, ms, _ in prof["top_host"])


def test_joins_bench_times_extend_beside_split_and_rebuild():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "bench.engine_joins", "--device", "cpu", "--flavor", "debug", "--sessions", "3", "5",
           "--joiners", "2", "--prompt-lens", "10", "30", "--reps", "2", "--threads", "1"]  # fmt: skip
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=True).stdout
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert [(r["sessions"], r["joiners"]) for r in rows] == [(3, 2), (5, 2)]
    assert all(r["extend_ms"] > 0 and r["split_rebuild_ms"] > 0 and r["fields"] > 0 for r in rows)


def test_decode_ops_bench_counts_each_part_of_a_step():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "bench.decode_ops", "--flavor", "debug", "--sessions", "3"]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=True).stdout
    (row,) = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    ops = row["ops"]
    # every part ran inside the counted step, and they add up to it
    assert row["sessions"] == 3 and all(ops[k] > 0 for k in ("layers", "layout", "ngram_hash", "head", "rest"))
    assert row["total"] == sum(ops.values()) and row["outside_layers"] == row["total"] - ops["layers"]
    # the parts a compiled step compiles hold most of what runs outside the layers
    assert row["compiled_outside_layers"] > ops["rest"]
