"""Engram against spec §3.12: released table sizes, primes and multipliers, the compressed token map's
normaliser, the hash by hand, blocking at starts/documents/images, determinism across processes,
the gate, and sparse table gradients."""

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer as Backend
from tokenizers import models

from model.config import engram_table_sizes, get_flavor
from model.engram import (
    Engram,
    EngramHasher,
    build_compressed_token_map,
    compute_hash_multipliers,
    engram_layout,
)
from model.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parents[2]
DEFAULT_COMPRESSED_VOCAB = 2742  # of the committed default tokenizer


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.default()


@pytest.fixture(scope="module")
def args():
    """Debug sizes on the default tokenizer (Engram before layers 0 and 3, orders 2..3, 2 heads)."""
    return get_flavor("debug", vocab_size=4096, engram_compressed_vocab_size=DEFAULT_COMPRESSED_VOCAB)


@pytest.fixture(scope="module")
def hasher(args, tok) -> EngramHasher:
    return EngramHasher(args, tok)


def test_flash_layout_reproduces_released_table_sizes():
    flash = get_flavor("flash")
    layout = engram_layout(flash)  # from the config alone: no table is allocated
    assert layout.num_embeddings == (384006168, 384016682)
    assert layout.primes[0][0][:3] == (16000057, 16000079, 16000081)
    flat = [p for layer in layout.primes for order in layer for p in order]
    assert len(flat) == 48 and flat == sorted(set(flat))  # successive, never reused
    assert layout.offsets[0][:2] == (0, 16000057) and layout.offsets[1][-1] == 384016682 - flat[-1]
    # agrees with the config module's independent (Miller-Rabin) prime search
    assert engram_table_sizes(16000000, 8, 4, 2) == layout.num_embeddings
    with pytest.raises(ValueError, match="engram_num_embeddings"):
        engram_layout(get_flavor("flash", engram_num_embeddings=(384006168, 384016681)))


def test_multipliers_match_the_spec():
    m = compute_hash_multipliers((1, 14), 4, 99092)
    assert m.tolist() == [
        [76632096046245, 4839876093313, 35959672319349, 73987337458391],
        [67716810739261, 51510806800915, 30921347202721, 82619226485591],
    ]
    assert (m % 2 == 1).all() and (m <= 2 * 46539438283891).all()
    assert int(m.max()) * 99091 < np.iinfo(np.int64).max  # products cannot overflow


def test_flash_engram_module_shapes_on_meta():
    with torch.device("meta"):
        e = Engram(get_flavor("flash"), 14)
    shapes = {k: tuple(v.shape) for k, v in e.state_dict().items()}
    assert shapes == {
        "embed.weight": (384016682, 256),
        "wkv.weight": (25600, 6144),
        "q_weight": (4, 5120),
        "k_weight": (4, 5120),
    }


def test_compressed_map_normaliser_rules():
    words = ["<pad>", "The", "the", "ﬁ", "fi", "É", "e", " ", "\n\t ", "  x  ", "x", "Ab\u0301"]
    backend = Backend(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    lookup, size = build_compressed_token_map(backend)
    ids = dict(zip(words, lookup.tolist()))
    assert ids["The"] == ids["the"]  # lowercase
    assert ids["ﬁ"] == ids["fi"]  # NFKC
    assert ids["É"] == ids["e"]  # NFD + strip accents
    assert ids[" "] == ids["\n\t "] != ids["<pad>"]  # one space survives the strip
    assert ids["  x  "] == ids["x"]  # collapse + strip
    assert ids["Ab\u0301"] != ids["x"]
    assert lookup.tolist() == [0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6] and size == 7  # first-seen order


def test_compressed_map_of_the_default_tokenizer(tok):
    lookup, size = build_compressed_token_map(tok)
    assert size == DEFAULT_COMPRESSED_VOCAB and len(lookup) == tok.vocab_size
    first_seen = np.unique(lookup, return_index=True)[1]
    assert (np.diff(first_seen) > 0).all()  # compressed ids numbered by first occurrence
    t = tok.token_to_id
    assert lookup[t("the")] == lookup[t("Ġthe")] == lookup[t("The")] == lookup[t("ĠThe")]
    assert lookup[t("Ċ")] == lookup[t("Ġ")] == lookup[t("ĉ")] == lookup[t("ĠĠ")]
    assert lookup[t("Ã")] != lookup[t("Â")]  # partial UTF-8 bytes keyed by their raw token
    assert len(set(lookup[:32].tolist())) == 32  # special tokens stay distinct


def _hand_hash(comp: list[int], pos: int, layer: int, hasher: EngramHasher) -> list[int]:
    """Spec §3.12 written out with Python ints for one position (no image, one document)."""
    n = hasher.layout.max_ngram_size
    toks, blocked = [], False
    for shift in range(n):
        blocked = blocked or pos < shift
        toks.append(hasher.pad_id if blocked else comp[pos - shift])
    mult = [int(m) for m in hasher.multipliers[layer]]
    out = []
    rolling = toks[0] * mult[0]
    for order in range(1, n):
        rolling ^= toks[order] * mult[order]
        for head, prime in enumerate(hasher.layout.primes[layer][order - 1]):
            out.append(
                rolling % prime + hasher.layout.offsets[layer][(order - 1) * hasher.layout.n_heads + head]
            )
    return out


def test_hash_matches_the_formula_by_hand(tok, hasher):
    ids = tok.encode("def add(a, b):\n    return a - b")
    got = hasher(torch.tensor([ids]))
    L, C = len(hasher.layout.layer_ids), hasher.layout.n_hash_cols
    assert got.shape == (1, len(ids), L, C) and got.dtype == torch.int64
    comp = hasher.token_map[ids].tolist()
    for layer in range(L):
        for pos in range(len(ids)):
            assert got[0, pos, layer].tolist() == _hand_hash(comp, pos, layer, hasher)
        assert (got[0, :, layer] < hasher.layout.num_embeddings[layer]).all()
    assert hasher.pad_id == hasher.token_map[2]


def test_image_span_blocks_ngrams_and_documents_restart(tok, hasher):
    a, b = tok.encode("x = 1"), tok.encode("y = foo(2)")
    img, _ = tok.image_span(1, 2)
    row = torch.tensor([a + img + b])
    image_mask = torch.zeros_like(row, dtype=torch.bool)
    image_mask[0, len(a) : len(a) + len(img)] = True
    h = hasher(row, image_mask)
    alone = hasher(torch.tensor([b]))
    assert torch.equal(h[0, len(a) + len(img) :], alone[0])  # b sees nothing across the span
    assert not torch.equal(hasher(row)[0, len(a) + len(img) :], alone[0])  # without the mask it would
    pad_grams = hasher(torch.tensor([[2] * 4]))[0, -1]  # every slot blocked -> all-pad n-grams
    assert (h[0, len(a) : len(a) + len(img)] == pad_grams).all()
    # a packed row hashes as its documents alone
    packed = hasher(torch.tensor([a + b]), doc_ids=torch.tensor([[0] * len(a) + [1] * len(b)]))
    assert torch.equal(packed[0], torch.cat([hasher(torch.tensor([a]))[0], alone[0]]))


def test_context_ids_continue_a_sequence(tok, hasher):
    ids = torch.tensor([tok.encode("for i in range(10):\n    print(i)")])
    full = hasher(ids)
    k = hasher.layout.max_ngram_size - 1
    for split in (1, 2, 5, ids.shape[1] - 1):
        ctx = ids[:, max(0, split - k) : split]
        assert torch.equal(hasher(ids[:, split:], context_ids=ctx), full[:, split:])
    with pytest.raises(ValueError):
        hasher(ids, context_ids=ids[:, : k + 1])
    with pytest.raises(ValueError):
        hasher(torch.tensor([[tok.vocab_size]]))


_CHILD = """
import hashlib, torch
from model.config import get_flavor
from model.engram import EngramHasher
from model.tokenizer import Tokenizer
tok = Tokenizer.default()
h = EngramHasher(get_flavor("debug", vocab_size=4096, engram_compressed_vocab_size={cv}), tok)
ids = torch.tensor([tok.encode("import os\\nprint(os.getcwd())  # hé")])
print(hashlib.sha256(h(ids).numpy().tobytes()).hexdigest())
"""


def test_hashing_is_identical_across_processes(tok, hasher):
    ids = torch.tensor([tok.encode("import os\nprint(os.getcwd())  # hé")])
    here = hashlib.sha256(hasher(ids).numpy().tobytes()).hexdigest()
    env = {**os.environ, "PYTHONHASHSEED": "7", "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-c", _CHILD.format(cv=DEFAULT_COMPRESSED_VOCAB)],
        cwd=REPO,
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    assert out.stdout.strip() == here


def test_hasher_checks_the_compressed_vocab_size(tok):
    with pytest.raises(ValueError, match="engram_compressed_vocab_size"):
        EngramHasher(get_flavor("debug", engram_compressed_vocab_size=512), tok)


def _engram(args, seed=0) -> Engram:
    torch.manual_seed(seed)
    e = Engram(args, args.engram_layer_ids[1])
    with torch.no_grad():
        e.q_weight.uniform_(0.5, 1.5)
        e.k_weight.uniform_(0.5, 1.5)
    return e


def test_gate_formula_and_zero_gate_on_images(args, tok, hasher):
    e = _engram(args)
    ids = torch.tensor([tok.encode("while True: pass")])
    B, S = ids.shape
    h = torch.randn(B, S, args.hc_mult, args.dim)
    hashes = hasher(ids)
    out = e(h, hashes)  # 4-D hashes: the module takes its own layer's slice
    assert torch.equal(out, e(h, hashes[:, :, 1]))
    # one (token, stream) by hand
    t, k = S - 1, 2
    with torch.no_grad():
        kv = e.wkv(e.embed(hashes[0, t, 1]).flatten())
    key, value = kv[k * args.dim : (k + 1) * args.dim], kv[args.hc_mult * args.dim :]
    x, w = h[0, t, k], e.q_weight[k] * e.k_weight[k]
    dot = (x * w * key).sum() / (x.pow(2).mean().sqrt() * key.pow(2).mean().sqrt()) / args.dim**0.5
    gate = torch.sigmoid(torch.sign(dot) * dot.abs().clamp_min(1e-6).sqrt())
    torch.testing.assert_close(out[0, t, k], x + gate * value, rtol=1e-5, atol=1e-5)
    assert 0 < gate < 1
    # image positions get nothing: the output there is the input, bit for bit
    mask = torch.ones(B, S, dtype=torch.bool)
    mask[0, 1:3] = False
    masked = e(h, hashes, mask)
    assert torch.equal(masked[0, 1:3], h[0, 1:3])
    assert torch.equal(masked[0, 3:], out[0, 3:]) and not torch.equal(out[0, 1:3], h[0, 1:3])


def test_table_gradient_is_sparse_and_touches_only_used_rows(args, tok, hasher):
    e = _engram(args)
    ids = torch.tensor([tok.encode("x = [i * 2 for i in range(3)]")])
    hashes = hasher(ids)[:, :, 1]
    h = torch.randn(1, ids.shape[1], args.hc_mult, args.dim)
    e(h, hashes).square().sum().backward()
    grad = e.embed.weight.grad
    assert grad.is_sparse
    grad = grad.coalesce()
    used = set(hashes.flatten().tolist())
    assert set(grad.indices()[0].tolist()) == used
    dense = grad.to_dense()
    untouched = torch.ones(dense.shape[0], dtype=torch.bool)
    untouched[list(used)] = False
    assert dense[untouched].abs().sum() == 0 and dense[~untouched].abs().sum() > 0
    assert e.wkv.weight.grad is not None and not e.wkv.weight.grad.is_sparse


def test_step_hashes_equal_the_hasher_over_each_rows_context(tok, hasher):
    """A decode step's hashes, made on the ids' device from a right-aligned ring of each row's
    previous tokens (model/ragged_cache.py), equal the hasher's over the row's real context: rows at
    their first positions (fewer tokens than the context, the ring's front not theirs), an image
    position (-1) in the context, and a row deep in its sequence."""
    C = hasher.layout.max_ngram_size - 1
    seqs = [tok.encode("x"), tok.encode("def f"), tok.encode("def add(a, b):\n    return a - b")]
    new = torch.tensor([tok.encode(" y")[0], 7, 300])
    ring = torch.zeros(len(seqs), C + 1, dtype=torch.long)  # one spare entry, as a batch's ring has
    for b, s in enumerate(seqs):
        tail = s[-C:]
        ring[b, ring.size(1) - len(tail) :] = torch.tensor(tail)
    ring[1, -1] = -1  # the newest context token of row 1 was an image position
    got = hasher.step_hashes(new, ring[:, -C:], torch.tensor([len(s) for s in seqs]))
    for b, s in enumerate(seqs):
        ctx = torch.tensor([s[-C:]])
        image = torch.zeros_like(ctx, dtype=torch.bool)
        if b == 1:
            image[0, -1] = True
        want = hasher(new[b : b + 1, None], context_ids=ctx, context_image_mask=image)
        assert torch.equal(got[b : b + 1], want), b
