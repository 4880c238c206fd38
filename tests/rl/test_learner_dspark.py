"""The DSpark term of the learner (debug model, CPU): it trains the drafter from detached backbone
features, so backbone gradients are identical with and without it, and trainer=dspark moves `mtp.*`
only; the drafter's acceptance is reported; taken chunk by chunk over positions, it equals the formula
over the full [B,S,k,V] draft logits (loss and gradients), and no vocabulary-sized tensor it builds,
forward or backward, is larger than its chunk budget."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer as Backend
from tokenizers import models
from torch.utils._python_dispatch import TorchDispatchMode

from model.config import get_flavor
from model.dspark import align_to_drafts, draft_target_ids
from model.engram import EngramHasher
from model.transformer import Transformer
from rl.config import OptimConfig, TrainerConfig
from rl.learner import Learner, dspark_term
from rl.payloads import Trajectory, pack_trajectories

torch.set_num_threads(1)

ARGS = get_flavor("debug")


def _model(seed: int = 0, args=ARGS) -> Transformer:
    vocab = {f"<t{i}>": i for i in range(args.vocab_size)}
    m = Transformer(args, engram_hasher=EngramHasher(args, Backend(models.WordLevel(vocab, unk_token="<t0>"))))
    m.init_weights(seed=seed)
    return m


def _batches():
    g = torch.Generator().manual_seed(0)
    trajs = [Trajectory(token_ids=torch.randint(32, ARGS.vocab_size, (16,), generator=g).tolist(),
                        loss_mask=[False] * 6 + [True] * 10, logprobs=[math.nan] * 6 + [-3.0] * 10,
                        versions=[-1] * 6 + [0] * 10, turn_starts=[6]) for _ in range(2)]  # fmt: skip
    return pack_trajectories(trajs, max_tokens=32)


def _cfg(kind: str, dspark_weight: float) -> TrainerConfig:
    return TrainerConfig(kind=kind, dspark_weight=dspark_weight, optim=OptimConfig(lr=1e-2, sinkhorn_lr=1e-2))


def test_dspark_loss_reaches_only_the_drafter():
    model = _model()
    b = _batches()[0]
    out = model(b.input_ids, b.doc_ids, compute_indexer_loss=False)
    term = dspark_term(model, out, b)
    assert term is not None and term.loss.requires_grad and 0 <= float(term.acceptance) <= 1
    term.loss.backward()
    reached = {n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert reached and all(n.startswith("mtp.") for n in reached), sorted(n for n in reached if "mtp" not in n)


def test_a_batch_without_generated_tokens_has_no_dspark_term():
    """A micro-batch with no loss-mask token (a rank's filler batch) has no row to align: no term, no
    drafter forward over zero anchors."""
    model = _model()
    b = _batches()[0]
    b.loss_mask = torch.zeros_like(b.loss_mask)
    out = model(b.input_ids, b.doc_ids, compute_indexer_loss=False)
    assert dspark_term(model, out, b) is None


def _full_formula(model: Transformer, out, b) -> dict[str, torch.Tensor]:
    """The DSpark term over the full [B,S,k,V] draft logits and policy probabilities at once."""
    k = model.mtp.block_size
    draft = model.draft_teacher_forced(out.main_hidden, b.input_ids, k, doc_ids=b.doc_ids)
    probs = align_to_drafts(out.logits.detach().float().softmax(-1), k)
    generated = align_to_drafts(F.pad(b.loss_mask[:, 1:], (0, 1), value=False), k, False)
    valid = (draft_target_ids(b.input_ids, k, b.doc_ids) >= 0) & generated & (b.doc_ids >= 0)[..., None]
    valid &= probs.sum(-1) > 0
    ce = -(probs * draft.logits.float().log_softmax(-1)).sum(-1)
    accepted = draft.draft_ids == probs.argmax(-1)
    bce = F.binary_cross_entropy_with_logits(draft.confidence, accepted.float(), reduction="none")
    n = valid.sum()
    return {"loss": (ce[valid].sum() + bce[valid].sum()) / n, "acceptance": (accepted & valid).sum() / n}


@pytest.mark.parametrize("chunk_logits", [1, 7 * 3 * ARGS.vocab_size, 1 << 30])  # 1 position, 7, all at once
def test_chunked_dspark_term_equals_the_full_formula(chunk_logits):
    """Tolerance: the same fp32 ops on the same rows; only the cross-entropy sum is split into per-chunk
    partial sums (a few ulp), which the gradients inherit through the 1/n scale."""
    model = _model()
    b = _batches()[0]  # 2 trajectories of 16 packed into one row of 32: two documents
    assert b.input_ids.shape == (1, 32) and int(b.doc_ids.max()) == 1
    out = model(b.input_ids, b.doc_ids, compute_indexer_loss=False)
    want = _full_formula(model, out, b)
    model.zero_grad(set_to_none=True)
    want["loss"].backward(retain_graph=True)
    want_grads = {n: p.grad.clone() for n, p in model.mtp.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    got = dspark_term(model, out, b, chunk_logits=chunk_logits)
    got.loss.backward()
    got_grads = {n: p.grad.clone() for n, p in model.mtp.named_parameters() if p.grad is not None}
    torch.testing.assert_close(got.loss, want["loss"], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got.acceptance, want["acceptance"], rtol=0, atol=0)
    assert got_grads.keys() == want_grads.keys() and len(got_grads) > 10
    for name, g in want_grads.items():
        torch.testing.assert_close(got_grads[name], g, rtol=1e-5, atol=1e-8, msg=name)


class _LargestVocabTensor(TorchDispatchMode):
    """Records the largest new tensor an op returns whose last dim is the vocabulary (views of an input,
    such as the policy's logits detached or the [V,D] head transposed, allocate nothing and are skipped)."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.largest = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in [*args, *(kwargs or {}).values()]
                  if isinstance(a, torch.Tensor)}  # fmt: skip
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() and t.size(-1) == self.vocab:
                if t.untyped_storage().data_ptr() not in inputs:
                    self.largest = max(self.largest, t.numel())
        return out


def test_dspark_term_stays_within_its_chunk_budget():
    # vocab 600, not debug's 512 = hc_mult x dim: the mHC mixes must not look vocabulary-sized to the spy
    args = get_flavor("debug", vocab_size=600, engram_compressed_vocab_size=600)
    model = _model(args=args)
    b = _batches()[0]
    out = model(b.input_ids, b.doc_ids, compute_indexer_loss=False)
    k, (B, S), V = model.mtp.block_size, b.input_ids.shape, args.vocab_size
    budget = 4 * B * k * V  # 4 anchor positions a chunk
    spy = _LargestVocabTensor(V)
    with spy:
        dspark_term(model, out, b, chunk_logits=budget).loss.backward()
    assert 0 < spy.largest <= budget < B * S * k * V // 4


def test_backbone_gradients_do_not_depend_on_the_dspark_weight():
    grads = []
    for weight in (0.0, 5.0):
        learner = Learner(_model(), _cfg("sft", weight))
        metrics, _ = learner.accumulate_grads(_batches(), "sft")
        assert (metrics["dspark_loss"] > 0) == (weight > 0)
        grads.append({n: p.grad.to_dense().clone() for n, p in learner.model.named_parameters()
                      if p.grad is not None and not n.startswith("mtp.")})  # fmt: skip
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name, g in grads[0].items():
        assert torch.equal(g, grads[1][name]), name


def test_backbone_update_under_clipping_does_not_depend_on_the_dspark_weight():
    """With clipping active, the drafter's gradient norm must not rescale the backbone's step: the
    backbone after one update is the same with the DSpark term at weight 0 and at 5."""
    after = []
    for weight in (0.0, 5.0):
        cfg = _cfg("sft", weight)
        cfg.grad_clip = 1e-3  # far below the gradient norms here: every step is clipped
        learner = Learner(_model(), cfg)
        learner.train_step(_batches(), "sft")
        after.append({n: p.detach().clone() for n, p in learner.model.named_parameters() if not n.startswith("mtp.")})
    for name, p in after[0].items():
        assert torch.equal(p, after[1][name]), name


def test_dspark_trainer_moves_the_drafter_only_and_its_loss_falls():
    learner = Learner(_model(), _cfg("dspark", 1.0))
    before = {n: p.detach().clone() for n, p in learner.model.named_parameters()}
    losses = [learner.train_step(_batches(), "dspark")["dspark_loss"] for _ in range(6)]
    assert losses[-1] < losses[0], losses
    for n, p in learner.model.named_parameters():
        moved = not torch.equal(p.detach(), before[n])
        if not n.startswith("mtp."):
            assert not moved, f"backbone parameter {n} moved under trainer=dspark"
    drafter = [n for n, _ in learner.model.named_parameters() if n.startswith("mtp.")]
    params = dict(learner.model.named_parameters())
    assert any(not torch.equal(params[n].detach(), before[n]) for n in drafter)
