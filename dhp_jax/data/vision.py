"""Vision-token rules: how many LLM tokens an image or a video clip becomes, per encoder family.

Three families, chosen to match the model being planned (each family's published
image processor in Hugging Face transformers; docs/DESIGN.md, section 10):

- "qwen-vl" (Qwen2-VL / Qwen2.5-VL-like): 14-px patches merged 2x2, so one LLM token
  per 28x28 pixels. An image is resized to multiples of 28 keeping its aspect ratio, with pixel
  bounds that give 4..16384 tokens. Video frames are sampled (2 fps by default) and merged in
  temporal pairs (temporal patch 2); a per-frame pixel budget shrinks frames of long clips.
- "internvl" (InternVL2.5 / InternVL3-like): 448x448 tiles of 256 tokens; 1..12 tiles chosen by
  the closest aspect-ratio grid, plus one thumbnail tile when there is more than one tile. Each
  video frame is one 448x448 tile (256 tokens).
- "llava" (LLaVA-1.5 / LLaVA-OneVision-like): a fixed 576 tokens per image (24x24 patches of a
  336-px crop) and 196 tokens per video frame (OneVision's pooled 14x14 grid).

Pure Python: the planner, the manifest reader and the generators call these in hot loops.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

from dhp_jax.data.processors import MAX_ASPECT_RATIO, smart_resize  # noqa: F401 (MAX_ASPECT_RATIO: public)
from dhp_jax.data.sample import Segment

VISION_FAMILIES = ("qwen-vl", "qwen3-vl", "internvl", "llava")



@dataclasses.dataclass(frozen=True)
class VideoTokens:
    """Token count of one video clip under a family's rule.

    `frames` are the frames sampled from the clip; `units` the temporal units the encoder emits
    (frames / temporal_patch); `tokens_per_frame` the LLM tokens of one unit.
    """

    num_tokens: int
    frames: int
    units: int
    tokens_per_frame: int
    width: int   # per-frame resolution after the family's resize
    height: int


@dataclasses.dataclass(frozen=True)
class QwenVLRules:
    """Qwen-VL-like rule. Defaults follow the public Qwen2-VL processor and qwen-vl-utils:

    - image: factor 28 (patch 14 x merge 2), min 4 tokens (4*28*28 px), max 16384 tokens;
    - video: sampled at `fps` = 2 frames/s, frame count even (temporal patch 2), 4..768 frames;
      each frame between 128 and 768 tokens (per temporal pair), and the whole clip's pixel budget
      ~115200 tokens (0.9 x 128000 x 28 x 28 px) shared by its frames, so long clips get smaller
      frames rather than unbounded length.
    """

    patch: int = 14  # a model with another patch size: QwenVLRules(patch=16) gives 32 px per token
    merge: int = 2
    min_tokens: int = 4
    max_tokens: int = 16384
    fps: float = 2.0
    temporal_patch: int = 2
    min_frames: int = 4
    max_frames: int = 768
    video_min_tokens: int = 128
    video_max_tokens: int = 768
    video_total_tokens: float = 0.9 * 128000
    name: str = "qwen-vl"

    @property
    def factor(self) -> int:
        return self.patch * self.merge

    def resize(self, width: int, height: int, min_pixels: float, max_pixels: float) -> tuple[int, int]:
        """Resize to multiples of `factor`, aspect kept, pixels within [min_pixels, max_pixels]."""
        _check_size(width, height)
        h, w = smart_resize(height, width, self.factor, min_pixels, max_pixels)
        return w, h

    def image_tokens(self, width: int, height: int) -> int:
        f2 = self.factor * self.factor
        w, h = self.resize(width, height, self.min_tokens * f2, self.max_tokens * f2)
        return (w // self.factor) * (h // self.factor)

    def video_frames(self, duration_s: float, source_fps: float | None = None) -> int:
        """Frames sampled from a clip: duration x fps, rounded to the temporal patch, bounded."""
        tp = self.temporal_patch
        n = duration_s * self.fps
        if source_fps:  # cannot sample more frames than the clip has (rounded down to pairs)
            n = min(n, max(tp, math.floor(duration_s * source_fps / tp) * tp))
        n = round(n / tp) * tp
        return int(min(max(n, self.min_frames), self.max_frames))

    def video(self, duration_s: float, width: int, height: int, source_fps: float | None = None) -> VideoTokens:
        _check_duration(duration_s)
        frames = self.video_frames(duration_s, source_fps)
        f2 = self.factor * self.factor
        budget = min(self.video_max_tokens * f2, self.video_total_tokens * f2 / frames * self.temporal_patch)
        max_pixels = max(budget, self.video_min_tokens * f2 * 1.05)
        w, h = self.resize(width, height, self.video_min_tokens * f2, max_pixels)
        per_unit = (w // self.factor) * (h // self.factor)
        units = frames // self.temporal_patch
        return VideoTokens(units * per_unit, frames, units, per_unit, w, h)


@dataclasses.dataclass(frozen=True)
class InternVLRules:
    """InternVL-like dynamic tiling: 448x448 tiles of 256 tokens, `min_tiles..max_tiles` (1..12).

    The tile grid (columns x rows) is the one whose aspect ratio is closest to the image's; on a
    tie the larger grid wins when the image has more than half its pixels. Ties between grids
    are broken in the order (tiles, columns, rows), a choice that makes the rule deterministic.
    Video: a choice of ours, not a published rule: `fps` = 1 frame/s, 4..512 frames, one 448x448
    tile (256 tokens) per frame, so long clips stay long as in the DHP paper's video runs.
    """

    tile: int = 448
    tokens_per_tile: int = 256
    min_tiles: int = 1
    max_tiles: int = 12
    thumbnail: bool = True
    fps: float = 1.0
    min_frames: int = 4
    max_frames: int = 512
    name: str = "internvl"

    def grid(self, width: int, height: int) -> tuple[int, int]:
        """(columns, rows) of the tile grid for an image."""
        _check_size(width, height)
        aspect = width / height
        grids = sorted({(c, r) for c in range(1, self.max_tiles + 1) for r in range(1, self.max_tiles + 1)
                        if self.min_tiles <= c * r <= self.max_tiles}, key=lambda g: (g[0] * g[1], g[0], g[1]))
        best, best_diff = grids[0], math.inf
        for c, r in grids:
            diff = abs(aspect - c / r)
            if diff < best_diff:
                best, best_diff = (c, r), diff
            elif diff == best_diff and width * height > 0.5 * self.tile * self.tile * c * r:
                best = (c, r)
        return best

    def image_tiles(self, width: int, height: int) -> int:
        c, r = self.grid(width, height)
        n = c * r
        return n + 1 if self.thumbnail and n > 1 else n

    def image_tokens(self, width: int, height: int) -> int:
        return self.image_tiles(width, height) * self.tokens_per_tile

    def video(self, duration_s: float, width: int, height: int, source_fps: float | None = None) -> VideoTokens:
        _check_duration(duration_s)
        _check_size(width, height)
        frames = _sampled_frames(duration_s, self.fps, self.min_frames, self.max_frames, source_fps)
        return VideoTokens(frames * self.tokens_per_tile, frames, frames, self.tokens_per_tile, self.tile, self.tile)


@dataclasses.dataclass(frozen=True)
class LlavaRules:
    """LLaVA-like fixed counts: 576 per image (LLaVA-1.5, 336 px / 14 px patches = 24x24) and
    196 per video frame (LLaVA-OneVision, 2x2-pooled 27x27 grid -> 14x14).
    Frame sampling is our choice: `fps` = 1 frame/s, 4..64 frames."""

    image_token_count: int = 576
    frame_tokens: int = 196
    fps: float = 1.0
    min_frames: int = 4
    max_frames: int = 64
    name: str = "llava"

    def image_tokens(self, width: int, height: int) -> int:
        _check_size(width, height)
        return self.image_token_count

    def video(self, duration_s: float, width: int, height: int, source_fps: float | None = None) -> VideoTokens:
        _check_duration(duration_s)
        _check_size(width, height)
        frames = _sampled_frames(duration_s, self.fps, self.min_frames, self.max_frames, source_fps)
        return VideoTokens(frames * self.frame_tokens, frames, frames, self.frame_tokens, 384, 384)


VisionRules = QwenVLRules | InternVLRules | LlavaRules

_FAMILIES: dict[str, VisionRules] = {"qwen-vl": QwenVLRules(), "qwen3-vl": QwenVLRules(patch=16, name="qwen3-vl"),
                                     "internvl": InternVLRules(), "llava": LlavaRules()}
_ALIASES = {"qwen": "qwen-vl", "qwen2-vl": "qwen-vl", "qwen2.5-vl": "qwen-vl", "qwen2_5_vl": "qwen-vl",
            "qwen3_vl": "qwen3-vl",
            "intern-vl": "internvl", "llava-1.5": "llava", "llava-onevision": "llava"}


def vision_rules(family: str | VisionRules) -> VisionRules:
    """The rule object of a family name ("qwen-vl", "internvl", "llava"), or a rule object as is."""
    if not isinstance(family, str):
        return family
    key = _ALIASES.get(family.lower(), family.lower())
    if key not in _FAMILIES:
        raise ValueError(f"unknown vision family {family!r}; known: {', '.join(VISION_FAMILIES)}")
    return _FAMILIES[key]


def family_for_model(model: str) -> str:
    """The vision family of a model name: a stored model's (`dhp_jax.data.model_configs`: the rule
    its config.json's patch size and merge give, "qwen3-vl-8b" -> "qwen3-vl"), else by the name's
    prefix: "internvl3-8b" -> "internvl", "qwen2.5-vl-7b" -> "qwen-vl"."""
    from dhp_jax.data import model_configs

    m = model.lower()
    if model_configs.is_stored(m):
        return model_configs.model_facts(m).vision_rule
    for prefix, fam in (("internvl", "internvl"), ("intern-vl", "internvl"), ("qwen3", "qwen3-vl"),
                        ("qwen", "qwen-vl"), ("llava", "llava")):
        if m.startswith(prefix):
            return fam
    raise ValueError(f"cannot tell the vision family of model {model!r}; "
                     f"name one of {', '.join(VISION_FAMILIES)} explicitly")


def image_tokens(width: int, height: int, family: str | VisionRules = "qwen-vl") -> int:
    """LLM tokens of one image of `width` x `height` pixels."""
    return vision_rules(family).image_tokens(width, height)


def video_tokens(duration_s: float, width: int, height: int, family: str | VisionRules = "qwen-vl",
                 source_fps: float | None = None) -> VideoTokens:
    """LLM tokens of one video clip (duration in seconds, frame size in pixels)."""
    return vision_rules(family).video(duration_s, width, height, source_fps)


def image_segment(width: int, height: int, family: str | VisionRules = "qwen-vl", **meta: Any) -> Segment:
    """A payload-free image `Segment` with its resolution in `meta`."""
    rules = vision_rules(family)
    return Segment("image", rules.image_tokens(width, height),
                   meta={"width": int(width), "height": int(height), "family": rules.name, **meta})


def video_segment(duration_s: float, width: int, height: int, family: str | VisionRules = "qwen-vl",
                  source_fps: float | None = None, **meta: Any) -> Segment:
    """A payload-free video `Segment`; `tokens_per_frame` is the tokens of one temporal unit."""
    rules = vision_rules(family)
    v = rules.video(duration_s, width, height, source_fps)
    return Segment("video", v.num_tokens, tokens_per_frame=v.tokens_per_frame,
                   meta={"duration_s": float(duration_s), "width": int(width), "height": int(height),
                         "fps": source_fps, "frames": v.frames, "units": v.units, "family": rules.name, **meta})


def _sampled_frames(duration_s: float, fps: float, lo: int, hi: int, source_fps: float | None) -> int:
    n = duration_s * fps
    if source_fps:
        n = min(n, duration_s * source_fps)
    return int(min(max(round(n), lo), hi))


def _check_size(width: Any, height: Any) -> None:
    for name, v in (("width", width), ("height", height)):
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not v > 0 or not math.isfinite(v):
            raise ValueError(f"{name} must be a positive number of pixels, got {v!r}")


def _check_duration(duration_s: Any) -> None:
    if isinstance(duration_s, bool) or not isinstance(duration_s, numbers.Real) \
            or not duration_s > 0 or not math.isfinite(duration_s):
        raise ValueError(f"duration_s must be a positive number of seconds, got {duration_s!r}")
