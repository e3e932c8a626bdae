"""Vision-token rules: how many LLM tokens an image or a video clip becomes, per model.

One rule: the token count of a Qwen-VL or InternVL model is what its processors give, through
`dhp_jax.data.processors.VisionProcessor` (`image_tokens`, `video_plan`): the same function the
fine-tuning data path (`finetune.py`) calls on media headers, driven by the same files
(`preprocessor_config.json`, `video_preprocessor_config.json`). Here it counts media described by
size and duration (synthetic mixes, manifests): a clip of `duration_s` seconds at `source_fps`
frames per second is a stream of round(duration_s x source_fps) frames (`DEFAULT_SOURCE_FPS` when
the rate is not given), then sampled, resized and counted as the processor does.

What the rules are built from (`vision_rules`):

- a stored model (`dhp_jax/data/models/<name>/`, e.g. "internvl3-8b") or a checkpoint directory:
  its own processor files. Qwen2.5-VL's and InternVL's published video processors take every
  frame of a clip; Qwen3-VL's samples 2 frames per second.
- a family name, for planning without a checkpoint: the processor files of the family's
  reference model (`reference_models()`, each family's `FamilySpec.vision_rule` ->
  `published_model`: "qwen-vl" -> qwen2.5-vl-32b, "qwen3-vl" -> qwen3-vl-8b, "internvl" ->
  internvl3-8b). A reference model that publishes no video processor file (Qwen2.5-VL's releases)
  counts videos with its family's video processor's own defaults (Qwen2-VL's: 128..768 tokens a
  frame, the bounds qwen-vl-utils also uses), where a checkpoint of it reads its image file's
  bounds (3136..12845056 px a frame), as transformers loads it.
- "llava" (LLaVA-1.5 / LLaVA-OneVision-like): fixed counts, 576 tokens per image (24x24
  patches of a 336-px crop) and 196 per video frame; no processor of this project.

Video sampling is the run's (`processors.resolve_video_sampling`), the same default on both paths:
"auto" keeps a checkpoint's own sampling (Qwen3-VL: 2 frames/s) and, where its video processor
takes every frame (Qwen2.5-VL's and InternVL's published files), samples as a run passes it:
Qwen2.5-VL at 2 frames/s with the Qwen2-VL video processor's total-pixel cap, InternVL at 1
frame/s. A mapping (`{"fps": 1}`, `{"num_frames": 8}`) or "files" (every frame where the files
say so) replaces it; `FinetuneData(video_sampling=...)` takes the same values.

Pure Python and NumPy: the planner imports this module and must not import jax.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import numbers
import os
from pathlib import Path
from typing import Any, Mapping

from dhp_jax import models
from dhp_jax.data.media import VideoInfo
from dhp_jax.data.processors import VisionProcessor, family_of
from dhp_jax.data.sample import Segment

MODELS_DIR = Path(__file__).with_name("models")
# A clip described by its duration only (no frame rate) is counted as a stream at this rate.
DEFAULT_SOURCE_FPS = 30.0


def reference_models() -> dict[str, str]:
    """{vision-rule name: the stored model whose processor files it stands for}, one per family."""
    return {s.vision_rule: s.published_model for s in models.specs()}


def __getattr__(name: str):
    if name == "VISION_FAMILIES":     # the families' rule names, and LLaVA's fixed counts
        return (*reference_models(), "llava")
    if name == "REFERENCE_MODELS":
        return reference_models()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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


class ProcessorRules:
    """Counts of a `VisionProcessor` for media described by size and duration.

    `name`: what the rules were built from (a family name, a stored model, a directory);
    `family`: the vision family ("qwen-vl", "qwen3-vl", "internvl").
    """

    def __init__(self, processor: VisionProcessor, name: str):
        self.processor, self.name = processor, name
        self.family = models.spec(processor.family).vision_rule

    def __repr__(self) -> str:
        return f"ProcessorRules({self.name!r}, {self.processor.family})"

    @property
    def factor(self) -> int:
        """Pixels per LLM token along a side (patch x merge) of the image processor; InternVL: the tile."""
        return self.processor.rules.factor(self.processor)

    def image_tokens(self, width: int, height: int) -> int:
        _check_size(width, height)
        return self.processor.image_tokens(int(round(width)), int(round(height)))

    def stream(self, duration_s: float, width: int, height: int, source_fps: float | None = None) -> VideoInfo:
        """The stream metadata a clip of `duration_s` seconds stands for."""
        _check_duration(duration_s)
        _check_size(width, height)
        fps = float(source_fps) if source_fps else DEFAULT_SOURCE_FPS
        if not fps > 0 or not math.isfinite(fps):
            raise ValueError(f"source_fps must be a positive number of frames per second, got {source_fps!r}")
        return VideoInfo(max(1, round(duration_s * fps)), fps, int(round(width)), int(round(height)))

    def video(self, duration_s: float, width: int, height: int, source_fps: float | None = None) -> VideoTokens:
        plan = self.processor.video_plan(self.stream(duration_s, width, height, source_fps))
        units = plan.grid[0]
        return VideoTokens(plan.tokens, len(plan.indices), units, plan.tokens // units, *plan.size)


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


VisionRules = ProcessorRules | LlavaRules

# other spellings of the rule names (a registered family's own name stands for its rule too)
_ALIASES = {"qwen": "qwen-vl", "qwen2-vl": "qwen-vl", "qwen2.5-vl": "qwen-vl",
            "intern-vl": "internvl", "llava-1.5": "llava", "llava-onevision": "llava"}


def vision_rules(family: str | os.PathLike | VisionRules,
                 video_sampling: Mapping[str, Any] | str | None = "auto") -> VisionRules:
    """The rules of a family name ("qwen-vl", "qwen3-vl", "internvl", "llava"), a stored model
    ("internvl3-8b"), or a checkpoint directory (its processor files); a rule object as is.
    `video_sampling`: the video keywords a run passes to the processor call (module docstring)."""
    if not isinstance(family, (str, os.PathLike)):   # a rule object (anything with image_tokens / video)
        return family
    if video_sampling is None or isinstance(video_sampling, (str, tuple)):
        sampling: Any = video_sampling   # a tuple: the mapping's sorted items (a frozen dataclass field)
    else:
        sampling = tuple(sorted(video_sampling.items()))
    text = os.fspath(family)
    if _is_checkpoint_dir(text):
        return _dir_rules(os.path.abspath(text), sampling)
    key = text.lower()
    if is_model_name(key):
        return _model_rules(key, sampling)
    key = _ALIASES.get(key) or {s.name: s.vision_rule for s in models.specs()}.get(key, key)
    if key == "llava":
        return LlavaRules()
    if key not in reference_models():
        raise ValueError(f"unknown vision family {family!r}; known: {', '.join(__getattr__('VISION_FAMILIES'))}, "
                         f"a stored model "
                         f"({', '.join(stored_models())}) or a checkpoint directory with preprocessor_config.json")
    return _family_rules(key, sampling)


def stored_models() -> list[str]:
    """The stored models that carry processor files (`dhp_jax/data/models/<name>/`)."""
    return sorted(p.parent.name for p in MODELS_DIR.glob("*/preprocessor_config.json"))


def _is_checkpoint_dir(text: str) -> bool:
    """A directory named by a path, or one that holds processor files (a bare name that is also a
    stored model or a family names those)."""
    if not os.path.isdir(text):
        return False
    return os.sep in text or "/" in text or any(
        os.path.isfile(os.path.join(text, f)) for f in ("preprocessor_config.json", "processor_config.json"))


def is_model_name(name: str) -> bool:
    """Whether `name` is a stored model (`dhp_jax/data/models/<name>/`: config.json and processor files)."""
    from dhp_jax.data import model_configs

    return model_configs.is_stored(name)


@functools.lru_cache(maxsize=None)
def _model_rules(name: str, sampling: tuple) -> ProcessorRules:
    from dhp_jax.data import model_configs

    family = model_configs.model_facts(name).family
    proc = VisionProcessor.from_pretrained(str(MODELS_DIR / name), family, _sampling(sampling))
    return ProcessorRules(proc, name)


@functools.lru_cache(maxsize=None)
def _family_rules(key: str, sampling: Any) -> ProcessorRules:
    from dhp_jax.data import model_configs
    from dhp_jax.data.processors import processor_configs

    name = reference_models()[key]
    image, video, proc = processor_configs(str(MODELS_DIR / name))
    if not (MODELS_DIR / name / "video_preprocessor_config.json").is_file():
        video = {}         # no published video processor file: its own defaults (module docstring)
    family = model_configs.model_facts(name).family
    return ProcessorRules(VisionProcessor(family, image, video, proc, _sampling(sampling)), key)


@functools.lru_cache(maxsize=64)
def _dir_rules(path: str, sampling: tuple) -> ProcessorRules:
    if not any(os.path.isfile(os.path.join(path, f)) for f in ("preprocessor_config.json", "processor_config.json")):
        raise ValueError(f"{path}: no preprocessor_config.json or processor_config.json (the checkpoint's "
                         f"processor files give its vision-token counts)")
    try:
        proc = VisionProcessor.from_pretrained(path, video_sampling=_sampling(sampling))
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: unreadable processor config ({e})") from None
    return ProcessorRules(proc, path)


def _sampling(key: Any) -> Any:
    return dict(key) if isinstance(key, tuple) else key


def family_for_model(model: str) -> str:
    """The vision family of a model name: a stored model's (`dhp_jax.data.model_configs`: the rule
    its config.json's patch size and merge give, "qwen3-vl-8b" -> "qwen3-vl"), a checkpoint
    directory's (its processor files), else by the name's prefix: "internvl3-8b" -> "internvl",
    "qwen2.5-vl-7b" -> "qwen-vl"."""
    from dhp_jax.data import model_configs

    m = str(model).lower()
    if model_configs.is_stored(m):
        return model_configs.model_facts(m).vision_rule
    if _is_checkpoint_dir(str(model)):
        return models.spec(family_of(str(model))).vision_rule
    # the families' model-name prefixes (`FamilySpec.name_prefixes`), the longest first, and LLaVA's
    prefixes = sorted([(p, s.vision_rule) for s in models.specs() for p in s.name_prefixes] + [("llava", "llava")],
                      key=lambda pf: -len(pf[0]))
    for prefix, fam in prefixes:
        if m.startswith(prefix):
            return fam
    raise ValueError(f"cannot tell the vision family of model {model!r}; "
                     f"name one of {', '.join(__getattr__('VISION_FAMILIES'))} explicitly")


def rules_for_model(model: str | os.PathLike, video_sampling: Mapping[str, Any] | str | None = "auto") -> VisionRules:
    """The vision-token rules of the model a command plans: a stored model's or a checkpoint
    directory's own processor files; another name: its family's (`family_for_model`)."""
    text = os.fspath(model)
    if is_model_name(text) or _is_checkpoint_dir(text):
        return vision_rules(text, video_sampling)
    return vision_rules(family_for_model(text), video_sampling)


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
