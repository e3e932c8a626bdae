"""The families' image and video processors in NumPy/Pillow, driven by a checkpoint's files.

What each family's transformers processor does (transformers 5.24, the Pillow backend for images;
the video rules as its video processors publish them), reimplemented so that neither torch nor
torchvision is needed. `VisionProcessor` holds the merged settings and the steps every family
shares (rescale and normalise, frame sampling switched on or off, the checks); the family's own
rules are its `FamilySpec.processor` (`dhp_jax.models.<family>.spec`): the image grid and its
token count, the pixel layout (Qwen's patch rows, InternVL's tiles), which frames a video
samples and at what size, and the processor's output keys.

Token counts come from sizes and stream metadata only (`image_tokens`, `video_plan`), so the
planner can count a sample before any pixel is decoded; the decoded result has the same grid. The
planner (`dhp_jax.data.vision`) counts through these same two methods.

`video_sampling` is what a run passes to the video processor call (`resolve_video_sampling`): by
default "auto", the checkpoint's own sampling, or the family's `auto_sampling` where its video
processor takes every frame.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Mapping

import numpy as np

from dhp_jax import models
from dhp_jax.data.media import MediaError, VideoInfo

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
HALF = (0.5, 0.5, 0.5)
BICUBIC = 3

_COMMON = {"do_resize": True, "do_rescale": True, "do_normalize": True, "rescale_factor": 1 / 255,
           "resample": BICUBIC}


@dataclasses.dataclass(frozen=True)
class VideoPlan:
    """What a video becomes, known from its metadata alone.

    `indices`: the frames sampled (decode order); `grid`: (t, h, w) patches for Qwen, (frames, 1, 1)
    tiles for InternVL; `tokens`: LLM placeholder tokens; `size`: (width, height) of the resized
    frames; `timestamps`: seconds per temporal patch (Qwen3-VL's prompt); `second_per_grid_t`:
    Qwen2.5-VL's M-RoPE time step."""

    indices: np.ndarray
    grid: tuple[int, int, int]
    tokens: int
    size: tuple[int, int]
    fps: float
    timestamps: tuple[float, ...] = ()
    second_per_grid_t: float | None = None


def _read_json(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def family_of(checkpoint: str) -> str:
    """The family of a checkpoint directory, from its `config.json` model_type (or processor class)."""
    cfg_path = os.path.join(checkpoint, "config.json")
    names = []
    if os.path.exists(cfg_path):
        names.append(str(_read_json(cfg_path).get("model_type", "")))
    for fn in ("processor_config.json", "preprocessor_config.json"):
        p = os.path.join(checkpoint, fn)
        if os.path.exists(p):
            d = _read_json(p)
            names += [str(d.get("processor_class", "")), str(d.get("image_processor_type", ""))]
    exact = models.spec_for_type(names[0]) if names else None
    if exact is not None:                   # a model type a family reads (before the prefixes)
        return exact.name
    for n in names:
        key = n.lower().replace("-", "_").replace(".", "_")
        for spec in models.specs():
            if key.startswith(spec.processor_names):
                return spec.name
    raise ValueError(f"{checkpoint}: cannot tell the model family (config.json model_type is not one of "
                     f"{', '.join(models.names())})")


def processor_configs(checkpoint: str) -> tuple[dict, dict, dict]:
    """(image config, video config, processor config) as saved in a checkpoint directory.

    transformers 5 saves one `processor_config.json` with the image and video processors nested
    in it; older checkpoints have `preprocessor_config.json` and `video_preprocessor_config.json`.
    A checkpoint without a video processor file (Qwen2.5-VL's releases, InternVL's own layout)
    configures its video processor from `preprocessor_config.json`, as transformers'
    `BaseVideoProcessor.from_pretrained` does.
    """
    proc: dict = {}
    p = os.path.join(checkpoint, "processor_config.json")
    if os.path.exists(p):
        proc = _read_json(p)
    image = dict(proc.get("image_processor") or {})
    video = dict(proc.get("video_processor") or {})
    if not image and os.path.exists(os.path.join(checkpoint, "preprocessor_config.json")):
        image = _read_json(os.path.join(checkpoint, "preprocessor_config.json"))
    if not video:  # as transformers' video processor loads: its own file, else the image processor's
        for fn in ("video_preprocessor_config.json", "preprocessor_config.json"):
            if os.path.exists(os.path.join(checkpoint, fn)):
                video = _read_json(os.path.join(checkpoint, fn))
                break
    return image, video, proc


def _merged(defaults: Mapping[str, Any], cfg: Mapping[str, Any]) -> dict[str, Any]:
    out = {**_COMMON, **defaults, **{k: v for k, v in cfg.items() if v is not None or k in ("fps", "num_frames")}}
    size = out.get("size")
    if isinstance(size, int) and not isinstance(size, bool):  # InternVL's own layout: `"size": 448`, a square
        size = {"height": size, "width": size}
    if not isinstance(size, Mapping):
        raise ValueError(f"processor config: 'size' must be an object or a number of pixels, got {size!r}")
    size = dict(size)
    # the Qwen processors' backward compatibility: top-level min/max pixels override `size`
    if cfg.get("min_pixels") is not None:
        size["shortest_edge"] = cfg["min_pixels"]
    if cfg.get("max_pixels") is not None:
        size["longest_edge"] = cfg["max_pixels"]
    out["size"] = size
    return out


class VisionProcessor:
    """One family's image and video processing (see the module docstring)."""

    def __init__(self, family: str, image_cfg: Mapping[str, Any] | None = None,
                 video_cfg: Mapping[str, Any] | None = None, processor_cfg: Mapping[str, Any] | None = None,
                 video_sampling: Mapping[str, Any] | str | None = "auto"):
        self.family = family
        self.rules = rules = models.spec(family).processor
        self.image = _merged(rules.image_defaults, image_cfg or {})
        files = _merged(rules.video_defaults, video_cfg or {})
        self.video_sampling = resolve_video_sampling(family, files, video_sampling)
        self.video = _merged(rules.video_defaults, {**(video_cfg or {}), **video_sampling_kwargs(self.video_sampling)})
        self.image_seq_length = int((processor_cfg or {}).get("image_seq_length", 256))

    @classmethod
    def from_pretrained(cls, checkpoint: str, family: str | None = None,
                        video_sampling: Mapping[str, Any] | str | None = "auto") -> "VisionProcessor":
        """The processors a checkpoint directory configures (`processor_configs`); `video_sampling`:
        the video keyword arguments a run passes to the processor call (`resolve_video_sampling`)."""
        image, video, proc = processor_configs(checkpoint)
        return cls(family or family_of(checkpoint), image, video, proc, video_sampling)

    # --- images: counts from the size alone --------------------------------------------------
    def image_grid(self, width: int, height: int) -> tuple[int, int, int]:
        """Qwen: `image_grid_thw` (1, H/patch, W/patch); InternVL: (tiles, columns, rows)."""
        return self.rules.image_grid(self, width, height)

    def image_tokens(self, width: int, height: int) -> int:
        """LLM placeholder tokens of one image (Qwen: pad tokens; InternVL: context tokens)."""
        return self.rules.image_tokens(self, self.image_grid(width, height))

    # --- images: pixels ----------------------------------------------------------------------
    def process_image(self, rgb) -> tuple[np.ndarray, tuple[int, int, int]]:
        """(pixel_values, grid) of one RGB `PIL.Image`: Qwen [patches, C*T*P*P]; InternVL
        [tiles, 3, S, S]; float32, exactly what the transformers image processor emits."""
        grid = self.image_grid(rgb.width, rgb.height)
        return self.rules.process_image(self, rgb, grid), grid

    @staticmethod
    def _normalize(img: np.ndarray, c: Mapping[str, Any]) -> np.ndarray:
        """uint8 [H, W, 3] -> float32 [3, H, W]; rescale in float64 then normalise in float32,
        as transformers' NumPy transforms do (bit-identical results)."""
        x = np.moveaxis(np.asarray(img), -1, 0)
        if c["do_rescale"]:
            x = (x.astype(np.float64) * c["rescale_factor"]).astype(np.float32)
        else:
            x = x.astype(np.float32)
        if c["do_normalize"]:
            mean = np.asarray(c["image_mean"], np.float32)[:, None, None]
            std = np.asarray(c["image_std"], np.float32)[:, None, None]
            x = (x - mean) / std
        return x

    # --- videos: counts from the metadata alone ------------------------------------------------
    def frame_indices(self, info: VideoInfo) -> np.ndarray:
        """The frames the family's video processor samples (decode order)."""
        c = self.video
        if not c.get("do_sample_frames"):
            return np.arange(info.total_frames, dtype=np.int64)
        return self.rules.frame_indices(self, info, c.get("fps"), c.get("num_frames"))

    def video_plan(self, info: VideoInfo) -> VideoPlan:
        """Frames, grid, tokens and timestamps of a video, from its metadata."""
        idx = self.frame_indices(info)
        if len(idx) == 0:
            raise MediaError("no_frames", "", "no frames to sample")
        return self.rules.video_plan(self, info, idx)

    # --- videos: pixels -------------------------------------------------------------------------
    def video_frames(self, frames: np.ndarray, plan: VideoPlan) -> np.ndarray:
        """The sampled frames (uint8 [T, H, W, 3]) resized to the plan's size (Pillow, the video
        processor's resample), rescaled and normalised: float32 [T, 3, h, w], before patchifying."""
        from PIL import Image

        c = self.video
        w, h = plan.size
        out = []
        for fr in frames:
            im = Image.fromarray(np.ascontiguousarray(fr[..., :3]))
            out.append(self._normalize(_resize(im, w, h, c["resample"]) if c["do_resize"] else fr, c))
        return np.stack(out)

    def process_video(self, frames: np.ndarray, plan: VideoPlan) -> np.ndarray:
        """Pixel values of the sampled frames (uint8 [T, H, W, 3]): Qwen [patches, C*T*P*P];
        InternVL [frames, 3, S, S]."""
        return self.rules.process_video(self, self.video_frames(frames, plan))

    def model_inputs(self, out: dict, images: list, image_grids: list, videos: list, plans: list,
                     order: list) -> None:
        """The processor's pixel keys of one sample, filled into `out` (`images`, `videos`: the
        pixel values of each; `order`: "image" / "video" per item as the text names them)."""
        self.rules.model_inputs(out, images, image_grids, videos, plans, order)


SAMPLING_KEYS = ("fps", "num_frames", "do_sample_frames", "cap_pixels_per_frame")


def resolve_video_sampling(family: str, files: Mapping[str, Any], sampling: Mapping[str, Any] | str | None) -> dict:
    """The video keywords a run passes: "auto" (the default) keeps the checkpoint's own sampling
    and, where its video processor takes every frame, uses the family's `auto_sampling`; "files" or None: the
    processor files as they are (every frame where they say so); a mapping: those keywords."""
    if sampling is None or sampling == "files":
        return {}
    if sampling == "auto":
        return {} if files.get("do_sample_frames") else dict(models.spec(family).processor.auto_sampling)
    if isinstance(sampling, str):
        raise ValueError(f"video sampling must be 'auto', 'files' or a mapping of {', '.join(SAMPLING_KEYS)}, "
                         f"got {sampling!r}")
    return dict(sampling)


def video_sampling_kwargs(sampling: Mapping[str, Any] | None) -> dict[str, Any]:
    """The video processor's call-time keywords of a run, checked: `fps` or `num_frames` (one of the
    two; either turns sampling on, as `do_sample_frames=True` in the processor call does),
    `do_sample_frames`, `cap_pixels_per_frame` (the Qwen2-VL video processor's total-pixel cap)."""
    out = dict(sampling or {})
    bad = sorted(set(out) - set(SAMPLING_KEYS))
    if bad:
        raise ValueError(f"video sampling: unknown key(s) {', '.join(bad)}; known: {', '.join(SAMPLING_KEYS)}")
    for key in ("fps", "num_frames"):
        v = out.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf):
            raise ValueError(f"video sampling: {key} must be a positive number, got {v!r}")
    if out.get("fps") is not None and out.get("num_frames") is not None:
        raise ValueError("video sampling: give fps or num_frames, not both")
    if out.get("fps") is not None or out.get("num_frames") is not None:
        out.setdefault("do_sample_frames", True)
        out.setdefault("num_frames" if out.get("fps") is not None else "fps", None)
    return out


def _torch_float_arange_int(start: float, end: float, step: float) -> np.ndarray:
    """`torch.arange(start, end, step).int()` with float arguments: the length is computed in
    float64, the values in float64 then stored as float32 (torch's default dtype), then truncated."""
    n = int(math.ceil((end - start) / step))
    vals = (start + step * np.arange(n, dtype=np.float64)).astype(np.float32)
    return vals.astype(np.int64)


def _resize(im, width: int, height: int, resample: int) -> np.ndarray:
    """Pillow resize of an RGB image to uint8 [height, width, 3]."""
    from PIL import Image

    if not isinstance(im, Image.Image):
        im = Image.fromarray(np.asarray(im))
    if im.size == (width, height):
        return np.asarray(im)
    return np.asarray(im.resize((width, height), resample=resample))
