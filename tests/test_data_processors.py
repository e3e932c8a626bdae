"""The families' image processing against transformers' own Pillow-backed image processors (bit
for bit), and the video rules against the video processors' published sampling/resize code."""

import math

import numpy as np
import pytest

from dhp_jax.data.media import VideoInfo
from dhp_jax.data.processors import VisionProcessor, _torch_float_arange_int

transformers = pytest.importorskip("transformers")
from PIL import Image  # noqa: E402

SIZES = [(640, 480), (97, 203), (1000, 300), (30, 30), (448, 448), (1300, 200), (17, 900)]
QWEN3 = {"patch_size": 16, "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
         "size": {"shortest_edge": 65536, "longest_edge": 16777216}}
INTERN = {"size": {"height": 448, "width": 448}, "image_mean": [0.485, 0.456, 0.406], "image_std": [0.229, 0.224, 0.225]}


def _reference(family):
    from transformers import GotOcr2ImageProcessorPil, Qwen2VLImageProcessorPil
    if family == "qwen2_5_vl":
        return Qwen2VLImageProcessorPil(), {}
    if family == "qwen3_vl":
        return Qwen2VLImageProcessorPil(**QWEN3), QWEN3
    return GotOcr2ImageProcessorPil(**INTERN), INTERN


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "internvl"])
def test_images_equal_transformers(family):
    ref, cfg = _reference(family)
    vp = VisionProcessor(family, cfg)
    rng = np.random.default_rng(0)
    worst = 0.0
    for w, h in SIZES:
        im = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        r = ref(im, return_tensors="np", **({"crop_to_patches": True} if family == "internvl" else {}))
        pv, grid = vp.process_image(im)
        assert pv.dtype == np.float32 and pv.shape == r["pixel_values"].shape, (w, h)
        worst = max(worst, float(np.abs(pv - r["pixel_values"]).max()))
        if family == "internvl":
            assert grid[0] == r["num_patches"][0]
            assert vp.image_tokens(w, h) == 256 * r["num_patches"][0]
        else:
            assert list(grid) == r["image_grid_thw"][0].tolist()
            assert vp.image_tokens(w, h) == int(np.prod(grid)) // 4 == ref.get_number_of_image_patches(h, w) // 4
    assert worst <= 1e-6, worst  # the acceptance bound; in fact the values are bit-identical:
    assert worst == 0.0, worst


def test_qwen3_counts_16px():
    vp = VisionProcessor("qwen3_vl", QWEN3)
    assert vp.image_tokens(640, 480) == 300
    assert VisionProcessor("qwen2_5_vl").image_tokens(640, 480) == 391


VIDEOS = [VideoInfo(23, 10.0, 64, 48), VideoInfo(300, 30.0, 1280, 720), VideoInfo(7, 25.0, 200, 100),
          VideoInfo(1001, 29.97, 320, 240), VideoInfo(48, 24.0, 30, 500)]


@pytest.mark.parametrize("cap", [False, True])
def test_qwen3_video_rules_equal_its_processor(cap):
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.video_utils import VideoMetadata
    ref = Qwen3VLVideoProcessor(cap_pixels_per_frame=cap)
    vp = VisionProcessor("qwen3_vl", {}, {"cap_pixels_per_frame": cap})
    for info in VIDEOS:
        meta = VideoMetadata(total_num_frames=info.total_frames, fps=info.fps)
        idx = np.asarray(ref.sample_frames(meta))
        assert np.array_equal(vp.frame_indices(info), idx)
        plan = vp.video_plan(info)
        assert plan.tokens * 4 == ref.get_num_of_video_patches(len(idx), info.height, info.width,
                                                               {"cap_pixels_per_frame": cap})
        want_ts = Qwen3VLProcessor._calculate_timestamps(None, idx, info.fps, 2)
        assert np.allclose(plan.timestamps, want_ts, rtol=0, atol=1e-12)


def test_qwen_video_patchify_equals_processor():
    """The video pixels' flattening order against the Qwen3-VL video processor's torch patchify."""
    torch = pytest.importorskip("torch")
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    vp = VisionProcessor("qwen3_vl")
    info = VideoInfo(5, 2.0, 70, 50)
    plan = vp.video_plan(info)
    frames = np.random.default_rng(1).integers(0, 256, (len(plan.indices), 50, 70, 3), dtype=np.uint8)
    ours = vp.process_video(frames, plan)
    w, h = plan.size
    x = np.stack([vp._normalize(np.asarray(Image.fromarray(f).resize((w, h), 3)), vp.video) for f in frames])
    ref, t, gh, gw = Qwen3VLVideoProcessor().patchify(torch.from_numpy(x)[None], 16, 2, 2)
    assert (t, gh, gw) == plan.grid and np.array_equal(ours, ref[0].numpy())


def _torch_indices(start, total, num):
    torch = pytest.importorskip("torch")
    return torch.arange(start, total, total / num).int().numpy()


@pytest.mark.parametrize("fps,num", [(2.0, None), (None, 6), (None, None)])
def test_qwen2_5_video_sampling_rule(fps, num):
    """Qwen2-VL video processor's `sample_frames` (torchvision-bound, so its rule is restated)."""
    vp = VisionProcessor("qwen2_5_vl", {}, {"do_sample_frames": True, "fps": fps, "num_frames": num})
    for info in VIDEOS:
        if num is not None:
            n = round(num / 2) * 2
        elif fps is not None:
            top = math.floor(min(768, info.total_frames) / 2) * 2
            n = math.floor(min(max(info.total_frames / info.fps * fps, 4), top, info.total_frames) / 2) * 2
        else:
            n = None
        idx = vp.frame_indices(info)
        want = np.arange(info.total_frames) if n is None else _torch_indices(0, info.total_frames, n)
        assert np.array_equal(idx, want), info
        plan = vp.video_plan(info)
        assert plan.grid[0] == -(-len(idx) // 2)
        assert math.isclose(plan.second_per_grid_t, 2 / (len(idx) / info.total_frames * info.fps))


@pytest.mark.parametrize("num", [4, 7, 9])
def test_internvl_video_sampling_rule(num):
    vp = VisionProcessor("internvl", {}, {"do_sample_frames": True, "num_frames": num})
    for info in VIDEOS + [VideoInfo(24, 8.0, 64, 48)]:  # 24 frames / 7: float32 rounding decides an index
        if info.total_frames < num:  # the processor refuses to sample more frames than there are
            with pytest.raises(ValueError, match=f"cannot sample {num} frames"):
                vp.frame_indices(info)
            continue
        idx = vp.frame_indices(info)
        shift = info.total_frames / num / 2
        assert np.array_equal(idx, _torch_indices(shift, info.total_frames, num)), (info, num)
        assert vp.video_plan(info).tokens == num * 256
    assert np.array_equal(_torch_float_arange_int(0.0, 23, 23 / 6), _torch_indices(0, 23, 6))


@pytest.mark.parametrize("mode", ["RGBA", "LA", "L", "P", "CMYK"])
def test_non_rgb_images_convert_as_transformers_does(tmp_path, mode):
    """Grey, palette, CMYK and transparent images: `load_image`'s conversion (alpha composited onto
    white) then our processing equals transformers' processor given the original image."""
    from transformers import Qwen2VLImageProcessorPil
    from dhp_jax.data.media import load_image
    rng = np.random.default_rng(2)
    a = rng.integers(0, 256, (50, 70, 4), dtype=np.uint8)
    im = Image.fromarray(a, "RGBA").convert(mode) if mode != "RGBA" else Image.fromarray(a, "RGBA")
    path = tmp_path / f"x.{'jpg' if mode == 'CMYK' else 'png'}"
    im.save(path)
    rgb, got_mode = load_image(str(path))
    assert got_mode == mode and rgb.mode == "RGB"
    ours, _ = VisionProcessor("qwen2_5_vl").process_image(rgb)
    ref = Qwen2VLImageProcessorPil()(Image.open(path), return_tensors="np")["pixel_values"]
    assert np.array_equal(ours, ref)
