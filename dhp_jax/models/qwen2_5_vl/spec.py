"""Qwen2.5-VL's `FamilySpec`: its config classes (transformers' `Qwen2_5_VLConfig`, text
`Qwen2_5_VLTextConfig`, vision `Qwen2_5_VLVisionConfig`), read nested or flat (the Qwen2-VL /
Qwen2.5-VL releases' layout); the Qwen2-VL image and video processors (all frames unless the
config or the run samples, `fps` or `num_frames` rounded down to the temporal patch;
`second_per_grid_ts` = 2 / sampled fps); its encoder (window attention with full-attention blocks,
SwiGLU, RMSNorm)."""

from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

from dhp_jax.data.processors import CLIP_MEAN, CLIP_STD, _torch_float_arange_int
from dhp_jax.models import ConfigRules, ExampleFiles, FamilySpec, MemoryTerms, register
from dhp_jax.models.qwen_common.chat import QwenChat
from dhp_jax.models.qwen_common.demo import QwenDemo
from dhp_jax.models.qwen_common.example import CLIP_MEAN_LIST, CLIP_STD_LIST, SPECIALS, TOKEN_NAMES, TOKENIZER
from dhp_jax.models.qwen_common.facts import qwen_vision_facts
from dhp_jax.models.qwen_common.memory import qwen_encoder_saved, qwen_tail
from dhp_jax.models.qwen_common.processor import QwenPatches, smart_resize
from dhp_jax.models.qwen_common.tiny import qwen_tiny

NAME = "qwen2_5_vl"
TEXT, VISION = "qwen2_5_vl_text", "qwen2_5_vl_vision"

# {config model_type: {field: transformers 5 default}}
FIELDS = {
    TEXT: dict(vocab_size=152064, hidden_size=8192, intermediate_size=29568, num_hidden_layers=80,
               num_attention_heads=64, num_key_value_heads=8, head_dim="=hidden_size//num_attention_heads",
               hidden_act="silu", rms_norm_eps=1e-5, max_position_embeddings=32768,
               use_sliding_window=False, rope_theta=1000000.0, mrope_section=[16, 24, 24]),
    VISION: dict(depth=32, hidden_size=3584, hidden_act="silu", intermediate_size=3420, num_heads=16,
                 in_channels=3, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                 tokens_per_second=4, window_size=112, out_hidden_size=3584,
                 fullatt_block_indexes=[7, 15, 23, 31], rope_theta=10000.0),
    NAME: dict(image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
               vision_end_token_id=151653, tie_word_embeddings=False),
}
# what Qwen2_5_VLConfig moves into text_config when a flat file has none
_TEXT_KEYS = ("rope_parameters", "rope_scaling", "rope_theta", "max_window_layers", "sliding_window", "layer_types",
              "attention_dropout", "initializer_range", "use_cache", "bos_token_id", "eos_token_id", "pad_token_id")


def _flat(config: Mapping[str, Any]) -> bool:
    return not isinstance(config.get("text_config"), Mapping)


def nest(config: dict) -> dict:
    """A flat config moved into the nested layout, as Qwen2_5_VLConfig does when it has no
    text_config: the text model's fields (and the rotary ones) go to text_config."""
    if not _flat(config):
        return config
    out = dict(config)
    keys = set(FIELDS[TEXT]) | set(_TEXT_KEYS)
    out["text_config"] = {k: out.pop(k) for k in sorted(keys) if k in out}
    out["text_config"]["model_type"] = TEXT
    return out


CONFIG = ConfigRules(FIELDS, (TEXT,), VISION, {NAME: VISION}, tie_text=True, nest=nest,
                     text_section=lambda config: "" if _flat(config) else "text_config.",
                     text_kinds={TEXT: (True, False, "mrope_sections")})      # Qwen2's q/k/v biases, M-RoPE


def _block(v, vh, vi, patch, channels, temporal, qkv):
    window_layers = int(v["depth"]) - len(v["fullatt_block_indexes"])
    window = (int(v["window_size"]) // patch) ** 2
    layer = qkv + 3 * vh * vi + 2 * vi + vh + 2 * vh        # SwiGLU with biases, two RMSNorms
    return 3, window, window_layers, 0, layer, channels * temporal * patch * patch * vh, vh  # Conv3d, RMSNorm


def facts(raw: Mapping[str, Any], d: int, where: str) -> dict[str, Any]:
    return qwen_vision_facts(raw, d, where, _block)


class Processor(QwenPatches):
    video_defaults = {"size": {"shortest_edge": 128 * 28 * 28, "longest_edge": 28 * 28 * 768}, "patch_size": 14,
                      "temporal_patch_size": 2, "merge_size": 2, "image_mean": CLIP_MEAN, "image_std": CLIP_STD,
                      "min_frames": 4, "max_frames": 768, "do_sample_frames": False, "fps": None,
                      "num_frames": None, "cap_pixels_per_frame": False, "max_video_tokens": 128000}
    # the Qwen2-VL video processor takes every frame by default: a run samples 2 frames/s with the
    # total-pixel cap (what its `cap_pixels_per_frame` documents as the reference implementation's,
    # qwen-vl-utils)
    auto_sampling = {"fps": 2.0, "cap_pixels_per_frame": True}

    def frame_indices(self, p, info, fps, num) -> np.ndarray:
        c, total = p.video, info.total_frames
        tp = c["temporal_patch_size"]
        if num is not None:
            num = round(num / tp) * tp
        elif fps is not None:
            top = math.floor(min(c["max_frames"], total) / tp) * tp
            n = min(max(total / info.fps * fps, c["min_frames"]), top, total)
            num = math.floor(n / tp) * tp
        if num is None:
            return np.arange(total, dtype=np.int64)
        if num > total or num <= 0:
            raise ValueError(f"cannot sample {num} frames from a video of {total}")
        return _torch_float_arange_int(0.0, total, total / num)

    def video_size(self, p, info, n, f, lo, hi):
        c = p.video
        if c.get("cap_pixels_per_frame"):
            total_px = int(c["max_video_tokens"] * f * f * 0.9)
            hi = max(min(hi, total_px * c["temporal_patch_size"] // n), int(lo * 1.05))
        return smart_resize(info.height, info.width, f, lo, hi)

    def video_extras(self, p, idx, info, tp):
        sampled_fps = len(idx) / info.total_frames * info.fps
        return {"second_per_grid_t": tp / sampled_fps}          # M-RoPE's time step

    def model_inputs(self, out, images, image_grids, videos, plans, order):
        super().model_inputs(out, images, image_grids, videos, plans, order)
        if videos:
            out["second_per_grid_ts"] = np.asarray([v.second_per_grid_t for v in plans], np.float32)


TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "<|im_end|>\n{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' or 'image' in "
    "content or 'image_url' in content %}{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}"
    "Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] "
    "== 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}"
    "Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in content %}"
    "{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "<|im_start|>assistant\n{% endif %}")

# the tiny example's processor files: the published values, with pixel bounds small enough that an
# image or a short clip is a few hundred tokens
EXAMPLE = ExampleFiles(
    "Qwen2_5_VLProcessor", TEMPLATE,
    {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": 14, "temporal_patch_size": 2,
     "merge_size": 2, "size": {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 256},
     "image_mean": CLIP_MEAN_LIST, "image_std": CLIP_STD_LIST, "resample": 3,
     "rescale_factor": 1 / 255, "do_resize": True, "do_rescale": True, "do_normalize": True,
     "do_convert_rgb": True},
    {"video_processor_type": "Qwen2VLVideoProcessor", "patch_size": 14, "temporal_patch_size": 2,
     "merge_size": 2, "size": {"shortest_edge": 4 * 28 * 28, "longest_edge": 64 * 28 * 28},
     "image_mean": CLIP_MEAN_LIST, "image_std": CLIP_STD_LIST, "do_sample_frames": True, "fps": 2.0,
     "min_frames": 4, "max_frames": 64, "resample": 3}, {}, SPECIALS, TOKENIZER, TOKEN_NAMES)

# the encoder block's backward-pass cotangents (SwiGLU, as the LLM's, over gate and up): fitted on
# `dhp bench memory --families` (`dhp_jax.planner.cost.memory`)
MEMORY = MemoryTerms(encoder_cotangents=(2, 0), cls_rows=0, position_axes=3, llm_qk_norm=False,
                     encoder_saved=qwen_encoder_saved, tail=qwen_tail)


def tiny_config(token_ids: Mapping[str, int], vocab_size: int, text: dict) -> dict[str, Any]:
    """14-px patches, temporal 2, merge 2 (the example's processor files), windows of 112 px."""
    return qwen_tiny(NAME, "Qwen2_5_VLForConditionalGeneration", text,
                     {"model_type": TEXT, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                              "mrope_section": [2, 3, 3]}},
                     {"patch_size": 14, "window_size": 112, "fullatt_block_indexes": [1], "tokens_per_second": 2,
                      "hidden_act": "silu"}, token_ids)


class Demo(QwenDemo):
    def shrink(self, raw: dict) -> None:
        super().shrink(raw)
        raw["vision_config"]["window_size"] = 32     # windows of 4 x 4 merged units, as 112 px at 14-px patches

    def finish(self, inputs, kinds, rows, grid) -> None:
        super().finish(inputs, kinds, rows, grid)
        if rows["video"]:
            inputs["second_per_grid_ts"] = np.ones(len(grid["video"]), np.float32)


# the names of Qwen2.5-VL's releases and of Qwen2-VL's (the same vision rule); none begins a Qwen3-VL
# name, so a Qwen3-VL model this table does not list is refused by name rather than given this rule
NAME_PREFIXES = ("qwen2.5-vl", "qwen2_5_vl", "qwen2-vl", "qwen2_vl")

SPEC = register(FamilySpec(
    name=NAME, model_types=(NAME,), name_prefixes=NAME_PREFIXES,
    config=CONFIG, facts=facts, processor=Processor(),
    processor_names=("qwen2_5_vl", "qwen2_vl", "qwen2vl", "qwen2_5vl"), chat=QwenChat(), example=EXAMPLE,
    vision_rule="qwen-vl", published_model="qwen2.5-vl-32b", memory=MEMORY, tiny_config=tiny_config, demo=Demo(),
    hf_module="dhp_jax.models.qwen2_5_vl.hf_config", jax_module="dhp_jax.models.qwen2_5_vl.jax_model",
    torch_module="dhp_jax.models.qwen2_5_vl.torch_model"))
