"""Qwen3-VL-MoE, model side without jax (both engines read it): Qwen3-VL's (`dhp_jax.models.
qwen3_vl.hf_config`) with its own `parse` and the experts' published layout.

Published checkpoints (Qwen3-VL-30B-A3B, -235B-A22B) store each sparse layer's experts fused,
transposed against transformers' modules: `mlp.experts.gate_up_proj` [E, d, 2 * I] and
`mlp.experts.down_proj` [E, I, d] (transformers' conversion mapping transposes dims 1 and 2 on
load where the stored shape is not its module's); the parameter tree holds transformers'
`state_dict()` shapes ([E, 2 * I, d], [E, d, I]; `dhp_jax.model.hf.moe`), and both engines save
the releases' layout (`dhp_jax.model.hf.expert_layouts.to_published`)."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from dhp_jax.data import hf_config
from dhp_jax.model.hf.config import HFConfig
from dhp_jax.models.qwen3_vl import hf_config as dense

MODEL_TYPES = ("qwen3_vl_moe",)
LEGACY_RENAMES, SAVED_RENAMES = dense.LEGACY_RENAMES, dense.SAVED_RENAMES
EXPERT_LAYOUT = "fused_transposed"      # `dhp_jax.model.hf.moe.EXPERT_LAYOUTS`
conv_shapes = dense.conv_shapes
Qwen3VLVision = VisionConfig = dense.Qwen3VLVision


def parse(raw: Mapping[str, Any], r: Mapping[str, Any] | None = None) -> HFConfig:
    """HFConfig of a Qwen3-VL-MoE config.json `raw` (resolved: `r`)."""
    return dataclasses.replace(dense.parse(raw, hf_config.resolve(raw) if r is None else r), family="qwen3_vl_moe")


interpolation_taps, prepare, ROPE_AXES, patch_dim, unit = (dense.interpolation_taps, dense.prepare, dense.ROPE_AXES,
                                                          dense.patch_dim, dense.unit)
vision_rows, vision_runs, processor_pixels = dense.vision_rows, dense.vision_runs, dense.processor_pixels
vision_weight_shapes, VISION_TP_SPLIT, encoder_stack = dense.vision_weight_shapes, dense.VISION_TP_SPLIT, dense.encoder_stack
