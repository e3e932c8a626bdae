"""The Qwen-VL processors' rules (Qwen2-VL image processor; the video processors differ per
family in how they sample frames and bound pixels, `frame_indices` and `video_size`): one row per
patch in the order (t, h/m, w/m, m, m) with C*T*P*P values a row, `smart_resize` to multiples of
patch x merge, `image_grid_thw` = (1, H/patch, W/patch), LLM tokens = grid product / merge^2."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from dhp_jax.data.processors import CLIP_MEAN, CLIP_STD, VideoPlan, _resize

MAX_ASPECT_RATIO = 200  # the Qwen processors refuse longer strips


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's resize rule: multiples of `factor`, pixels within [min, max], aspect kept."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(f"aspect ratio {max(height, width) / min(height, width):.0f} is above {MAX_ASPECT_RATIO}")
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def qwen_patchify(x: np.ndarray, patch: int, merge: int, temporal: int) -> np.ndarray:
    """[T, C, H, W] -> [T/tp * H/p * W/p, C*tp*p*p] in Qwen-VL's order; T == 1 repeats the frame."""
    t, ch, hh, ww = x.shape
    if t == 1:
        x = np.broadcast_to(x, (temporal, ch, hh, ww))
        t = temporal
    gt, gh, gw = t // temporal, hh // patch, ww // patch
    y = x.reshape(gt, temporal, ch, gh // merge, merge, patch, gw // merge, merge, patch)
    y = y.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return np.ascontiguousarray(y.reshape(gt * gh * gw, ch * temporal * patch * patch), dtype=np.float32)


# the Qwen2-VL image processor's own defaults (both families use it)
IMAGE_DEFAULTS = {"size": {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280}, "patch_size": 14,
                  "temporal_patch_size": 2, "merge_size": 2, "image_mean": CLIP_MEAN, "image_std": CLIP_STD}


class QwenPatches:
    """A Qwen family's image and video rules (`VisionProcessor` `p` passes itself)."""

    image_defaults: dict[str, Any] = IMAGE_DEFAULTS
    video_defaults: dict[str, Any] = {}
    auto_sampling: dict[str, Any] = {}

    def factor(self, p) -> int:
        """Pixels per LLM token along a side: patch x merge."""
        return p.image["patch_size"] * p.image["merge_size"]

    def image_grid(self, p, width: int, height: int) -> tuple[int, int, int]:
        c = p.image
        f = c["patch_size"] * c["merge_size"]
        h, w = smart_resize(height, width, f, c["size"]["shortest_edge"], c["size"]["longest_edge"]) \
            if c["do_resize"] else (height, width)
        return 1, h // c["patch_size"], w // c["patch_size"]

    def image_tokens(self, p, grid: tuple[int, int, int]) -> int:
        t, h, w = grid
        return t * h * w // p.image["merge_size"] ** 2

    def process_image(self, p, rgb, grid) -> np.ndarray:
        c = p.image
        _, gh, gw = grid
        patch = c["patch_size"]
        img = _resize(rgb, gw * patch, gh * patch, c["resample"]) if c["do_resize"] else np.asarray(rgb)
        x = p._normalize(img, c)[None]  # [1, C, H, W]
        return qwen_patchify(x, patch, c["merge_size"], c["temporal_patch_size"])

    def frame_indices(self, p, info, fps, num) -> np.ndarray:
        raise NotImplementedError

    def video_size(self, p, info, n: int, f: int, lo: int, hi: int) -> tuple[int, int]:
        raise NotImplementedError

    def video_extras(self, p, idx: np.ndarray, info, tp: int) -> dict[str, Any]:
        """VideoPlan fields of the family's prompt or positions (timestamps, second_per_grid_t)."""
        return {}

    def video_plan(self, p, info, idx: np.ndarray) -> VideoPlan:
        c, n = p.video, len(idx)
        patch, m, tp = c["patch_size"], c["merge_size"], c["temporal_patch_size"]
        f = patch * m
        h, w = self.video_size(p, info, n, f, c["size"]["shortest_edge"], c["size"]["longest_edge"])
        gt = -(-n // tp)
        grid = (gt, h // patch, w // patch)
        tokens = gt * (h // patch) * (w // patch) // (m * m)
        return VideoPlan(idx, grid, tokens, (w, h), info.fps, **self.video_extras(p, idx, info, tp))

    def process_video(self, p, x: np.ndarray) -> np.ndarray:
        c = p.video
        tp = c["temporal_patch_size"]
        if pad := -len(x) % tp:  # repeat the last frame up to a whole temporal patch
            x = np.concatenate([x, np.repeat(x[-1:], pad, axis=0)])
        return qwen_patchify(x, c["patch_size"], c["merge_size"], tp)

    def model_inputs(self, out: dict, images: list, image_grids: list, videos: list, plans: list, order: list) -> None:
        """Fill the processor's pixel keys of one sample into `out` (images' and videos' pixel
        values in the order the text names them; `order`: "image"/"video" per media item)."""
        if images:
            out["pixel_values"] = np.concatenate(images)
            out["image_grid_thw"] = np.asarray(image_grids, np.int64)
        if videos:
            out["pixel_values_videos"] = np.concatenate(videos)
            out["video_grid_thw"] = np.asarray([v.grid for v in plans], np.int64)
