"""The DSpark alignment loss over positions chunk by chunk (model.dspark.dspark_loss_chunked) and the
drafter alignment built on it (model.speculative.align_drafter): the same loss and drafter gradients
as `dspark_loss` over the full [B,S,k,V] logits, and no vocabulary-sized tensor larger than the
budget while aligning.

Tolerances: both sides run the same ops on the same fp32 tensors; only the sum of per-row
cross-entropies is split into per-chunk partial sums, a different fp32 summation order (a few ulp
of the loss, ~1e-7 relative), which the gradients inherit through the 1/n scale."""

import copy
import functools

import pytest
import torch
from tokenizers import Tokenizer as Backend
from tokenizers import models
from torch.utils._python_dispatch import TorchDispatchMode

import model.speculative as speculative
from model.config import get_flavor
from model.dspark import align_to_drafts, draft_rows, draft_target_ids, dspark_loss, dspark_loss_chunked
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


def _mtp_grads(model: Transformer) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.mtp.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", ["hard", "soft"])
@pytest.mark.parametrize("chunk", [1, 5, S])
@pytest.mark.parametrize("masked", [False, True])
def test_chunked_loss_equals_full_loss(kind, chunk, masked):
    model = _model()
    k = model.args.dspark_block_size
    ids = _ids(2, S)
    with torch.no_grad():
        out = model(ids)
    if kind == "hard":
        target = draft_target_ids(ids, k)
    else:
        target = align_to_drafts(torch.softmax(out.logits / 0.7, -1), k)
    mask = torch.rand(2, S, k, generator=torch.Generator().manual_seed(3)) < 0.6 if masked else None

    model.zero_grad(set_to_none=True)
    full = model.draft_teacher_forced(out.main_hidden, ids, k)
    want = dspark_loss(full, target, mask=mask)
    want.loss.backward()
    want_grads = _mtp_grads(model)

    model.zero_grad(set_to_none=True)
    lean = model.draft_teacher_forced(out.main_hidden, ids, k, with_logits=False)
    assert lean.logits is None and lean.draft_ids is None
    torch.testing.assert_close(lean.confidence, full.confidence, rtol=0, atol=0)
    torch.testing.assert_close(model.mtp.draft_logits(lean.hidden, lean.prev_ids, model.head.weight), full.logits)
    got = dspark_loss_chunked(
        model.mtp, lean, model.head.weight.detach(), lambda lo, hi: target[:, lo:hi], mask=mask, chunk=chunk
    )
    got.loss.backward()
    got_grads = _mtp_grads(model)
    model.zero_grad(set_to_none=True)

    for name in ("loss", "draft_ce", "confidence_bce", "acceptance"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=1e-6, atol=1e-7, msg=name)
    assert got_grads.keys() == want_grads.keys() and len(got_grads) > 10
    for name, g in want_grads.items():
        torch.testing.assert_close(got_grads[name], g, rtol=1e-5, atol=1e-8, msg=name)


def test_draft_rows_loss_equals_masked_full_loss():
    """`draft_rows` (the learner's DSpark term): logits of the masked rows only give dspark_loss's
    masked value and drafter gradients. Same tolerance as above: the per-row values are the same
    ops on the same rows; only the sum over rows is taken over n rows instead of B·S·k (zeros)."""
    model = _model()
    k = model.args.dspark_block_size
    ids = _ids(2, S)
    with torch.no_grad():
        out = model(ids)
    target = align_to_drafts(torch.softmax(out.logits / 0.7, -1), k)
    mask = (torch.rand(2, S, k, generator=torch.Generator().manual_seed(4)) < 0.3) & (target.sum(-1) > 0)

    model.zero_grad(set_to_none=True)
    want = dspark_loss(model.draft_teacher_forced(out.main_hidden, ids, k), target, mask=mask)
    want.loss.backward()
    want_grads = _mtp_grads(model)

    model.zero_grad(set_to_none=True)
    lean = model.draft_teacher_forced(out.main_hidden, ids, k, with_logits=False)
    rows = draft_rows(model.mtp, lean, model.head.weight.detach(), mask)
    assert rows.logits.shape == (int(mask.sum()), model.args.vocab_size)
    got = dspark_loss(rows, target[mask])
    got.loss.backward()
    got_grads = _mtp_grads(model)
    model.zero_grad(set_to_none=True)

    for name in ("loss", "draft_ce", "confidence_bce", "acceptance"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=1e-6, atol=1e-7, msg=name)
    assert got_grads.keys() == want_grads.keys() and len(got_grads) > 10
    for name, g in want_grads.items():
        torch.testing.assert_close(got_grads[name], g, rtol=1e-5, atol=1e-8, msg=name)


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
