"""Load test of flashpost-serve: N concurrent clients (the official `openai` client, one thread each) send
chat completions for a bounded time (each at least one) against a server on loopback; every request must end in a reply.

    python -m bench.serve_load                              # 32 clients, 20 s, debug model served in-process, CPU
    python -m bench.serve_load --clients 32 --seconds 60 --flavor tiny --max-tokens 32
    python -m bench.serve_load --url http://127.0.0.1:8000/v1 --model flashpost   # a running flashpost-serve

A 429 (capacity) is retried by the client after a backoff, as OpenAI clients do; a request is lost when
it ends in anything but a reply (after the retries) or never returns. JSON lines: one per client-second
window (`"kind": "window"`), then the summary: requests, lost, 429s seen, p50/p99 latency of the replied
requests (seconds, retries included), completion tokens/s over the wall time, and for an in-process server
the requests per batched `generate` call and the generated tokens per model forward (1 = no sharing).
Loopback only; the loops stop by themselves.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere


def _percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def _local_server(args: argparse.Namespace):
    from model.engine import InferenceEngine
    from rl.actors import build_model
    from rl.config import ModelChoice
    from rl.serve_app import Server, ServerThread, build_app
    from rl.serve_engine import ServeConfig

    model, template = build_model(ModelChoice(flavor=args.flavor, overrides={
        "vocab_size": 4096, "engram_compressed_vocab_size": 2742, "max_seq_len": 512}))  # fmt: skip
    cfg = ServeConfig(model_name=args.model, max_pending=args.max_pending, decode_chunk=args.decode_chunk,
                      threads=args.threads)  # fmt: skip
    server = Server(InferenceEngine(model, template, max_sessions=max(256, args.max_pending)), template, cfg)
    return server, ServerThread(build_app(server)).start()


def run(args: argparse.Namespace) -> dict:
    import openai
    from openai import OpenAI

    server = thread = None
    url = args.url
    if url is None:
        server, thread = _local_server(args)
        url = thread.base_url
    lock = threading.Lock()
    latencies: list[float] = []
    tokens = [0]
    lost: list[str] = []
    sent = [0]
    clients = [OpenAI(base_url=url, api_key="-", max_retries=args.retries, timeout=args.timeout_s)
               for _ in range(args.clients)]  # built before the clock starts
    deadline = time.monotonic() + args.seconds

    def client_loop(i: int) -> None:
        client = clients[i]
        k = 0
        while k == 0 or time.monotonic() < deadline:  # every client sends at least one request
            prompt = [{"role": "user", "content": f"Client {i} request {k}: write one line of Python."}]
            t0 = time.monotonic()
            with lock:
                sent[0] += 1
            try:
                r = client.chat.completions.create(model=args.model, messages=prompt, max_tokens=args.max_tokens,
                                                   temperature=1.0, seed=i * 100_000 + k)  # fmt: skip
            except openai.OpenAIError as e:
                with lock:
                    lost.append(f"{type(e).__name__}: {e}"[:200])
            else:
                with lock:
                    latencies.append(time.monotonic() - t0)
                    tokens[0] += r.usage.completion_tokens
            k += 1

    t_start = time.monotonic()
    workers = [threading.Thread(target=client_loop, args=(i,), daemon=True) for i in range(args.clients)]
    for w in workers:
        w.start()
    last = 0
    while any(w.is_alive() for w in workers):
        time.sleep(1.0)
        with lock:
            done, n_tok = len(latencies), tokens[0]
        print(json.dumps({"kind": "window", "t_s": round(time.monotonic() - t_start, 1), "replied": done - last,
                          "replied_total": done, "tokens_total": n_tok}), flush=True)  # fmt: skip
        last = done
        if time.monotonic() > deadline + args.timeout_s * (args.retries + 1) + 30:
            break  # a request that never returns is lost, not waited for forever
    wall = time.monotonic() - t_start
    hung = sent[0] - len(latencies) - len(lost)
    summary = {
        "kind": "summary", "clients": args.clients, "seconds": args.seconds, "max_tokens": args.max_tokens,
        "requests": sent[0], "replied": len(latencies), "lost": len(lost) + hung, "lost_examples": lost[:3],
        "p50_latency_s": round(_percentile(latencies, 0.5), 4), "p99_latency_s": round(_percentile(latencies, 0.99), 4),
        "completion_tokens": tokens[0], "tokens_per_s": round(tokens[0] / wall, 2), "wall_s": round(wall, 2),
        "loadavg_1m": os.getloadavg()[0],
    }  # fmt: skip
    if server is not None:
        st, es = server.loop.stats, server.loop.engine.stats
        summary |= {"flavor": args.flavor, "engine_calls": st["engine_calls"],
                    "rows_per_engine_call": round(st["rows"] / max(st["engine_calls"], 1), 2),
                    "tokens_per_forward": round(es["tokens_generated"] / max(es["forward_calls"], 1), 2)}  # fmt: skip
        thread.stop()
        server.loop.close()
    print(json.dumps(summary), flush=True)
    return summary


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--url", default=None, help="a running server's /v1 URL; default: serve --flavor in-process")
    p.add_argument("--model", default="flashpost")
    p.add_argument("--flavor", default="debug")
    p.add_argument("--max-pending", type=int, default=64, help="in-process server: choices pending before 429")
    p.add_argument("--decode-chunk", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--retries", type=int, default=8, help="client retries of 429/5xx/connection errors")
    p.add_argument("--timeout-s", type=float, default=120.0)
    return p.parse_args(argv)


if __name__ == "__main__":
    run(parse_args())
