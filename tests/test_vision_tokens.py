"""Vision-token rules on sizes worked out by hand, plus the invariants each rule promises.

A family name stands for its reference model's processor files ("qwen-vl": qwen2.5-vl-32b's images,
3136..12845056 px at 28 px a token, and the Qwen2-VL video processor's defaults) with the run's
default video sampling ("auto")."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dhp_jax.data.vision import (family_for_model, image_segment, image_tokens, video_segment,
                                 video_tokens, vision_rules)
from dhp_jax.models.qwen_common.processor import smart_resize


@pytest.mark.parametrize("w,h,tokens", [
    (224, 224, 64),        # 8x8 grid of 28-px cells
    (448, 448, 256),
    (1920, 1080, 2691),    # 1932x1092 after rounding to 28: 69 x 39
    (10, 10, 4),           # below min pixels: scaled up to 56x56
    (28, 28, 4),
])
def test_qwen_image_known_sizes(w, h, tokens):
    assert image_tokens(w, h, "qwen-vl") == tokens


def test_qwen_image_huge_is_capped():
    n = image_tokens(10000, 10000, "qwen-vl")
    assert 16000 <= n <= 16384


def test_qwen_rejects_extreme_aspect_and_bad_sizes():
    with pytest.raises(ValueError, match="aspect"):
        image_tokens(1, 300, "qwen-vl")
    with pytest.raises(ValueError, match="width"):
        image_tokens(0, 10, "qwen-vl")
    with pytest.raises(ValueError, match="height"):
        image_tokens(10, float("nan"), "internvl")


@given(st.integers(1, 8000), st.integers(1, 8000))
@settings(max_examples=300, deadline=None)
def test_qwen_image_bounds(w, h):
    if max(w, h) / min(w, h) > 200:
        return
    rh, rw = smart_resize(h, w, 28, 4 * 784, 16384 * 784)
    assert rw % 28 == 0 and rh % 28 == 0
    assert 4 <= image_tokens(w, h) == (rw // 28) * (rh // 28) <= 16384


def test_qwen_video_known_clips():
    # "qwen-vl": the Qwen2-VL video processor's defaults (128..768 tokens a frame), 2 fps, the total cap.
    # 10 s at 30 fps -> 20 frames -> 10 temporal pairs; 1280x720 exceeds 768 tokens/frame and is
    # shrunk by sqrt(921600/602112): 560x1008 = 20 x 36 = 720 tokens per pair.
    v = video_tokens(10, 1280, 720, "qwen-vl", source_fps=30)
    assert (v.frames, v.units, v.tokens_per_frame, v.num_tokens) == (20, 10, 720, 7200)
    # 300 s 1080p -> 600 frames; per-frame cap 90316800 x 2 / 600 = 301056 px -> 392x728 = 14 x 26 = 364.
    v = video_tokens(300, 1920, 1080, "qwen-vl")
    assert (v.frames, v.tokens_per_frame, v.num_tokens) == (600, 364, 109200)
    # very short clip: at least 4 frames
    assert video_tokens(0.5, 320, 240, "qwen-vl").frames == 4
    # a Qwen2.5-VL checkpoint's files: its video processor reads the image file's bounds (3136..12845056
    # px a frame), so 1280x720 only rounds to 28: 728x1288 = 26 x 46 = 1196 per pair
    v = video_tokens(10, 1280, 720, "qwen2.5-vl-32b", source_fps=30)
    assert (v.frames, v.units, v.tokens_per_frame, v.num_tokens) == (20, 10, 1196, 11960)
    # the stored model's files as they are ("files"): every frame, 3136..12845056 px each
    v = vision_rules("qwen2.5-vl-32b", "files").video(10, 1280, 720, source_fps=30)
    assert (v.frames, v.units, v.tokens_per_frame, v.num_tokens) == (300, 150, 1196, 179400)


@given(st.floats(0.1, 3600), st.integers(16, 4096), st.integers(16, 4096))
@settings(max_examples=200, deadline=None)
def test_qwen_video_bounded_by_total_budget(d, w, h):
    if max(w, h) / min(w, h) > 200:
        return
    v = video_tokens(d, w, h, "qwen-vl")
    stream = max(1, round(d * 30))  # the clip's frames at the default 30 fps
    assert v.frames % 2 == 0 and min(4, stream // 2 * 2) <= v.frames <= min(768, stream)
    assert v.num_tokens == v.units * v.tokens_per_frame
    # the Qwen2-VL video processor's cap: 90% of 128000 tokens' pixels over the clip; frames >= 128 tokens
    assert v.num_tokens <= 115200 and v.tokens_per_frame >= 128


@pytest.mark.parametrize("w,h,tiles", [
    (448, 448, 1),        # one tile, no thumbnail
    (896, 448, 3),        # 2x1 grid + thumbnail
    (1920, 1080, 9),      # aspect 1.78: 2x1 and 4x2 tie at 0.22, the image is large -> 4x2 + thumbnail
    (640, 480, 13),       # exact 4x3 grid + thumbnail
    (100, 1000, 11),      # 1x10 + thumbnail
    (300, 200, 7),        # aspect 1.5: 3x2 + thumbnail
    (200, 200, 1),
])
def test_internvl_tiles(w, h, tiles):
    assert image_tokens(w, h, "internvl") == 256 * tiles


def test_internvl_and_llava_video():
    v = video_tokens(64, 1920, 1080, "internvl")
    assert (v.frames, v.num_tokens) == (64, 64 * 256)
    assert video_tokens(2, 640, 480, "internvl").frames == 2      # 1 frame/s
    assert video_tokens(1000, 640, 480, "internvl").frames == 1000
    assert video_tokens(10, 640, 480, "internvl3-8b", source_fps=25).frames == 10
    assert vision_rules("internvl3-8b", "files").video(10, 640, 480, source_fps=25).frames == 250  # every frame
    assert vision_rules("internvl3-8b", {"num_frames": 8}).video(10, 640, 480, source_fps=25).frames == 8
    with pytest.raises(ValueError, match="gives no frame at 1 frames/s"):
        video_tokens(0.5, 640, 480, "internvl")
    assert image_tokens(1920, 1080, "llava") == 576
    v = video_tokens(30, 640, 480, "llava")
    assert (v.frames, v.num_tokens) == (30, 30 * 196)
    assert video_tokens(600, 640, 480, "llava").num_tokens == 64 * 196


def test_segments_and_families():
    s = image_segment(448, 448, "internvl")
    assert s.modality == "image" and s.num_tokens == 256 and s.meta["width"] == 448
    v = video_segment(10, 1280, 720, "qwen-vl", source_fps=30.0)
    assert v.modality == "video" and v.num_tokens == 7200 and v.tokens_per_frame == 720
    assert v.meta["frames"] == 20 and math.isclose(v.meta["duration_s"], 10.0)
    assert family_for_model("internvl3-8b") == "internvl"
    assert family_for_model("Qwen3-VL-8B") == "qwen3-vl"
    assert family_for_model("qwen2.5-vl-7b") == "qwen-vl"
    assert vision_rules("qwen2.5-vl").name == "qwen-vl"
    assert vision_rules("qwen3-vl-8b").name == "qwen3-vl-8b"
    with pytest.raises(ValueError, match="known: qwen-vl, qwen3-vl, internvl, llava, a stored model"):
        vision_rules("clip")
    with pytest.raises(ValueError, match="duration_s"):
        video_tokens(-1, 10, 10)


def test_qwen3_vl_uses_16px_patches():
    # Qwen3-VL's vision encoder has 16-px patches merged 2x2: 640x480 -> 20 x 15 cells of 32 px
    assert image_tokens(640, 480, "qwen3-vl") == 300
    assert image_tokens(64, 64, "qwen3-vl") == 64    # Qwen3-VL's files: at least 65536 px (64 tokens)
    assert image_tokens(640, 480, "qwen-vl") == 391
    assert vision_rules("qwen3_vl").factor == 32
