"""The Qwen-VL encoders' part of the planner's `ModelFacts` (`dhp_jax.data.model_configs`)."""

from __future__ import annotations

from typing import Any, Mapping

# The encoders' attention span when it is the image's own patch count (Qwen's encoders attend over
# a whole image or frame): an assumed typical image of 1024 patches (512x512 px at 16 px, 448x448
# px at 14 px).
ASSUMED_FRAME_PATCHES = 1024


def qwen_vision_facts(raw: Mapping[str, Any], d: int, where: str, block) -> dict[str, Any]:
    """The vision fields of `ModelFacts` of a resolved Qwen-VL config (LLM width `d`); `block(v, vh,
    vi, patch, channels, temporal)` -> the family's (mlp, window, window_layers, deepstack, layer
    params, embedding params, merger norm params)."""
    v = raw["vision_config"]
    vh, vi, vn = int(v["hidden_size"]), int(v["intermediate_size"]), int(v["num_heads"])
    depth, patch = int(v["depth"]), int(v["patch_size"])
    channels, temporal, merge = int(v["in_channels"]), int(v["temporal_patch_size"]), int(v["spatial_merge_size"])
    out = int(v["out_hidden_size"])
    if out != d:
        raise ValueError(f"{where}: vision_config.out_hidden_size {out} is not the LLM's hidden_size {d}")
    wide = vh * merge * merge
    qkv = 3 * vh * vh + 3 * vh + vh * vh + vh
    mlp, window, window_layers, deepstack, layer, embed, merger_norm = block(v, vh, vi, patch, channels, temporal, qkv)
    merger = wide * wide + wide + wide * d + d
    projector = merger + merger_norm + deepstack * (merger + 2 * wide)   # DeepStack mergers: LayerNorm(4v)
    rule = {(14, 2): "qwen-vl", (16, 2): "qwen3-vl"}.get((patch, merge), f"{raw['model_type']}-{patch}")
    return dict(vh=vh, vi=vi, vn=vn, depth=depth, patch=patch, channels=channels, temporal=temporal, merge=merge,
                mlp=mlp, frame=ASSUMED_FRAME_PATCHES, window=window, window_layers=window_layers,
                deepstack=deepstack, proj_hidden=wide, vision=embed + depth * layer, projector=projector, rule=rule)
