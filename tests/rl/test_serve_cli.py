"""The `flashpost-serve` entry point as users launch it (Hydra overrides, a subprocess on a free loopback
port) answers /health and a chat completion; bench/serve_load.py with 32 concurrent clients for a few
seconds loses no request and reports latency percentiles and tokens/s."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_flashpost_serve_entry_point_serves_chat(tmp_path):
    from openai import OpenAI

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "rl.serve", "model=debug", "+model.overrides.vocab_size=4096",
           "+model.overrides.engram_compressed_vocab_size=2742", "serve.model_name=debug", f"serve.port={port}"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as resp:
                    health = json.loads(resp.read())
                break
            except OSError:
                assert time.monotonic() < deadline, "flashpost-serve did not come up"
                time.sleep(0.5)
        assert health["status"] == "ok" and health["policy_version"] == 0
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0)
        r = client.chat.completions.create(model="debug", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert 1 <= len(r.choices[0].model_extra["token_ids"]) <= 4
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert not list(tmp_path.iterdir()), "the server writes nothing into its working folder"


def test_load_bench_32_clients_lose_no_request(capsys):
    from bench.serve_load import parse_args, run

    summary = run(parse_args(["--clients", "32", "--seconds", "3", "--max-tokens", "4", "--model", "debug"]))
    assert summary["lost"] == 0 and summary["replied"] == summary["requests"] >= 32
    assert 0 < summary["p50_latency_s"] <= summary["p99_latency_s"] and summary["tokens_per_s"] > 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert lines[-1]["kind"] == "summary" and all(x["kind"] == "window" for x in lines[:-1])
