"""Video pixels against transformers, on videos written with PyAV, for the three families' published
processor files (`dhp_jax/data/models/<name>/`):

- the stream metadata (frame count, rate) and the decoded frames against transformers' own PyAV reader
  (`transformers.video_utils.read_video_pyav`): equal, uint8 bit for bit;
- the frame indices against the video processors' own `sample_frames` (Qwen3-VL's class as installed;
  Qwen2-VL's and InternVL's module source with its torchvision import stubbed, see test_vision_rule);
- each sampled frame, resized and normalised by the project (`VisionProcessor.video_frames`), against
  transformers' image processor (Pillow backend, fp32) on that frame: bit for bit. InternVL: GotOcr2's
  image processor with one 448x448 tile; Qwen2.5-VL: Qwen2-VL's image processor with the pixel bounds
  the video rule used (same resize rule), whole patch rows compared; Qwen3-VL (its video size rule spans
  all frames, so no image-size setting reproduces it): the Qwen2-VL image processor's own Pillow-backend
  resize to the planned size, then its rescale and normalise.
"""

import numpy as np
import pytest

from dhp_jax.data.example import write_video
from dhp_jax.data.media import load_video_frames, video_info
from dhp_jax.data.processors import VisionProcessor
from dhp_jax.models.qwen_common.processor import qwen_patchify
from dhp_jax.data.vision import MODELS_DIR

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
from PIL import Image  # noqa: E402
from transformers.video_utils import VideoMetadata, read_video_pyav  # noqa: E402

from test_vision_rule import REFERENCE, _files, _video_module  # noqa: E402

VIDEOS = [(64, 48, 23, 10), (200, 100, 50, 25), (320, 240, 61, 30), (98, 202, 30, 24)]  # w, h, frames, fps
SAMPLINGS = ["auto", {"num_frames": 6}]


@pytest.fixture(scope="module")
def videos(tmp_path_factory):
    d = tmp_path_factory.mktemp("videos")
    return [write_video(str(d / f"v{i}.mp4"), w, h, n, fps, seed=i) for i, (w, h, n, fps) in enumerate(VIDEOS)]


def _reference_indices(family, cfg, meta, sampling):
    kw = {k: v for k, v in cfg.items() if k not in ("video_processor_type", "image_processor_type",
                                                    "processor_class")}
    if family == "qwen3_vl":
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
        ref = Qwen3VLVideoProcessor(**kw)
        call = {"num_frames": sampling["num_frames"], "fps": None} if "num_frames" in sampling else {}
        return np.asarray(ref.sample_frames(meta, **call))
    if family == "qwen2_5_vl":
        ref = _video_module("transformers.models.qwen2_vl.video_processing_qwen2_vl").Qwen2VLVideoProcessor(**kw)
    else:
        ref = _video_module("transformers.models.internvl.video_processing_internvl").InternVLVideoProcessor(**kw)
    call = {"num_frames": sampling["num_frames"]} if "num_frames" in sampling else {"fps": sampling["fps"]}
    return np.asarray(ref.sample_frames(meta, **call))


def _frame_reference(family, vp, frame, plan):
    """transformers' image processor (Pillow backend) on one frame -> float32, in the layout compared."""
    from transformers import GotOcr2ImageProcessorPil, Qwen2VLImageProcessorPil
    from transformers.image_processing_backends import PilBackend
    from transformers.image_utils import SizeDict
    c = vp.video
    common = {"image_mean": list(c["image_mean"]), "image_std": list(c["image_std"]), "resample": c["resample"],
              "rescale_factor": c["rescale_factor"]}
    im = Image.fromarray(frame)
    w, h = plan.size
    if family == "internvl":
        ref = GotOcr2ImageProcessorPil(size={"height": h, "width": w}, crop_to_patches=False, **common)
        return ref(im, return_tensors="np")["pixel_values"][0]
    p, m, tp = c["patch_size"], c["merge_size"], c["temporal_patch_size"]
    if family == "qwen2_5_vl":   # the video's per-frame pixel bounds: the same smart_resize picks (h, w)
        n, f = len(plan.indices), p * m
        lo, hi = c["size"]["shortest_edge"], c["size"]["longest_edge"]
        if c.get("cap_pixels_per_frame"):
            hi = max(min(hi, int(c["max_video_tokens"] * f * f * 0.9) * tp // n), int(lo * 1.05))
        ref = Qwen2VLImageProcessorPil(size={"shortest_edge": lo, "longest_edge": hi}, patch_size=p, merge_size=m,
                                       temporal_patch_size=tp, **common)
        out = ref(im, return_tensors="np")
        assert out["image_grid_thw"][0].tolist() == [1, plan.grid[1], plan.grid[2]]
        return out["pixel_values"]
    ref = Qwen2VLImageProcessorPil(patch_size=p, merge_size=m, temporal_patch_size=tp, **common)
    x = np.ascontiguousarray(np.moveaxis(frame, -1, 0))
    x = PilBackend.resize(ref, x, SizeDict(height=h, width=w), ref.resample)
    return ref.normalize(ref.rescale(x, ref.rescale_factor), ref.image_mean, ref.image_std)


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["auto", "num_frames"])
@pytest.mark.parametrize("family", list(REFERENCE))
def test_video_frames_equal_transformers(family, sampling, videos):
    name = REFERENCE[family]
    _, cfg = _files(name)
    vp = VisionProcessor.from_pretrained(str(MODELS_DIR / name), family, sampling)
    compared = planned = 0
    for path in videos:
        info = video_info(path)
        plan = vp.video_plan(info)
        planned += len(plan.indices)
        # the stream and the decoded frames: transformers' PyAV reader
        ref_frames, meta = read_video_pyav(path, sample_indices_fn=lambda metadata, **kw: plan.indices)
        assert (meta.total_num_frames, meta.fps, meta.width, meta.height) == \
            (info.total_frames, info.fps, info.width, info.height)
        frames = load_video_frames(path, plan.indices)
        assert frames.dtype == np.uint8 and np.array_equal(frames, ref_frames), path
        # the frame indices: the video processor's own sampling code
        want = _reference_indices(family, cfg, VideoMetadata(total_num_frames=info.total_frames, fps=info.fps),
                                  vp.video_sampling)
        assert np.array_equal(plan.indices, want), (path, plan.indices, want)
        # each frame's pixels
        ours = vp.video_frames(frames, plan)
        assert ours.dtype == np.float32 and ours.shape == (len(frames), 3, plan.size[1], plan.size[0])
        for t, frame in enumerate(frames):
            ref = _frame_reference(family, vp, frame, plan)
            mine = qwen_patchify(ours[t][None], vp.video["patch_size"], vp.video["merge_size"],
                                  vp.video["temporal_patch_size"]) if family == "qwen2_5_vl" else ours[t]
            assert ref.dtype == np.float32 and ref.shape == mine.shape, (path, t)
            assert np.array_equal(mine, ref), (path, t, float(np.abs(mine - ref).max()))
            compared += 1
    assert compared == planned >= len(videos)
