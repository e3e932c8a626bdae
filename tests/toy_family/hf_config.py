"""`toy_vl`'s model side without jax: Qwen2.5-VL's, its `HFConfig` named for the toy family."""

from __future__ import annotations

import dataclasses

from dhp_jax.data import hf_config
from dhp_jax.models.qwen2_5_vl.hf_config import (ROPE_AXES, VISION_TP_SPLIT, conv_shapes, encoder_stack,  # noqa: F401
                                                  patch_dim, prepare, processor_pixels, unit, vision_rows,
                                                  vision_runs, vision_weight_shapes)
from dhp_jax.models.qwen2_5_vl.hf_config import LEGACY_RENAMES, parse as _parse  # noqa: F401

MODEL_TYPES = ("toy_vl",)


def parse(raw, r=None):
    r = hf_config.resolve(raw) if r is None else r
    return dataclasses.replace(_parse(raw, r), family="toy_vl")
