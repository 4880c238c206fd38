"""DeepSeek-ViT, aligner and span merge (spec §3.15): official names/shapes, 2D RoPE and pixel
unshuffle against hand computations, bidirectional attention, the merge's placement and errors,
and forward + backward of image-plus-text through the ViT, the aligner and the debug Transformer."""

import math

import numpy as np
import pytest
import torch

from model.accounting import classify, official_shapes
from model.config import get_flavor
from model.image_processor import ImageProcessor, expand_image_placeholders
from model.moe import MoE
from model.tokenizer import IMAGE, IMAGE_END, IMAGE_NEW_LINE, IMAGE_START, TEXT
from model.transformer import Transformer
from model.vision import (
    DELIMITER_NAMES,
    Aligner,
    ViT,
    apply_rope_2d,
    embed_images,
    encode_image,
    pixel_unshuffle,
    vision_rope_angles,
)

VISION = dict(vision_n_layers=2, vision_dim=64, vision_n_heads=4, vision_inter_dim=96)


def _args():
    return get_flavor("debug", **VISION)


def _tower(seed: int = 0):
    args = _args()
    torch.manual_seed(seed)
    vision, aligner = ViT(args), Aligner(args)
    # non-default biases and norm weights, so a wrong bias or norm placement shows
    for name, p in [*vision.named_parameters(), *aligner.named_parameters()]:
        torch.nn.init.normal_(p, mean=1.0 if "norm" in name else 0.0, std=0.05)
    delimiters = {name: torch.nn.Parameter(torch.randn(args.dim)) for name in DELIMITER_NAMES.values()}
    return args, vision, aligner, delimiters


def _image(h: int, w: int, seed: int):
    pixels = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    return ImageProcessor(min_pixels=1, max_n_token=64, resampler="torch")(pixels)


# ------------------------------------------------------------------ names and shapes
def test_names_and_shapes_equal_official_for_flash_on_meta():
    args = get_flavor("flash")
    with torch.device("meta"):
        holder = torch.nn.Module()
        holder.vision, holder.aligner = ViT(args), Aligner(args)
        for name in DELIMITER_NAMES.values():
            setattr(holder, name, torch.nn.Parameter(torch.empty(args.dim)))
    ours = {n: tuple(p.shape) for n, p in holder.named_parameters()}
    official = {n: s for n, s in official_shapes(args).items() if classify(n) == "vision"}
    assert ours == official
    assert ours["vision.blocks.31.mlp.w1.weight"] == (5632, 1024) and ours["aligner.w1.weight"] == (5120, 9216)
    params = dict(holder.named_parameters())
    assert params["vision.blocks.0.norm1.weight"].dtype == torch.float32  # the ViT's fp32 norm weights
    assert params["vision.norm.weight"].dtype == torch.float32
    assert "vision.blocks.0.mlp.w1.bias" not in params and "vision.blocks.0.attn.wqkv.bias" in params


# ------------------------------------------------------------------ 2D RoPE
def test_rope_angles_and_rotation_match_hand_computation():
    n_h, n_w, rope_dim, theta = 3, 5, 8, 100.0
    angles = vision_rope_angles(n_h, n_w, rope_dim, theta)
    assert angles.shape == (15, 8)
    x = torch.randn(15, 2, 2 * rope_dim, generator=torch.Generator().manual_seed(0))
    y = apply_rope_2d(x, angles)
    for r, c in [(0, 0), (0, 4), (2, 1), (1, 3)]:
        n = r * n_w + c
        inv = [theta ** (-2 * i / rope_dim) for i in range(rope_dim // 2)]
        expected_angles = [r * f for f in inv] + [c * f for f in inv]
        assert angles[n].tolist() == pytest.approx(expected_angles, rel=1e-6)
        for head in range(2):
            v = x[n, head].tolist()
            for j in range(rope_dim):  # pair j of the first half with pair j of the second half
                a = expected_angles[j]
                x1, x2 = v[j], v[j + rope_dim]
                assert y[n, head, j].item() == pytest.approx(x1 * math.cos(a) - x2 * math.sin(a), abs=1e-5)
                assert y[n, head, j + rope_dim].item() == pytest.approx(x2 * math.cos(a) + x1 * math.sin(a), abs=1e-5)
    assert torch.equal(y[0], x[0])  # patch (0, 0) is not rotated
    # q·k depends only on the 2D offset: (0,1)·(1,3) == (1,2)·(2,4) for the same q, k vectors
    angles = vision_rope_angles(3, 5, rope_dim, theta)
    q, k = x[0, 0], x[1, 0]
    rot = lambda v, n: apply_rope_2d(v.view(1, 1, -1), angles[n : n + 1])[0, 0]  # noqa: E731
    assert rot(q, 1) @ rot(k, 8) == pytest.approx((rot(q, 7) @ rot(k, 14)).item(), rel=1e-5)
    assert rot(q, 1) @ rot(k, 8) != pytest.approx((rot(q, 1) @ rot(k, 12)).item(), rel=1e-3)


def test_attention_is_bidirectional_and_depends_on_2d_position():
    _, vision, _, _ = _tower()
    patches = torch.randn(12, 588, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        base = vision(patches, 3, 4)
        changed = patches.clone()
        changed[-1] += 1.0
        assert not torch.allclose(vision(changed, 3, 4)[0], base[0])  # the first patch sees the last
        # same patches read as a 4x3 grid: the 2D positions change, and so do the features
        assert not torch.allclose(vision(patches, 4, 3), base, atol=1e-3)
    with pytest.raises(ValueError, match="patches for a"):
        vision(patches, 3, 5)


def test_bf16_tower_tracks_fp32():
    args, vision, aligner, delimiters = _tower()
    image = _image(56, 70, seed=1)
    with torch.no_grad():
        ref = encode_image(image, vision, aligner)
        got = encode_image(image, vision.to(torch.bfloat16), aligner.to(torch.bfloat16))
    assert got.dtype == torch.bfloat16
    assert torch.allclose(got.float(), ref, atol=0.1, rtol=0.05)


# ------------------------------------------------------------------ aligner
def test_pixel_unshuffle_order_is_row_major_blocks_channel_major_features():
    n_h, n_w, C, r = 4, 5, 2, 3
    x = torch.tensor([[1000.0 * c + n for c in range(C)] for n in range(n_h * n_w)])  # x[n, c]
    out = pixel_unshuffle(x, n_h, n_w, r)
    assert out.shape == (2 * 2, C * 9)
    for bi in range(2):
        for bj in range(2):
            for c in range(C):
                for ki in range(r):
                    for kj in range(r):
                        row, col = 3 * bi + ki, 3 * bj + kj
                        want = 1000.0 * c + row * n_w + col if row < n_h and col < n_w else 0.0
                        assert out[bi * 2 + bj, c * 9 + 3 * ki + kj].item() == want
    # spot checks written out: block (0,1) channel 1 position (1,2) is patch (1,5) -> padding;
    # block (1,0) channel 0 position (0,0) is patch (3,0) = n 15; block (1,1) channel 1 (0,1) is (3,4)
    assert out[1, 9 + 3 + 2].item() == 0.0 and out[2, 0].item() == 15.0 and out[3, 9 + 1].item() == 1000.0 + 3 * 5 + 4


def test_aligner_rows_follow_unshuffle_then_mlp():
    args, vision, aligner, _ = _tower()
    x = torch.randn(4 * 5, args.vision_dim, generator=torch.Generator().manual_seed(2))
    y = aligner(x, 4, 5)
    u = pixel_unshuffle(x, 4, 5, 3)
    want = torch.nn.functional.linear(
        torch.nn.functional.gelu(torch.nn.functional.linear(u, aligner.w1.weight, aligner.w1.bias), approximate="none"),
        aligner.w2.weight,
        aligner.w2.bias,
    )
    assert y.shape == (4, args.dim) and torch.allclose(y, want)


# ------------------------------------------------------------------ merge
def _sequence(images, n_text_before=3, n_text_after=2):
    """ids/types of: text, image 0, text, image 1, ..., text."""
    ids = list(range(5, 5 + n_text_before))
    for _ in images:
        ids += [17, 6]  # 17 = placeholder, then one text token
    ids += [7] * n_text_after
    return expand_image_placeholders(ids, images, image_token_id=17)


def test_embed_images_places_delimiters_and_rows_in_reading_order():
    args, vision, aligner, delimiters = _tower()
    images = [_image(56, 70, seed=1), _image(100, 40, seed=2)]
    ids, types = _sequence(images)
    types_BS = torch.tensor([types])
    h = torch.randn(1, len(ids), args.dim, generator=torch.Generator().manual_seed(4))
    out = embed_images(h, images, types_BS, vision, aligner, delimiters)
    text = types_BS[0] == TEXT
    assert torch.equal(out[0, text], h[0, text])
    starts = [i for i, t in enumerate(types) if t == IMAGE_START]
    for start, image in zip(starts, images):
        rows = encode_image(image, vision, aligner)
        assert rows.shape == (image.n_llm_h * image.n_llm_w, args.dim)
        pos = start
        assert torch.equal(out[0, pos], delimiters["image_start"].detach())
        for i in range(image.n_llm_h):
            for j in range(image.n_llm_w):
                pos += 1
                assert torch.allclose(out[0, pos], rows[i * image.n_llm_w + j])
            pos += 1
            assert torch.equal(out[0, pos], delimiters["image_newline"].detach())
        assert torch.equal(out[0, pos + 1], delimiters["image_end"].detach())
        assert pos + 1 - start + 1 == image.n_tokens


def test_embed_images_rejects_bad_spans_and_later_chunks():
    args, vision, aligner, delimiters = _tower()
    images = [_image(56, 70, seed=1)]
    ids, types = _sequence(images)
    h = torch.zeros(1, len(ids), args.dim)
    types_BS = torch.tensor([types])
    with pytest.raises(ValueError, match="start_pos 0"):
        embed_images(h, images, types_BS, vision, aligner, delimiters, start_pos=8)
    with pytest.raises(ValueError, match="1 image spans but 2 images"):
        embed_images(h, images * 2, types_BS, vision, aligner, delimiters)
    cut = types.index(IMAGE_END)
    with pytest.raises(ValueError, match="wholly inside this chunk"):
        embed_images(h[:, :cut], images, types_BS[:, :cut], vision, aligner, delimiters)
    stray = types_BS.clone()
    stray[0, -1] = IMAGE
    with pytest.raises(ValueError, match="outside any complete image span"):
        embed_images(h, images, stray, vision, aligner, delimiters)
    no_images = torch.full_like(types_BS, TEXT)
    assert embed_images(h, [], no_images, vision, aligner, delimiters, start_pos=8) is h


def test_image_span_routes_with_bias_vl_including_delimiters():
    args = _args()
    torch.manual_seed(0)
    moe = MoE(args)
    with torch.no_grad():
        moe.gate.bias_vl.copy_(torch.tensor([100.0, 100.0, -100.0, -100.0]))
        moe.gate.bias.copy_(torch.tensor([-100.0, -100.0, 100.0, 100.0]))
    _, types = _sequence([_image(56, 70, seed=1)])
    types_BS = torch.tensor([types])
    x = torch.randn(1, len(types), args.dim)
    _, stats = moe(x, types_BS >= 0)
    picked = stats.topk_idx[0]
    for t, experts in zip(types, picked.tolist()):
        assert experts == ([0, 1] if t in (IMAGE_START, IMAGE, IMAGE_NEW_LINE, IMAGE_END) else [2, 3])


def test_image_plus_text_forward_backward_through_debug_transformer():
    # Engram off: its hasher needs a tokenizer of the debug vocabulary, and images only mask it
    args = get_flavor("debug", engram_layer_ids=(), engram_num_embeddings=(), **VISION)
    model = Transformer(args)
    model.init_weights(seed=0, std=0.1)
    images = [_image(56, 70, seed=1), _image(84, 42, seed=2)]
    ids, types = _sequence(images, n_text_before=4, n_text_after=6)
    ids_BS, types_BS = torch.tensor([ids]), torch.tensor([types])
    out = model(ids_BS, images=images, token_types=types_BS)
    assert out.logits.shape == (1, len(ids), args.vocab_size) and torch.isfinite(out.logits).all()
    loss = out.logits[0, :-1].log_softmax(-1).gather(-1, ids_BS[0, 1:, None]).mean().neg()
    loss.backward()
    tower = [*model.vision.named_parameters(), *model.aligner.named_parameters()]
    tower += [(n, getattr(model, n)) for n in DELIMITER_NAMES.values()]
    for name, p in tower:
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert model.embed.weight.grad[ids_BS[0, types_BS[0] == TEXT]].abs().sum() > 0
    # positions inside spans never read the vocabulary embedding
    assert model.embed.weight.grad[17].abs().sum() == 0


def test_image_prompt_prefill_then_decode_equals_teacher_forced():
    from model.transformer import ModelCache

    args = get_flavor("debug", engram_layer_ids=(), engram_num_embeddings=(), qat=False, **VISION)
    model = Transformer(args)
    model.init_weights(seed=0, std=0.1)
    images = [_image(56, 70, seed=3)]
    ids, types = _sequence(images, n_text_before=2, n_text_after=4)
    ids_BS, types_BS = torch.tensor([ids]), torch.tensor([types])
    with torch.no_grad():
        full = model(ids_BS, images=images, token_types=types_BS).logits
        n_prompt = len(ids) - 3  # the image lies in the first chunk, as the reference requires
        cache = ModelCache()
        steps = [model.forward_incremental(ids_BS[:, :n_prompt], 0, cache, images=images,
                                           token_types=types_BS[:, :n_prompt])]
        for t in range(n_prompt, len(ids)):
            steps.append(model.forward_incremental(ids_BS[:, t : t + 1], t, cache, token_types=types_BS[:, t : t + 1]))
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="no vision tower"):
        Transformer(get_flavor("debug", engram_layer_ids=(), engram_num_embeddings=()))(
            ids_BS, images=images, token_types=types_BS
        )
