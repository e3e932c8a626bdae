"""The `dhp train` demo's synthetic inputs of a Qwen-VL family (`dhp_jax.train.demo_models`): a video
of f frames and p tokens a frame is `<|vision_start|>`, f*p video placeholders, `<|vision_end|>`,
with `video_grid_thw` (f, 2a, 2b) (a*b = p merged 2x2 units, a <= b) and one pixel row of C*T*P*P
per patch; an image likewise with (1, 2a, 2b)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np


def merged_grid(units: int) -> tuple[int, int]:
    """(a, b) with a * b == units and a <= b as close as can be: the frame's grid of merged units."""
    a = max(d for d in range(1, int(math.isqrt(units)) + 1) if units % d == 0)
    return a, units // a


class QwenDemo:
    per_frame_runs = False      # a video is one start/end run (Qwen3-VL: one run per frame)

    def shrink(self, raw: dict) -> None:
        """The demo's small patches (4 px: 3 x 2 x 4 x 4 = 96 values a pixel row)."""
        raw["vision_config"].update(patch_size=4, out_hidden_size=32)

    def setup(self, pipe, hf_config) -> int:
        """Values of one pixel row (the pipeline's patch width)."""
        v = hf_config.vision
        return v.in_channels * v.temporal_patch_size * v.patch_size ** 2

    def add_vision(self, pipe, add, rows: dict, grid: dict, modality: str, n: int, per_frame: int, pixels,
                   tokens: dict) -> None:
        frames = n // per_frame
        a, b = merged_grid(per_frame)
        kind = 1 if modality == "image" else 2
        token = tokens[modality if modality == "image" else "video"]
        start, end = tokens["vision_start"], tokens["vision_end"]
        runs = [per_frame] * frames if self.per_frame_runs and kind == 2 else [n]
        for m in runs:
            add([start] + [token] * m + [end], [0] + [kind] * m + [0], [-100] * (m + 2))
        grid["image" if kind == 1 else "video"].append((1 if kind == 1 else frames, 2 * a, 2 * b))
        rows["image" if kind == 1 else "video"].append(pixels(4 * n))

    def finish(self, inputs: dict[str, Any], kinds: list, rows: dict, grid: dict) -> None:
        inputs["mm_token_type_ids"] = np.array([kinds], np.int64)
        for modality, pixel_key, grid_key in (("image", "pixel_values", "image_grid_thw"),
                                              ("video", "pixel_values_videos", "video_grid_thw")):
            if rows[modality]:
                inputs[pixel_key] = np.concatenate(rows[modality])
                inputs[grid_key] = np.array(grid[modality], np.int64)
