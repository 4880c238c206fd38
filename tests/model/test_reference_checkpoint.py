"""The official checkpoint layout as the released inference code saves it, loaded strictly.

A reference `Transformer.state_dict()` differs from flashpost's in four ways, each tested here on
self-made small weights (the `debug` flavor, which has Engram layers and a DSpark drafter):
the drafter's tied copies `mtp.{k}.embed.weight` / `mtp.{k}.head.weight`, FP8 Engram table rows
with one UE8M0 scale per 32 columns, FP4 routed experts (E2M1 two per byte, UE8M0 per 32 along K)
and FP8 Linears with 32x32 UE8M0 block scales. Values are compared exactly: dequantisation
multiplies codes by powers of two, exact in fp32.
"""

import pytest
import torch
from safetensors.torch import save_file

from model.checkpoint import load_checkpoint
from model.config import get_flavor
from model.quant import FP8_MAX, dequantize_fp4, fast_round_scale, pack_e2m1, quantize_fp8, quantize_mxfp4
from model.transformer import Transformer

# Linears the released code stores in FP8 (model_reference §3.0), by name suffix; a sample of them
FP8_LINEARS = (
    ".attn.wq_a.weight",
    ".attn.wkv.weight",
    ".shared_experts.w2.weight",
    ".engram.wkv.weight",
    ".main_proj.weight",
)


def _fp8_blocks(w: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [R, C] -> (float8_e4m3fn [R, C], UE8M0 [ceil(R/32), C/32]): the checkpoint's dense FP8."""
    rows, cols = w.shape
    wp = torch.cat([w, w.new_zeros(-rows % block, cols)])
    tiles = wp.unflatten(0, (-1, block)).unflatten(-1, (-1, block))
    s = fast_round_scale(tiles.abs().amax(dim=(1, 3)).clamp_min(1e-4), 1 / FP8_MAX)
    q = (tiles / s[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.flatten(2, 3).flatten(0, 1)[:rows].contiguous(), s.to(torch.float8_e8m0fnu)


def _reference_state_dict(model: Transformer) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the released layout of `model`'s weights, the fp32 value each loaded parameter must get)."""
    state, expect = {}, {}
    for name, t in model.state_dict().items():
        t = t.detach().float()
        if name.endswith(".engram.embed.weight"):
            q, s = quantize_fp8(t, 32)
            state[name], state[name[: -len("weight")] + "scale"] = q, s.to(torch.float8_e8m0fnu)
            expect[name] = q.float() * s.repeat_interleave(32, -1)
        elif ".ffn.experts." in name:
            codes, s = quantize_mxfp4(t, 32)
            state[name] = pack_e2m1(codes).view(torch.float4_e2m1fn_x2)
            state[name[: -len("weight")] + "scale"] = s.to(torch.float8_e8m0fnu)
            expect[name] = dequantize_fp4(codes, s)
        elif name.endswith(FP8_LINEARS):
            q, s = _fp8_blocks(t)
            state[name], state[name[: -len("weight")] + "scale"] = q, s
            grid = s.float().repeat_interleave(32, 0)[: t.size(0)].repeat_interleave(32, 1)
            expect[name] = q.float() * grid
        else:
            state[name] = model.state_dict()[name].detach().clone()
            expect[name] = t
    for k in range(model.args.n_mtp_layers):  # the drafter's tied copies, as Transformer.state_dict() lists them
        state[f"mtp.{k}.embed.weight"] = state["embed.weight"].clone()
        state[f"mtp.{k}.head.weight"] = state["head.weight"].clone()
    return state, expect


@pytest.fixture(scope="module")
def src() -> Transformer:
    model = Transformer(get_flavor("debug"))
    model.init_weights(seed=3, std=0.1)
    return model


def test_reference_state_dict_loads_strictly(src, tmp_path):
    state, expect = _reference_state_dict(src)
    kinds = {str(t.dtype) for t in state.values()}
    assert {"torch.float8_e4m3fn", "torch.float8_e8m0fnu", "torch.float4_e2m1fn_x2"} <= kinds
    save_file(state, str(tmp_path / "ref.safetensors"))  # as saved: copies, not aliases
    dst = Transformer(get_flavor("debug"))
    report = load_checkpoint(dst, tmp_path / "ref.safetensors")
    assert report.missing == [] and report.unexpected == []
    got = dst.state_dict()
    for name, value in expect.items():
        assert torch.equal(got[name].float(), value.to(got[name].dtype).float()), name
    # the drafter still shares the backbone's embedding and head
    assert "mtp.0.embed.weight" not in got and "mtp.0.head.weight" not in got


def test_engram_rows_dequantise_with_their_row_scales(src, tmp_path):
    state, _ = _reference_state_dict(src)
    name = "layers.3.engram.embed.weight"
    rows, cols = state[name].shape
    # one scale per (row, 32 columns): distinct powers of two make a misread grid visible
    exps = torch.arange(rows * (cols // 32)).remainder(7).sub(3).view(rows, cols // 32).float()
    state[name[: -len("weight")] + "scale"] = torch.pow(2.0, exps).to(torch.float8_e8m0fnu)
    save_file(state, str(tmp_path / "ref.safetensors"))
    dst = Transformer(get_flavor("debug"))
    load_checkpoint(dst, tmp_path / "ref.safetensors")
    want = state[name].float() * torch.pow(2.0, exps).repeat_interleave(32, -1)
    assert torch.equal(dst.layers[3].engram.embed.weight.float(), want)


def test_drafter_copy_that_is_not_the_backbones_is_refused(src, tmp_path):
    state, _ = _reference_state_dict(src)
    state["mtp.0.head.weight"] = state["mtp.0.head.weight"] + 1
    save_file(state, str(tmp_path / "ref.safetensors"))
    with pytest.raises(ValueError, match=r"drafter copies .*\n.*mtp\.0\.head\.weight: differs from head\.weight"):
        load_checkpoint(Transformer(get_flavor("debug")), tmp_path / "ref.safetensors")


def test_unknown_names_and_shapes_that_do_not_fit_are_listed(src, tmp_path):
    state, _ = _reference_state_dict(src)
    state["layers.0.attn.wq_c.weight"] = torch.zeros(4, 4)
    state["layers.1.ffn.experts.0.w1.scale"] = state["layers.1.ffn.experts.0.w1.scale"][:, :3].contiguous()
    state["layers.2.attn.wo_b.weight"] = state["layers.2.attn.wo_b.weight"][:-1].contiguous()
    save_file(state, str(tmp_path / "ref.safetensors"))
    with pytest.raises(ValueError) as err:
        load_checkpoint(Transformer(get_flavor("debug")), tmp_path / "ref.safetensors")
    msg = str(err.value)
    assert "unexpected in checkpoint (1):\n    layers.0.attn.wq_c.weight" in msg
    assert "layers.2.attn.wo_b.weight: checkpoint" in msg and "shape mismatch" in msg
    assert "layers.1.ffn.experts.0.w1.scale: [64, 3] is no block grid of layers.1.ffn.experts.0.w1.weight" in msg
