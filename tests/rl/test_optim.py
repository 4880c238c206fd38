"""Parameter families by name rule; Muon per-head, Sinkhorn sparse rows and AdamW steps of the facade."""

from __future__ import annotations

import copy

import pytest
import torch
from tokenizers import Tokenizer as Backend
from tokenizers import models
from torch import nn

from model.config import get_flavor
from model.engram import EngramHasher
from model.transformer import INTENTIONALLY_FROZEN, Transformer
from rl.config import OptimConfig
from rl.optim import FAMILIES, FamilyOptimizer, build_optimizer, build_param_groups, lr_factor, sinkhorn_balance

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model() -> Transformer:
    args = get_flavor("debug")
    vocab = {f"<t{i}>": i for i in range(args.vocab_size)}
    m = Transformer(args, engram_hasher=EngramHasher(args, Backend(models.WordLevel(vocab, unk_token="<t0>"))))
    m.init_weights(seed=0)
    return m


def test_every_trainable_parameter_lands_in_exactly_one_family(model):
    groups = build_param_groups(model)
    assert set(groups) == set(FAMILIES)
    placed = [n for named in groups.values() for n, _ in named]
    assert len(placed) == len(set(placed))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    frozen = {n for n, p in model.named_parameters() if n.endswith(INTENTIONALLY_FROZEN)}
    assert frozen and set(placed) == trainable and not frozen & set(placed)
    fam = {n: f for f, named in groups.items() for n, _ in named}
    assert fam["embed.weight"] == fam["head.weight"] == fam["layers.0.engram.embed.weight"] == "sinkhorn"
    for name in ("layers.0.attn.wq_b.weight", "layers.1.attn.indexer.wq_b.weight", "layers.0.ffn.experts.0.w1.weight",
                 "layers.0.engram.wkv.weight", "layers.1.attn.compressor.wkv.weight"):  # fmt: skip
        assert fam[name] == "muon", name
    for name in ("layers.0.hc_attn_fn", "layers.0.attn.attn_sink", "norm.weight", "layers.0.attn.q_norm.weight",
                 "layers.0.engram.q_weight", "layers.0.hc_ffn_scale"):  # fmt: skip
        assert fam[name] == "adamw", name


def test_q_projections_are_orthogonalised_per_head(model):
    opt = build_optimizer(model, OptimConfig())
    heads = {n: h for g in opt.param_groups for n, h in zip(g["names"], g["num_heads"])}
    args = model.args
    assert heads["layers.0.attn.wq_b.weight"] == args.n_heads
    assert heads["layers.1.attn.indexer.wq_b.weight"] == args.index_n_heads
    assert heads["layers.0.attn.wkv.weight"] is None  # one shared KV head: whole-matrix Muon
    # head independence: a gradient confined to head 0 moves only head 0's rows
    lin = nn.Linear(16, 4 * 8, bias=False)
    opt = FamilyOptimizer({"muon": [("attn.wq_b.weight", lin.weight)]}, OptimConfig(muon_lr=0.1), args=args)
    opt.param_groups[0]["num_heads"] = [4]
    before = lin.weight.detach().clone()
    lin.weight.grad = torch.zeros_like(lin.weight)
    lin.weight.grad[:8] = torch.randn(8, 16)
    opt.step()
    moved = (lin.weight.detach() - before).abs().sum(dim=1).view(4, 8).sum(dim=1)
    assert moved[0] > 0 and moved[1:].eq(0).all()


def test_sinkhorn_updates_only_touched_rows_sparse_equals_dense():
    torch.manual_seed(0)
    sparse = nn.Embedding(50, 6, sparse=True)
    dense = nn.Embedding(50, 6)
    dense.weight.data.copy_(sparse.weight.data)
    cfg = OptimConfig(sinkhorn_lr=0.05)
    opts = [FamilyOptimizer({"sinkhorn": [("x.embed.weight", e.weight)]}, cfg) for e in (sparse, dense)]
    ids = torch.tensor([[3, 7, 7, 11]])
    target = torch.randn(1, 4, 6)
    start = sparse.weight.detach().clone()
    for _ in range(3):
        for emb, opt in zip((sparse, dense), opts):
            opt.zero_grad()
            ((emb(ids) - target) ** 2).sum().backward()
            opt.step()
    assert sparse.weight.grad.is_sparse
    torch.testing.assert_close(sparse.weight.detach(), dense.weight.detach())
    changed = (sparse.weight.detach() != start).any(dim=1).nonzero().flatten().tolist()
    assert changed == [3, 7, 11]


def test_sinkhorn_balance_gives_unit_rms_rows_and_columns():
    u = sinkhorn_balance(torch.randn(7, 5) * torch.rand(7, 1) * 10, iters=20)
    torch.testing.assert_close(u.square().mean(0).sqrt(), torch.ones(5), atol=1e-3, rtol=0)
    torch.testing.assert_close(u.square().mean(1).sqrt(), torch.ones(7), atol=1e-3, rtol=0)


def test_optimizer_state_round_trip_reproduces_steps():
    torch.manual_seed(0)
    nets = [nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)) for _ in range(2)]
    nets[1].load_state_dict(nets[0].state_dict())

    def groups(net):
        return {"muon": [("0.weight", net[0].weight)], "adamw": [("0.bias", net[0].bias), ("1.weight", net[1].weight),
                                                                 ("1.bias", net[1].bias)]}  # fmt: skip

    opts = [FamilyOptimizer(groups(n), OptimConfig()) for n in nets]
    x = torch.randn(4, 8)
    for step in range(4):
        if step == 2:
            opts[1] = FamilyOptimizer(groups(nets[1]), OptimConfig())
            opts[1].load_state_dict(copy.deepcopy(opts[0].state_dict()))  # as if read from disk
        for net, opt in zip(nets, opts):
            opt.zero_grad()
            net(x).square().sum().backward()
            opt.step()
        torch.testing.assert_close(nets[0][0].weight, nets[1][0].weight, atol=0, rtol=0)


def test_cosine_schedule_warms_up_linearly_then_decays_to_its_floor():
    cfg = OptimConfig(schedule="cosine", warmup_steps=4, min_lr_ratio=0.1, decay_steps=14)
    assert [lr_factor(cfg, t) for t in (1, 2, 4)] == [0.25, 0.5, 1.0]
    assert lr_factor(cfg, 9) == pytest.approx(0.55)  # half-way through the decay: (1 + 0.1) / 2
    assert lr_factor(cfg, 14) == pytest.approx(0.1) and lr_factor(cfg, 50) == pytest.approx(0.1)
    assert lr_factor(OptimConfig(), 7) == 1.0


def test_the_schedule_scales_every_family_and_resumes_with_the_optimiser_state():
    net = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    named = {"muon": [("0.weight", net[0].weight)], "adamw": [("1.weight", net[1].weight)]}
    cfg = OptimConfig(lr=1e-3, muon_lr=1e-2, schedule="cosine", warmup_steps=2, decay_steps=6)
    opt = FamilyOptimizer(named, cfg)
    for _ in range(3):
        opt.zero_grad()
        net(torch.randn(2, 4)).square().sum().backward()
        opt.step()
    lrs = {g["family"]: g["lr"] for g in opt.param_groups}
    assert lrs == pytest.approx({"muon": 1e-2 * lr_factor(cfg, 3), "adamw": 1e-3 * lr_factor(cfg, 3)})
    again = FamilyOptimizer(named, cfg)
    again.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert [g["schedule_step"] for g in again.param_groups] == [3, 3]
