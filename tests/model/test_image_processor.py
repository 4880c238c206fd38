"""Image preprocessing (spec §3.15): token budgets by hand for tall/wide/tiny/huge images, the
shrink solver's bound, exact patch layout, letterbox vs wh-cap stretch, Pillow vs torch resampling,
and span construction."""

import math

import numpy as np
import pytest
import torch

from model.config import get_flavor
from model.image_processor import (
    ImageProcessor,
    expand_image_placeholders,
    fit_image,
    num_image_tokens,
    pil_available,
    span_token_types,
)
from model.tokenizer import IMAGE, IMAGE_END, IMAGE_NEW_LINE, IMAGE_START, TEXT, Tokenizer

FLASH = ImageProcessor.from_args(get_flavor("flash"))  # 14 px patches, 3x3 unshuffle, 1024 tokens, 544² px


# (height, width) -> (target height, target width, n_llm_h, n_llm_w), worked out by hand:
HAND_PLANS = {
    # exactly min_pixels: sides round up to 546 = 39 patches -> ceil(39/3) = 13 tokens a side
    (544, 544): (546, 546, 13, 13),
    # tiny: upscaled by sqrt(295936/100) = 54.4 to 544x544, then as above
    (10, 10): (546, 546, 13, 13),
    # tall: x3.1408 -> 942x314 -> 68x23 patches -> 23x8 tokens
    (300, 100): (952, 322, 23, 8),
    # wide: the transpose
    (100, 300): (322, 952, 8, 23),
    # no resize needed: 72x50 patches -> 24x17 tokens = 434
    (1000, 700): (1008, 700, 24, 17),
    # huge: 215x286 patches would cost 72x97+2 tokens; solver: n_w <= sqrt(1022/0.75 + 1/4) - 1/2 = 36.4,
    # n_h <= 27.3, beta = 36*42/4000 = 27*42/3000 -> 1134x1512 px, 81x108 patches, 27x36 tokens
    (3000, 4000): (1134, 1512, 27, 36),
    # extreme tall: the solver collapses to one column, (1024-2)//2 = 511 rows of 42 px
    (100000, 10): (511 * 42, 42, 511, 1),
    # extreme wide: one row of 1024-3 = 1021 tokens
    (10, 100000): (42, 1021 * 42, 1, 1021),
}


@pytest.mark.parametrize("size", list(HAND_PLANS))
def test_token_budget_matches_hand_computation(size):
    plan = FLASH.plan(*size)
    height, width, n_h, n_w = HAND_PLANS[size]
    assert (plan.height, plan.width, plan.n_llm_h, plan.n_llm_w) == (height, width, n_h, n_w)
    assert (plan.n_vit_h, plan.n_vit_w) == (height // 14, width // 14)
    assert plan.n_tokens == n_h * (n_w + 1) + 2 <= 1024
    assert not plan.plain_resize


def test_budget_and_grid_invariants_over_many_sizes():
    rng = np.random.default_rng(0)
    sizes = [(int(h), int(w)) for h, w in np.exp(rng.uniform(0, math.log(30000), (400, 2)))]
    for budget in (1024, 64, 7):
        proc = ImageProcessor(max_n_token=budget)
        for h, w in sizes:
            plan = proc.plan(h, w)
            assert plan.n_tokens <= budget, (h, w, budget)
            assert plan.height % 14 == 0 and plan.width % 14 == 0 and min(plan.n_vit_h, plan.n_vit_w) >= 1
            assert (plan.n_llm_h, plan.n_llm_w) == (math.ceil(plan.n_vit_h / 3), math.ceil(plan.n_vit_w / 3))
            if h * w >= 544 * 544:  # no upscale: shrink only when the rounded-up size costs too much
                rounded = (math.ceil(h / 14) * 14, math.ceil(w / 14) * 14)
                cost = num_image_tokens(math.ceil(rounded[0] / 42), math.ceil(rounded[1] / 42))
                assert ((plan.height, plan.width) == rounded) == (cost <= budget), (h, w, budget)


def test_patches_are_row_major_and_channel_major():
    # 546x546 needs neither upscaling nor resampling, so pixel values pass through unchanged
    h = w = 546
    rr, cc = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    img = np.stack([(rr * 7 + cc) % 256, (rr + cc * 3) % 256, (rr * cc) % 256], axis=-1).astype(np.uint8)
    out = FLASH(img)
    assert (out.n_vit_h, out.n_vit_w, out.n_llm_h, out.n_llm_w) == (39, 39, 13, 13)
    assert out.patches.shape == (39 * 39, 588) and out.patches.dtype == torch.bfloat16
    norm = lambda v: torch.tensor((v / 255 - 0.5) / 0.5, dtype=torch.float32).to(torch.bfloat16)  # noqa: E731
    for i, j, ch, y, x in [(0, 0, 0, 0, 0), (0, 1, 2, 3, 13), (5, 7, 1, 13, 0), (38, 38, 2, 13, 13), (12, 30, 0, 6, 9)]:
        got = out.patches[i * 39 + j, ch * 196 + y * 14 + x]
        assert got == norm(float(img[14 * i + y, 14 * j + x, ch])), (i, j, ch, y, x)
    assert out.patches.float().min() >= -1 and out.patches.float().max() <= 1


def test_letterbox_pads_gray_centred_and_wh_cap_stretches():
    img = np.full((100, 300, 3), 255, dtype=np.uint8)  # white, 3:1
    plan = FLASH.plan(100, 300)
    for resampler in ["torch"] + (["pil"] if pil_available() else []):
        fitted = fit_image(torch.from_numpy(img), plan.height, plan.width, plan.plain_resize, resampler)
        # 322x952 target is flatter than 3:1 -> scaled to 952 wide, round(100/300*952) = 317 rows,
        # placed at round((322-317)/2) = round(2.5) = 2
        rows = (fitted == 255).all(dim=-1).all(dim=-1)
        gray = (fitted == 127).all(dim=-1).all(dim=-1)
        assert rows[2:319].all() and gray[:2].all() and gray[319:].all(), resampler
    capped = ImageProcessor(max_wh_ratio=2.0)
    plan = capped.plan(100, 500)
    assert plan.plain_resize and plan.width / plan.height == pytest.approx(2.0, rel=0.05)
    img = np.zeros((100, 500, 3), dtype=np.uint8)
    img[:, :5] = 255  # white left edge: stretched it stays at column 0; letterboxed it would be gray
    out = capped(img)
    assert out.patches[0, 0].item() == 1.0 and out.patches[0, 196].item() == 1.0


@pytest.mark.skipif(not pil_available(), reason="Pillow not installed")
def test_torch_resampling_tracks_pillow():
    rng = np.random.default_rng(1)
    for h, w in [(37, 53), (100, 300), (700, 500)]:
        img = torch.from_numpy(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        plan = FLASH.plan(h, w)
        a = fit_image(img, plan.height, plan.width, False, "pil").int()
        b = fit_image(img, plan.height, plan.width, False, "torch").int()
        diff = (a - b).abs()
        # noise images are the worst case for the cubic overshoot; natural images differ less
        assert diff.max() <= 2 and diff.float().mean() < 0.01, (h, w)


def test_processing_is_deterministic_and_validates_input():
    img = np.random.default_rng(2).integers(0, 256, (60, 90, 3), dtype=np.uint8)
    proc = ImageProcessor(resampler="torch")
    assert torch.equal(proc(img).patches, proc(torch.from_numpy(img)).patches)
    with pytest.raises(ValueError, match="uint8 RGB"):
        proc(img.astype(np.float32))
    with pytest.raises(ValueError, match="uint8 RGB"):
        proc(img[..., :2])


def test_spans_from_tokenizer_and_from_image_token_id():
    tok = Tokenizer.default()
    images = [FLASH(np.zeros((544, 544, 3), np.uint8)), FLASH(np.zeros((300, 100, 3), np.uint8))]
    text = tok.encode("look")
    ids = text + [tok.image_id] + text + [tok.image_id]
    out_ids, types = expand_image_placeholders(ids, images, tok)
    assert len(out_ids) == len(types) == 2 * len(text) + 184 + 209
    assert tok.token_types(out_ids) == types  # distinct delimiter ids make types recoverable
    assert types[: len(text)] == [TEXT] * len(text)
    span = types[len(text) : len(text) + 184]
    assert span == span_token_types(13, 13) == tok.image_span(13, 13)[1]
    assert span[0] == IMAGE_START and span[-1] == IMAGE_END and span[14] == IMAGE_NEW_LINE and span[13] == IMAGE
    assert span.count(IMAGE) == 13 * 13 and span.count(IMAGE_NEW_LINE) == 13
    ref_ids, ref_types = expand_image_placeholders([5, 129264, 6], images[:1], image_token_id=129264)
    assert ref_ids == [5] + [129264] * 184 + [6] and ref_types == [TEXT] + span + [TEXT]
    assert num_image_tokens(13, 13) == 184
    with pytest.raises(ValueError, match="2 image placeholders but 1 images"):
        expand_image_placeholders(ids, images[:1], tok)
    with pytest.raises(ValueError, match="exactly one"):
        expand_image_placeholders(ids, images, tok, image_token_id=3)
