"""Numerical parity of CED prefill and of its training simulation (model/ced.py, model/replay.py).

    python -m bench.ced_parity                          # tiny on CPU, QAT on and off
    python -m bench.ced_parity --flavor debug --seeds 0 1 2 3

JSON lines. kind "prefill": CED vs full-stack prefill of one random prompt of n tokens: next-token
logits max/mean abs difference and whether 16 greedy tokens after it agree (exact for n <= window).
kind "simulation": multi-turn rollouts sampled at temperature 1 by the CED engine (4 turns: a prompt of
5 windows, then tool results of 7 tokens, a window + 21 and two windows; --new-tokens per turn): mean/max abs
difference between the engine's per-token log-probs and those of `simulated_forward` (sim_*) and of
the plain teacher-forced forward (plain_*), and the tokens the decoder layers ran over with the
simulation vs the whole rows. kind "prefix_replay": next-token logits after continuing a stored prefix
whose window-pool entry expired (encoder bounded replay, model/prefix_cache.py) vs the warm cache.
Random weights from `init_weights(seed)` (std 0.02). Not a timing bench.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

import torch  # noqa: E402

from model.ced import ced_prefill  # noqa: E402
from model.config import get_flavor  # noqa: E402
from model.engine import InferenceEngine  # noqa: E402
from model.engram import EngramHasher  # noqa: E402
from model.prefix_cache import PrefixCache  # noqa: E402
from model.replay import simulated_forward  # noqa: E402
from model.tokenizer import Tokenizer  # noqa: E402
from model.transformer import ModelCache, Transformer  # noqa: E402

OVERRIDES = {"debug": {"vocab_size": 4096, "engram_compressed_vocab_size": 2742}}  # default tokenizer ids


def build(flavor: str, qat: bool, seed: int) -> Transformer:
    args = get_flavor(flavor, qat=qat, **OVERRIDES.get(flavor, {}))
    model = Transformer(args, engram_hasher=EngramHasher(args, Tokenizer.default()))
    model.init_weights(seed=seed)
    return model.eval()


@torch.no_grad()
def prefill_parity(model: Transformer, n: int, seed: int) -> dict:
    a = model.args
    ids = torch.randint(32, a.vocab_size, (1, n), generator=torch.Generator().manual_seed(seed))
    full_cache, ced_cache = ModelCache(), ModelCache(encoder_out_len=a.window_size)
    full = model.forward_incremental(ids, 0, full_cache)[:, -1]
    ced, _, _ = ced_prefill(model, ids, 0, ced_cache)
    diff = (ced - full).abs()
    same = True
    for _ in range(16):
        t_full, t_ced = full.argmax(-1), ced.argmax(-1)
        same &= bool(torch.equal(t_full, t_ced))
        full = model.forward_incremental(t_full[:, None], full_cache.seq_len, full_cache)[:, -1]
        ced = model.forward_incremental(t_ced[:, None], ced_cache.seq_len, ced_cache)[:, -1]
    return {"max_abs": diff.max().item(), "mean_abs": diff.mean().item(), "greedy16_equal": same}


@torch.no_grad()
def prefix_replay_parity(model: Transformer, prefix_len: int, rest_len: int, seed: int) -> dict:
    """Continue a stored prefix after its window-pool entry expired (encoder bounded replay) vs warm."""
    a = model.args
    g = torch.Generator().manual_seed(seed)
    prefix, rest = (torch.randint(32, a.vocab_size, (1, n), generator=g) for n in (prefix_len, rest_len))
    now = [0.0]
    pc = PrefixCache(packed=a.qat, window_ttl_s=1.0, clock=lambda: now[0])
    warm = ModelCache(encoder_out_len=a.window_size)
    ced_prefill(model, prefix, 0, warm)
    pc.store(prefix[0].tolist(), warm)
    now[0] = 2.0
    replayed, how = pc.lookup(model, prefix[0].tolist() + rest[0].tolist())
    assert how == "replayed"
    want, _, _ = ced_prefill(model, rest, prefix_len, warm)
    got, _, _ = ced_prefill(model, rest, prefix_len, replayed)
    diff = (got - want).abs()
    same = bool(got.argmax() == want.argmax())
    return {"max_abs": diff.max().item(), "mean_abs": diff.mean().item(), "argmax_equal": same}


def rollout(model: Transformer, prompt_len: int, tool_lens: list[int], new_tokens: int, seed: int):
    """One CED-engine session sampled at temperature 1: (ids [1,T], turns [(N_k, T_k)], log-probs)."""
    a = model.args
    g = torch.Generator().manual_seed(seed)

    def rand(n: int) -> list[int]:
        return torch.randint(32, a.vocab_size, (n,), generator=g).tolist()

    eng = InferenceEngine(model, prefill_mode="ced")
    sid = eng.start(rand(prompt_len))
    turns, logprobs = [], []
    for k, tool in enumerate([*tool_lens, 0]):
        gen = eng.generate([sid], new_tokens, temperature=1.0, stop_ids=(), seed=seed * 100 + k)[0]
        turns.append((gen.prompt_len, gen.prompt_len + len(gen.token_ids)))
        logprobs += gen.logprobs
        if tool:
            eng.extend(sid, rand(tool))
    return torch.tensor([eng.tokens(sid)]), turns, torch.tensor(logprobs)


def generated_logprobs(logits: torch.Tensor, ids: torch.Tensor, turns) -> torch.Tensor:
    pos = torch.cat([torch.arange(n - 1, t - 1) for n, t in turns])
    logp = torch.log_softmax(logits[0, pos].float(), -1)
    return logp.gather(-1, ids[0, pos + 1, None]).squeeze(-1)


@torch.no_grad()
def simulation_parity(model: Transformer, n_traj: int, new_tokens: int, seed: int) -> dict:
    W = model.args.window_size
    sim_err, plain_err, dec_sim, dec_full, turns_all = [], [], 0, 0, []
    for j in range(n_traj):
        ids, turns, engine_lp = rollout(model, 5 * W + 37 + 5 * j, [7, W + 21, 2 * W], new_tokens, seed * 1000 + j)
        sim = simulated_forward(model, ids, [turns])
        sim_err.append(generated_logprobs(sim.logits, ids, turns) - engine_lp)
        plain_err.append(generated_logprobs(model(ids).logits, ids, turns) - engine_lp)
        dec_sim += sim.decoder_tokens
        dec_full += ids.size(1)
        turns_all.append(turns)
    s, p = torch.cat(sim_err).abs(), torch.cat(plain_err).abs()
    return {
        "n_traj": n_traj, "n_tokens": s.numel(), "turns": turns_all[0],
        "sim_mean_abs": s.mean().item(), "sim_max_abs": s.max().item(),
        "plain_mean_abs": p.mean().item(), "plain_max_abs": p.max().item(),
        "decoder_tokens_sim": dec_sim, "decoder_tokens_full": dec_full,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavor", default="tiny", choices=["debug", "tiny"])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--trajectories", type=int, default=3, help="rollouts per seed")
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--qat", choices=["on", "off", "both"], default="both")
    opts = p.parse_args(argv)
    torch.set_num_threads(opts.threads)
    for qat in {"on": (True,), "off": (False,), "both": (True, False)}[opts.qat]:
        for seed in opts.seeds:
            model = build(opts.flavor, qat, seed)
            W = model.args.window_size
            head = {"flavor": opts.flavor, "qat": qat, "seed": seed, "window": W}
            for n in (W // 2, W, 2 * W, 4 * W, model.args.max_seq_len - 16):
                print(json.dumps({"kind": "prefill", **head, "n": n, **prefill_parity(model, n, seed)}), flush=True)
            for prefix_len, rest_len in ((W - 8, 8), (4 * W, 8), (4 * W, 2 * W)):
                rep = prefix_replay_parity(model, prefix_len, rest_len, seed)
                print(json.dumps({"kind": "prefix_replay", **head, "prefix": prefix_len, "rest": rest_len, **rep}))
            sim = simulation_parity(model, opts.trajectories, opts.new_tokens, seed)
            print(json.dumps({"kind": "simulation", **head, **sim, "loadavg": os.getloadavg()}), flush=True)


if __name__ == "__main__":
    main()
