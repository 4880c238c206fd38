"""Engram inside the Transformer: official names, the documented `engram_inputs` call (hashes once per
call, doc_ids for packed rows, context_ids for incremental calls), teacher-forced == incremental decode
and packed == alone with Engram live, the error without hashes, and the image-span gate."""

import pytest
import torch
from tokenizers import Tokenizer as Backend
from tokenizers import models

from model.config import get_flavor
from model.engram import EngramHasher
from model.transformer import ModelCache, Transformer, make_engram_inputs


@pytest.fixture(scope="module")
def args():
    return get_flavor("debug", qat=False)  # fp32, no QDQ: the two paths must agree to rounding


@pytest.fixture(scope="module")
def hasher(args):
    # a real word-level tokenizer whose 512 ids all decode apart (compressed vocab = vocab)
    vocab = {f"<t{i}>": i for i in range(args.vocab_size)}
    return EngramHasher(args, Backend(models.WordLevel(vocab, unk_token="<t0>")))


@pytest.fixture(scope="module")
def model(args):
    m = Transformer(args)
    m.init_weights(seed=0, std=0.1)
    return m


def _ids(b: int, s: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 512, (b, s), generator=torch.Generator().manual_seed(seed))


def test_engram_modules_sit_on_their_layers_with_official_names(model, args):
    names = {n for n, _ in model.named_parameters()}
    for i in range(args.n_layers):
        has = {f"layers.{i}.engram.{leaf}" for leaf in ("embed.weight", "wkv.weight", "q_weight", "k_weight")}
        assert has <= names if i in args.engram_layer_ids else not has & names, i
    assert args.engram_layer_ids == (0, 3)


def test_forward_without_hashes_names_what_to_pass(model):
    with pytest.raises(ValueError, match="make_engram_inputs.*engram_hasher"):
        model(_ids(1, 8))
    with pytest.raises(ValueError, match="engram_hasher"):
        model.forward_incremental(_ids(1, 8), 0, ModelCache())


def test_explicit_inputs_equal_the_attached_hasher_and_engram_matters(model, args, hasher):
    ids = _ids(2, 24)
    with torch.no_grad():
        explicit = model(ids, engram_inputs=make_engram_inputs(hasher, ids)).logits
        attached = Transformer(args, engram_hasher=hasher)
        attached.load_state_dict(model.state_dict())
        torch.testing.assert_close(attached(ids).logits, explicit, rtol=0, atol=0)
        # a different bigram history moves the logits: the hashes really reach the blocks
        other = make_engram_inputs(hasher, ids, context_ids=torch.full((2, 2), 7))
        assert (model(ids, engram_inputs=other).logits[:, :2] - explicit[:, :2]).abs().max() > 1e-4


@pytest.mark.numerics
def test_teacher_forced_equals_incremental_decode_with_engram(model, args, hasher):
    ids = _ids(2, 30, seed=2)
    n_ctx = args.engram_max_ngram_size - 1
    with torch.no_grad():
        ref = model(ids, engram_inputs=make_engram_inputs(hasher, ids)).logits
        cache, steps = ModelCache(), []
        for start, end in [(0, 9), *((t, t + 1) for t in range(9, 30))]:
            inputs = make_engram_inputs(hasher, ids[:, start:end], context_ids=ids[:, max(0, start - n_ctx) : start])
            steps.append(model.forward_incremental(ids[:, start:end], start, cache, engram_inputs=inputs))
    torch.testing.assert_close(torch.cat(steps, 1), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.numerics
def test_packed_rows_equal_documents_alone_with_engram(model, hasher):
    lens = (11, 17, 6)
    ids = _ids(1, sum(lens), seed=3)
    doc_ids = torch.cat([torch.full((n,), d) for d, n in enumerate(lens)])[None]
    with torch.no_grad():
        packed = model(ids, doc_ids, engram_inputs=make_engram_inputs(hasher, ids, doc_ids=doc_ids)).logits
        start = 0
        for n in lens:
            doc = ids[:, start : start + n]
            alone = model(doc, engram_inputs=make_engram_inputs(hasher, doc)).logits
            torch.testing.assert_close(packed[:, start : start + n], alone, rtol=1e-4, atol=1e-4)
            start += n


def test_image_positions_get_no_engram(model, hasher):
    ids = _ids(1, 12, seed=4)
    image_mask = torch.zeros(1, 12, dtype=torch.bool)
    image_mask[0, 4:8] = True
    seen = {}
    engram = model.layers[0].engram
    hook = engram.register_forward_hook(lambda m, i, o: seen.__setitem__("io", (i[0], o)))
    try:
        with torch.no_grad():
            model(ids, image_mask=image_mask, engram_inputs=make_engram_inputs(hasher, ids, image_mask=image_mask))
    finally:
        hook.remove()
    h_in, h_out = seen["io"]
    assert torch.equal(h_out[0, 4:8], h_in[0, 4:8])
    assert (h_out[0, :4] - h_in[0, :4]).abs().max() > 0
