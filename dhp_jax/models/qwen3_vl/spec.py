"""Qwen3-VL's `FamilySpec`: its config classes (transformers' `Qwen3VLConfig`, text
`Qwen3VLTextConfig` with QK-norm and interleaved M-RoPE, vision `Qwen3VLVisionConfig` with a
learned position table and DeepStack mergers); the Qwen2-VL image processor at 16-px patches and
the Qwen3-VL video processor (`fps` = 2 sampling by `linspace(0, n-1, k).round()`, 4..768 frames, a
pixel budget over all sampled frames, one `<t seconds>` timestamp per temporal patch)."""

from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

from dhp_jax.models import ConfigRules, ExampleFiles, FamilySpec, MemoryTerms, register
from dhp_jax.models.qwen_common.chat import QwenChat
from dhp_jax.models.qwen_common.demo import QwenDemo
from dhp_jax.models.qwen_common.example import SPECIALS, TOKEN_NAMES, TOKENIZER
from dhp_jax.models.qwen_common.facts import qwen_vision_facts
from dhp_jax.models.qwen_common.memory import qwen_encoder_saved, qwen_tail
from dhp_jax.models.qwen_common.processor import MAX_ASPECT_RATIO, QwenPatches
from dhp_jax.models.qwen_common.tiny import qwen_tiny

NAME = "qwen3_vl"
TEXT, VISION = "qwen3_vl_text", "qwen3_vl_vision"
HALF = (0.5, 0.5, 0.5)

FIELDS = {
    TEXT: dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=32, head_dim=128, hidden_act="silu",
               rms_norm_eps=1e-6, max_position_embeddings=128000, attention_bias=False,
               rope_theta=500000.0, mrope_section=[24, 20, 20]),
    VISION: dict(depth=27, hidden_size=1152, hidden_act="gelu_pytorch_tanh", intermediate_size=4304,
                 num_heads=16, in_channels=3, patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                 out_hidden_size=3584, num_position_embeddings=2304, deepstack_visual_indexes=[8, 16, 24],
                 rope_theta=10000.0),
    NAME: dict(image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
               vision_end_token_id=151653, tie_word_embeddings=False),
}
CONFIG = ConfigRules(FIELDS, (TEXT,), VISION, {NAME: VISION},
                     text_kinds={TEXT: (False, True, "mrope_interleaved")})   # QK-norm, interleaved M-RoPE


def _block(v, vh, vi, patch, channels, temporal, qkv):
    deepstack = len(v["deepstack_visual_indexes"])
    layer = qkv + 2 * vh * vi + vi + vh + 4 * vh            # GELU MLP with biases, two LayerNorms
    embed = channels * temporal * patch * patch * vh + vh + int(v["num_position_embeddings"]) * vh
    return 2, 0, 0, deepstack, layer, embed, 2 * vh


def facts(raw: Mapping[str, Any], d: int, where: str) -> dict[str, Any]:
    return qwen_vision_facts(raw, d, where, _block)


def smart_resize_video(num_frames: int, height: int, width: int, temporal_factor: int, factor: int,
                       min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen3-VL's video resize rule: the pixel bounds hold for all sampled frames together."""
    if num_frames < temporal_factor:
        raise ValueError(f"{num_frames} sampled frames: Qwen3-VL needs at least {temporal_factor}")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(f"aspect ratio {max(height, width) / min(height, width):.0f} is above {MAX_ASPECT_RATIO}")
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    t = round(num_frames / temporal_factor) * temporal_factor
    if t * h * w > max_pixels:
        beta = math.sqrt(num_frames * height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif t * h * w < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def qwen3_timestamps(indices: np.ndarray, fps: float, temporal_patch: int) -> list[float]:
    """Seconds of each temporal patch: the mean time of its first and last frame."""
    idx = [int(i) for i in indices]
    if len(idx) % temporal_patch:
        idx += [idx[-1]] * (temporal_patch - len(idx) % temporal_patch)
    t = [i / fps for i in idx]
    return [(t[i] + t[i + temporal_patch - 1]) / 2 for i in range(0, len(t), temporal_patch)]


class Processor(QwenPatches):
    video_defaults = {"size": {"shortest_edge": 128 * 32 * 32, "longest_edge": 32 * 32 * 768}, "patch_size": 16,
                      "temporal_patch_size": 2, "merge_size": 2, "image_mean": HALF, "image_std": HALF,
                      "min_frames": 4, "max_frames": 768, "do_sample_frames": True, "fps": 2, "num_frames": None,
                      "cap_pixels_per_frame": False, "max_video_tokens": 768}
    auto_sampling = {"fps": 2.0}

    def frame_indices(self, p, info, fps, num) -> np.ndarray:
        c, total = p.video, info.total_frames
        if num is None and fps is not None:
            num = int(total / info.fps * fps)
            num = min(max(num, c["min_frames"]), c["max_frames"], total)
        if num is None:
            num = min(max(total, c["min_frames"]), c["max_frames"])
        return np.linspace(0, total - 1, num).round().astype(np.int64)

    def video_size(self, p, info, n, f, lo, hi):
        c = p.video
        if c.get("cap_pixels_per_frame"):
            per = max(min(c["max_video_tokens"] * f * f, hi // n), int(lo * 1.05))
            hi = per * n
        return smart_resize_video(n, info.height, info.width, c["temporal_patch_size"], f, lo, hi)

    def video_extras(self, p, idx, info, tp):
        return {"timestamps": tuple(qwen3_timestamps(idx, info.fps, tp))}


class Chat(QwenChat):
    def video_expansion(self, ct, plan, image_seq_length: int, merge: int) -> str:
        """One `<t seconds>` + start + the frame's pad tokens + end run per temporal patch."""
        per = plan.grid[1] * plan.grid[2] // (merge * merge)
        n = ct.names
        return "".join(f"<{plan.timestamps[t]:.1f} seconds>{n['vision_start_token']}"
                       f"{ct.video_placeholder * per}{n['vision_end_token']}" for t in range(plan.grid[0]))


TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] == 'video' %}"
    "<|vision_start|><|video_pad|><|vision_end|>{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

EXAMPLE = ExampleFiles(
    "Qwen3VLProcessor", TEMPLATE,
    {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": 16, "temporal_patch_size": 2,
     "merge_size": 2, "size": {"shortest_edge": 64 * 64, "longest_edge": 32 * 32 * 256},
     "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "resample": 3,
     "rescale_factor": 1 / 255},
    {"video_processor_type": "Qwen3VLVideoProcessor", "patch_size": 16, "temporal_patch_size": 2,
     "merge_size": 2, "size": {"shortest_edge": 8 * 32 * 32, "longest_edge": 256 * 32 * 32},
     "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "do_sample_frames": True, "fps": 2,
     "min_frames": 4, "max_frames": 64, "resample": 3}, {}, SPECIALS, TOKENIZER, TOKEN_NAMES)

# the encoder block's backward-pass cotangents (tanh GELU), fitted as Qwen2.5-VL's
MEMORY = MemoryTerms(encoder_cotangents=(3, 2), cls_rows=0, position_axes=3, llm_qk_norm=True,
                     encoder_saved=qwen_encoder_saved, tail=qwen_tail)


def tiny_config(token_ids: Mapping[str, int], vocab_size: int, text: dict) -> dict[str, Any]:
    """16-px patches, temporal 2, merge 2 (the example's processor files), one DeepStack level."""
    return qwen_tiny(NAME, "Qwen3VLForConditionalGeneration", text,
                     {"model_type": TEXT, "attention_bias": False,
                      "rope_parameters": {"rope_type": "default", "rope_theta": 5000.0,
                                          "mrope_section": [2, 3, 3], "mrope_interleaved": True}},
                     {"patch_size": 16, "num_position_embeddings": 64, "deepstack_visual_indexes": [0],
                      "hidden_act": "gelu_pytorch_tanh"}, token_ids)


class Demo(QwenDemo):
    per_frame_runs = True       # each frame its own <|vision_start|> ... <|vision_end|> run


# the dense releases' names (Qwen3-VL-2B, -4B, -8B, -32B); none begins a Qwen3-VL-MoE name
# ("qwen3-vl-30b-a3b", "qwen3-vl-235b-a22b": `dhp_jax.models.qwen3_vl_moe.spec`)
NAME_PREFIXES = ("qwen3-vl-2b", "qwen3-vl-4b", "qwen3-vl-8b", "qwen3-vl-32b")

SPEC = register(FamilySpec(
    name=NAME, model_types=(NAME,), name_prefixes=NAME_PREFIXES,
    config=CONFIG, facts=facts, processor=Processor(),
    processor_names=("qwen3_vl", "qwen3vl"), chat=Chat(), example=EXAMPLE, vision_rule="qwen3-vl",
    published_model="qwen3-vl-8b", memory=MEMORY, tiny_config=tiny_config, demo=Demo(),
    hf_module="dhp_jax.models.qwen3_vl.hf_config", jax_module="dhp_jax.models.qwen3_vl.jax_model",
    torch_module="dhp_jax.models.qwen3_vl.torch_model"))
