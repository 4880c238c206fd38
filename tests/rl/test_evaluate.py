"""flashpost-eval without containers: the unbiased pass@k estimator, the toy set's held-out split
through in-process episodes (JSON + markdown), and bad input stopped with a one-line error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rl.evaluate import markdown, pass_at_k

ROOT = Path(__file__).resolve().parents[2]


def test_pass_at_k_is_the_unbiased_estimator():
    assert pass_at_k(4, 0, 1) == 0.0 and pass_at_k(4, 4, 2) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # 1 - C(3,2)/C(4,2)
    assert pass_at_k(2, 1, 5) == 1.0  # k > n: any of the n passed


def _eval(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", FLASHPOST_CACHE=str(tmp_path / "cache"))
    return subprocess.run([sys.executable, "-m", "rl.evaluate", *args, f"out_dir={tmp_path / 'out'}"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)  # fmt: skip


def test_eval_reports_the_toy_heldout_split(tmp_path):
    p = _eval(tmp_path, "tasks=toy", "model=debug", "+model.overrides={vocab_size: 4096, "
              "engram_compressed_vocab_size: 2742, max_seq_len: 256}", "+rollout.max_new_tokens=6", "samples=2", "k=2")
    assert p.returncode == 0, p.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "eval.json").read_text())
    assert report["split"] == "heldout" and report["overall"]["tasks"] == 2  # 8 toy tasks, a quarter held out
    assert all(t["samples"] == 2 and t["infra_failed"] == 0 for t in report["per_task"])
    assert (tmp_path / "out" / "eval.md").read_text() == markdown(report)
    speed = report["throughput"]  # the four episodes' own counts: every one generated, decode steps are forwards
    assert speed["episodes"] == 4 and speed["tokens_generated"] > 0 and speed["wall_s"] > 0
    assert speed["forward_calls"] >= speed["decode_steps"] > 0
    # one rollout_group call for all four episodes: one progress bar counts them to the end
    assert "eval heldout episodes: 100%" in p.stderr and "4/4" in p.stderr


def test_bad_task_set_input_is_one_line_naming_the_fix(tmp_path):
    p = _eval(tmp_path, f"tasks={tmp_path / 'nothing'}")
    assert p.returncode != 0 and "Traceback" not in p.stderr
    assert "no task set at" in p.stderr and "flashpost-factory build" in p.stderr


def test_episode_record_reads_the_tool_calls_of_a_sample_s_generated_turns():
    from model.chat_template import ChatTemplate
    from model.tokenizer import Tokenizer
    from rl.evaluate import episode_record
    from rl.payloads import Trajectory

    template = ChatTemplate(Tokenizer.default())

    def turn(*names):
        msg = {"role": "assistant", "content": "", "tool_calls": [{"name": n, "arguments": {}} for n in names]}
        return {"role": "assistant", "content": None, "token_ids": template.generation_ids(msg)}

    transcript = [{"role": "user", "content": "fix it"}, turn("run_tests"), {"role": "tool", "content": "1 failed"},
                  turn("edit", "run_tests"), {"role": "tool", "content": "ok"},
                  {"role": "assistant", "content": None, "token_ids": template.tokenizer.encode("no call")}]
    traj = Trajectory(token_ids=[], loss_mask=[], logprobs=[], versions=[], turn_starts=[], transcript=transcript,
                      reward=1.0)
    record = episode_record(traj, template)
    assert record["tools"] == ["run_tests", "edit", "run_tests"] and record["reward"] == 1.0
