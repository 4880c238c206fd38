"""Time one training step (forward + backward of cross-entropy + indexer loss) of the backbone.

    python bench/model_step.py                      # debug and tiny on CPU, small on CUDA if present
    python bench/model_step.py --flavor tiny --batch 4 --seqlen 512 --steps 3

Prints one JSON line per flavor: {flavor, device, dtype, batch, seqlen, step_ms, tokens_per_s,
flops_per_token, mfu}. FLOPs per token (training, analytic):
    6 * N_active                                   (matmul params: all but the embedding table, with
                                                    routed experts scaled by activated/routed)
  + 12 * sum_layers H * Dh * K_attn                (QK^T and PV, fwd + bwd, K_attn = mean attended
                                                    window + selected compressed entries per query)
  + 6 * sum_index_layers I * Di * G_vis            (indexer scores over the mean visible groups)
MFU = flops_per_token * tokens_per_s / peak; peak = 989 TFLOP/s dense bf16 on an H100/H200, given
by --peak-tflops elsewhere (CPU: null unless given). Not a kernel benchmark (see kernels/).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from model.config import ModelArgs, get_flavor  # noqa: E402
from model.transformer import Transformer  # noqa: E402

PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0}
DEFAULTS = {"debug": (2, 64), "tiny": (4, 512), "small": (1, 4096)}  # (batch, seqlen)


def active_params(model: Transformer) -> float:
    a = model.args
    total = 0.0
    for name, p in model.named_parameters():
        if name == "embed.weight" or p.ndim < 2:
            continue  # a lookup, not a matmul; vectors are negligible
        frac = a.n_activated_experts / a.n_routed_experts if ".ffn.experts." in name else 1.0
        total += p.numel() * frac
    return total


def flops_per_token(model: Transformer, seqlen: int) -> float:
    a = model.args
    pos = torch.arange(seqlen, dtype=torch.float64)
    win = pos.add(1).clamp(max=a.window_size).mean().item()
    attn = index = 0.0
    for i in range(a.n_layers):
        r = a.compress_ratio(i)
        k_attn = win
        if r:
            vis = ((pos + 1) // r).double()
            k_attn += vis.clamp(max=a.index_topk).mean().item()
            if a.is_index_source(i):
                index += a.index_n_heads * a.index_head_dim * vis.mean().item()
        attn += a.n_heads * a.head_dim * k_attn
    return 6 * active_params(model) + 12 * attn + 6 * index


def random_engram_inputs(args: ModelArgs, batch: int, seqlen: int, device: torch.device) -> dict | None:
    """Uniform bucket ids per Engram hash column, in range for each column's table slice: the lookup
    costs what real hashes cost, without a tokenizer of the flavor's vocabulary (small/flash have none)."""
    if not args.engram_layer_ids:
        return None
    from model.engram import engram_layout

    layout = engram_layout(args)
    cols = []
    for layer_offsets, layer_primes in zip(layout.offsets, layout.primes):
        flat = [p for order in layer_primes for p in order]
        cols.append(torch.stack([torch.randint(0, p, (batch, seqlen)) + o for p, o in zip(flat, layer_offsets)], -1))
    return {"hashes": torch.stack(cols, dim=2).to(device), "engram_mask": None}


def peak_flops(device: torch.device, override: float | None) -> float | None:
    if override:
        return override * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v * 1e12 for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)


def build_model(args: ModelArgs, device: torch.device) -> Transformer:
    """An initialised model in the benchmark dtype (bf16 on CUDA, fp32 on CPU), on `device`."""
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16 if device.type == "cuda" else torch.float32)
    try:
        model = Transformer(args)
    finally:
        torch.set_default_dtype(prev)
    model.init_weights()
    return model.to(device)


def bench(args: ModelArgs, flavor: str, device: torch.device, batch: int, seqlen: int, steps: int, peak):
    model = build_model(args, device)
    ids = torch.randint(0, args.vocab_size, (batch, seqlen + 1), device=device)
    engram_inputs = random_engram_inputs(args, batch, seqlen, device)

    def step():
        out = model(ids[:, :-1], engram_inputs=engram_inputs)
        loss = F.cross_entropy(out.logits.flatten(0, 1), ids[:, 1:].flatten()) + out.indexer_loss
        loss.backward()
        model.zero_grad(set_to_none=True)

    step()  # warm-up
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    step_s = (time.perf_counter() - t0) / steps
    tps = batch * seqlen / step_s
    fpt = flops_per_token(model, seqlen)
    return {
        "flavor": flavor,
        "device": str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
        "dtype": str(model.embed.weight.dtype).removeprefix("torch."),
        "batch": batch,
        "seqlen": seqlen,
        "step_ms": round(step_s * 1e3, 2),
        "tokens_per_s": round(tps, 1),
        "flops_per_token": round(fpt),
        "mfu": None if peak is None else round(fpt * tps / peak, 5),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--flavor", action="append", choices=sorted(DEFAULTS), help="repeatable")
    p.add_argument("--batch", type=int)
    p.add_argument("--seqlen", type=int)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--device", default=None, help="cpu / cuda (default: cpu for debug/tiny, cuda for small)")
    p.add_argument("--peak-tflops", type=float, default=None)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ns = p.parse_args(argv)
    if ns.threads:
        torch.set_num_threads(ns.threads)
    flavors = ns.flavor or ["debug", "tiny"] + (["small"] if torch.cuda.is_available() else [])
    for flavor in flavors:
        device = torch.device(ns.device or ("cuda" if flavor == "small" else "cpu"))
        batch, seqlen = DEFAULTS[flavor]
        row = bench(
            get_flavor(flavor), flavor, device, ns.batch or batch, ns.seqlen or seqlen, ns.steps,
            peak_flops(device, ns.peak_tflops),
        )  # fmt: skip
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
