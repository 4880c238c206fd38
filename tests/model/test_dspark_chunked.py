"""The DSpark alignment loss over positions chunk by chunk (model.dspark.dspark_loss_chunked) and the
drafter alignment built on it (model.speculative.align_drafter): the same loss and drafter gradients
as the formula written out over the full [B,S,k,V] logits (`_full_loss` below), given `accepted` and
`mask` honoured, the target a stop-gradient, and no vocabulary-sized tensor larger than the budget
while aligning.

Tolerances: both sides run the same ops on the same fp32 tensors; only the sum of per-row
cross-entropies is split into per-chunk partial sums, a different fp32 summation order (a few ulp
of the loss, ~1e-7 relative), which the gradients inherit through the 1/n scale."""

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer as Backend
from tokenizers import models
from torch.utils._python_dispatch import TorchDispatchMode

import model.speculative as speculative
from model.config import get_flavor
from model.dspark import align_to_drafts, draft_target_ids, dspark_loss_chunked
from model.engram import EngramHasher
from model.transformer import Transformer

S = 26  # > window (16): the drafter's context window slides


@functools.cache
def _model() -> Transformer:
    # vocab 600, not 512 = hc_mult x dim: the mHC mixes must not look vocabulary-sized to the spy below
    args = get_flavor(
        "debug", n_mtp_layers=2, dspark_block_size=3, qat=False, vocab_size=600, engram_compressed_vocab_size=600
    )
    vocab = {f"<t{i}>": i for i in range(args.vocab_size)}
    m = Transformer(args, engram_hasher=EngramHasher(args, Backend(models.WordLevel(vocab, unk_token="<t0>"))))
    m.init_weights(seed=0, std=0.1)
    return m


def _ids(b: int, s: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 512, (b, s), generator=torch.Generator().manual_seed(seed))


def _full_loss(logits, confidence, target, accepted=None, mask=None) -> dict[str, torch.Tensor]:
    """DESIGN §3.1's alignment loss over the full draft logits [B,S,k,V] at once: soft target
    [B,S,k,V] probabilities or hard ids [B,S,k] (-1 = none); means over the valid rows."""
    logp = torch.log_softmax(logits.float(), -1)
    if target.dim() == logp.dim():
        ce, has, ids = -(target * logp).sum(-1), target.sum(-1) > 0, target.argmax(-1)
    else:
        ce, has, ids = -logp.gather(-1, target.clamp_min(0)[..., None]).squeeze(-1), target >= 0, target.clamp_min(0)
    valid = has if mask is None else has & mask
    accepted = logits.argmax(-1) == ids if accepted is None else accepted
    bce = F.binary_cross_entropy_with_logits(confidence, accepted.float(), reduction="none")
    n = valid.sum()
    ce, bce = ce[valid].sum() / n, bce[valid].sum() / n
    return {"loss": ce + bce, "draft_ce": ce, "confidence_bce": bce, "acceptance": (accepted & valid).sum() / n}


def _mtp_grads(model: Transformer) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.mtp.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", ["hard", "soft"])
@pytest.mark.parametrize("chunk", [1, 5, S])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("given", [False, True])
def test_chunked_loss_equals_full_loss(kind, chunk, masked, given):
    model = _model()
    k = model.args.dspark_block_size
    ids = _ids(2, S)
    with torch.no_grad():
        out = model(ids)
    if kind == "hard":
        target = draft_target_ids(ids, k)
    else:
        target = align_to_drafts(torch.softmax(out.logits / 0.7, -1), k)
    g = torch.Generator().manual_seed(3)
    mask = torch.rand(2, S, k, generator=g) < 0.6 if masked else None
    accepted = torch.rand(2, S, k, generator=g) < 0.5 if given else None

    model.zero_grad(set_to_none=True)
    full = model.draft_teacher_forced(out.main_hidden, ids, k)
    want = _full_loss(full.logits, full.confidence, target, accepted, mask)
    want["loss"].backward()
    want_grads = _mtp_grads(model)

    model.zero_grad(set_to_none=True)
    lean = model.draft_teacher_forced(out.main_hidden, ids, k, with_logits=False)
    assert lean.logits is None and lean.draft_ids is None
    torch.testing.assert_close(lean.confidence, full.confidence, rtol=0, atol=0)
    torch.testing.assert_close(model.mtp.draft_logits(lean.hidden, lean.prev_ids, model.head.weight), full.logits)
    got = dspark_loss_chunked(
        model.mtp, lean, model.head.weight.detach(), lambda lo, hi: target[:, lo:hi], accepted, mask, chunk=chunk
    )
    got.loss.backward()
    got_grads = _mtp_grads(model)
    model.zero_grad(set_to_none=True)

    for name in ("loss", "draft_ce", "confidence_bce", "acceptance"):
        torch.testing.assert_close(getattr(got, name), want[name], rtol=1e-6, atol=1e-7, msg=name)
    assert got_grads.keys() == want_grads.keys() and len(got_grads) > 10
    for name, g in want_grads.items():
        torch.testing.assert_close(got_grads[name], g, rtol=1e-5, atol=1e-8, msg=name)


def test_the_policy_target_is_a_stop_gradient():
    model = _model()
    ids = _ids(1, 8)
    with torch.no_grad():
        out = model(ids)
    probs = align_to_drafts(torch.softmax(out.logits, -1), 3).requires_grad_()
    lean = model.draft_teacher_forced(out.main_hidden, ids, 3, with_logits=False)
    model.zero_grad(set_to_none=True)
    dspark_loss_chunked(
        model.mtp, lean, model.head.weight.detach(), lambda lo, hi: probs[:, lo:hi], chunk=3
    ).loss.backward()
    assert probs.grad is None and any(p.grad is not None for p in model.mtp.parameters())
    model.zero_grad(set_to_none=True)


def test_chunked_loss_needs_a_logit_free_draft():
    model = _model()
    ids = _ids(1, 8)
    with torch.no_grad():
        out = model(ids)
    draft = model.draft_teacher_forced(out.main_hidden, ids)
    with pytest.raises(ValueError, match="with_logits=False"):
        dspark_loss_chunked(model.mtp, draft, model.head.weight, lambda lo, hi: draft_target_ids(ids, 3)[:, lo:hi])
    with pytest.raises(ValueError, match="markov='teacher'"):
        model.draft_teacher_forced(out.main_hidden, ids, markov="greedy", with_logits=False)


class _LargestVocabTensor(TorchDispatchMode):
    """Records the largest tensor an op returns whose last dim is the vocabulary."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.largest = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() and t.size(-1) == self.vocab:
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_align_drafter_stays_within_its_logits_budget(monkeypatch, temperature):
    """With the budget at half of the unchunked loss's 4 x S x k x V draft logits (and above the
    [V,D] head weight, which counts too), aligning 6 rows x S positions in batches of 4 never holds
    more vocabulary-sized values in one tensor than the budget, and it still trains the drafter."""
    model = copy.deepcopy(_model())
    V, k = model.args.vocab_size, model.args.dspark_block_size
    budget = 6 * S * V
    monkeypatch.setattr(speculative, "_ALIGN_LOGITS", budget)
    seqs = _ids(6, S, seed=5)
    before = {n: p.clone() for n, p in model.mtp.named_parameters()}
    spy = _LargestVocabTensor(V)
    with spy:
        res = speculative.align_drafter(model, seqs, 2, temperature=temperature, batch=4)
    assert model.args.dim * V <= budget < 4 * S * k * V
    assert 0 < spy.largest <= budget
    assert res["steps"] == 2 and res["loss_last"] > 0
    assert any(not torch.equal(p, before[n]) for n, p in model.mtp.named_parameters())


def test_drafts_of_chosen_anchors_give_the_masked_loss():
    """draft_teacher_forced(anchors=) (the learner's DSpark term): drafting only the anchors with a
    masked row gives the masked loss over all anchors. Each block then attends its window as a batch
    row of its own: the same softmax terms summed in another order, and a weight's gradient sums its
    rows in another GEMM blocking (the other anchors contributing exact zeros): a few ulp of the
    largest terms, hence atol relative to the gradient's scale."""
    model = _model()
    k = model.args.dspark_block_size
    ids = _ids(2, S)
    with torch.no_grad():
        out = model(ids)
    probs = align_to_drafts(torch.softmax(out.logits / 0.7, -1), k)
    mask = (torch.rand(2, S, k, generator=torch.Generator().manual_seed(4)) < 0.3) & (probs.sum(-1) > 0)
    head = model.head.weight.detach()

    model.zero_grad(set_to_none=True)
    full = model.draft_teacher_forced(out.main_hidden, ids, k, with_logits=False)
    want = dspark_loss_chunked(model.mtp, full, head, lambda lo, hi: probs[:, lo:hi], mask=mask, chunk=7)
    want.loss.backward()
    want_grads = _mtp_grads(model)

    model.zero_grad(set_to_none=True)
    anchors = mask.any(-1)
    lean = model.draft_teacher_forced(out.main_hidden, ids, k, with_logits=False, anchors=anchors)
    assert lean.hidden.shape[:3] == (1, int(anchors.sum()), k)
    chosen = probs[anchors][None]
    got = dspark_loss_chunked(model.mtp, lean, head, lambda lo, hi: chosen[:, lo:hi], mask=mask[anchors][None], chunk=5)
    got.loss.backward()
    got_grads = _mtp_grads(model)
    model.zero_grad(set_to_none=True)

    for name in ("loss", "draft_ce", "confidence_bce", "acceptance"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=1e-6, atol=1e-7, msg=name)
    assert got_grads.keys() == want_grads.keys() and len(got_grads) > 10
    for name, g in want_grads.items():
        torch.testing.assert_close(got_grads[name], g, rtol=1e-5, atol=1e-5 * float(g.abs().max()), msg=name)
