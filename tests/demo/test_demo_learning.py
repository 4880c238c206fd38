"""rl/demo_learning's pieces that need no container: packing keeps documents apart and the loss on
the assistant turn only, actions become candidate files (or are refused), and one SFT step plus a
GRPO log-prob pass run on the demo policy."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from rl.config import OptimConfig
from rl.demo_learning import (
    RLConfig,
    SFTConfig,
    build_policy,
    pack,
    reward_files,
    rl_update,
    run_sft,
    sft_example,
    sft_lr_scale,
)
from rl.optim import build_optimizer
from synth.families import demo_splits, module_path


def test_pack_keeps_documents_and_masks():
    examples = [([1, 2, 3], [False, True, True]), ([4, 5], [False, True]), ([6, 7, 8, 9], [False, False, True, True])]
    ids, docs, mask = pack(examples, seq_len=6, pad_id=0)
    assert ids.tolist() == [[1, 2, 3, 4, 5, 0], [6, 7, 8, 9, 0, 0]]
    assert docs.tolist() == [[0, 0, 0, 1, 1, 2], [0, 0, 0, 0, 1, 1]]
    assert mask.tolist() == [[False, True, True, False, True, False], [False, False, True, True, False, False]]


def test_sft_lr_decays_over_whichever_budget_binds():
    cfg = SFTConfig(steps=200, seconds=100.0, lr_floor=0.1)
    assert sft_lr_scale(cfg, 0, 0.0) == 1.0
    assert abs(sft_lr_scale(cfg, 100, 10.0) - 0.55) < 1e-9  # halfway by steps: the cosine's midpoint
    assert abs(sft_lr_scale(cfg, 10, 50.0) - 0.55) < 1e-9  # halfway by time, few steps done
    assert sft_lr_scale(cfg, 10, 100.0) == sft_lr_scale(cfg, 200, 1.0) == 0.1  # the end, either way
    scales = [sft_lr_scale(cfg, k, k * 0.4) for k in range(0, 251, 10)]
    assert all(a >= b for a, b in zip(scales, scales[1:]))
    assert sft_lr_scale(SFTConfig(steps=0, seconds=100.0, lr_floor=1.0), 5, 99.0) == 1.0  # constant
    assert abs(sft_lr_scale(SFTConfig(steps=0, seconds=100.0), 5, 50.0) - 0.55) < 1e-9  # no step budget


def test_reward_files():
    inst = demo_splits(0, 1, 0)["B_train"][0]
    files, why = reward_files(inst, inst.action)
    assert files is not None and set(files) == {module_path(inst)} and why == ""
    assert reward_files(inst, "garbage")[0] is None
    line = inst.action.split("|")[0].strip()
    first_word = inst.buggy.splitlines()[int(line) - 1].split()[0]
    files, why = reward_files(inst, f" {line}|{first_word}=>__import__('os');{first_word}")
    assert files is None and "forbidden" in why


def test_sft_step_and_rl_update_run():
    torch.manual_seed(0)
    model, template, args = build_policy()
    assert args.n_layers == 4 and args.hc_mult == 2 and args.qat and args.n_routed_experts == 8
    insts = demo_splits(8, 0, 0)["A_train"]
    ids, mask = sft_example(template, insts[0])
    assert sum(mask) == len(template.tokenizer.encode(insts[0].action)) + 1  # the action and <|end|>
    s = run_sft(model, template, lambda step: insts, SFTConfig(seconds=0.01, rows=2), log=lambda d: None)
    assert s["steps"] >= 1 and s["tokens"] > 0
    assert s["dspark_acceptance"] is not None  # the drafter trains alongside SFT
    rows = [ids, ids[:-2]]
    gens = [
        SimpleNamespace(token_ids=ids[-3:], logprobs=[-1.0] * 3),
        SimpleNamespace(token_ids=ids[-4:-2], logprobs=[-1.0] * 2),
    ]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = build_optimizer(model, OptimConfig(lr=1e-3, sinkhorn_lr=1e-3, muon_lr=1e-2))
    m = rl_update(model, opt, rows, gens, [1.0, -1.0], RLConfig(), pad=template.tokenizer.eos_id)
    assert m["mismatch_abs"] > 0 and 0.0 <= m["dspark_acceptance"] <= 1.0
    moved = {n.split(".")[0] for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert "mtp" in moved and "layers" in moved  # the policy and the drafter both stepped
