"""Qwen2.5-VL, model side without jax (both engines read it): its `HFConfig` (`parse`), legacy
weight names, conv shapes and the host-side arrays of one processor output (`prepare`)."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import numpy as np

from dhp_jax.data import hf_config
from dhp_jax.model.hf.config import HFConfig
from dhp_jax.models.qwen_common import hf_vision as qv

MODEL_TYPES = ("qwen2_5_vl",)
LEGACY_RENAMES = qv.QWEN_RENAMES
conv_shapes = qv.conv_shapes


@dataclasses.dataclass(frozen=True)
class Qwen2_5_VLVision(qv.QwenVision):
    window_size: int
    full_attention_blocks: tuple[int, ...]
    tokens_per_second: float


def parse_qwen2_5_vl(raw: Mapping[str, Any], r: Mapping[str, Any] | None = None) -> HFConfig:
    """HFConfig of a Qwen2.5-VL config.json `raw` (resolved: `r`; nested or flat)."""
    r = hf_config.resolve(raw) if r is None else r
    v = r["vision_config"]
    vision = Qwen2_5_VLVision(**qv.QwenVision.fields(v), window_size=int(v["window_size"]),
                              full_attention_blocks=tuple(int(i) for i in v["fullatt_block_indexes"]),
                              tokens_per_second=float(v["tokens_per_second"]))
    return qv.qwen_config("qwen2_5_vl", raw, r, vision)


VisionConfig = Qwen2_5_VLVision
parse = parse_qwen2_5_vl


def prepare(cfg: HFConfig, inputs: Mapping[str, Any]) -> dict[str, Any]:
    """Host-side arrays of one sample: the per-token arrays of `hf_vision.token_arrays` and, per
    modality present, the encoder's patches and per-patch ids."""
    v = cfg.vision
    video_grid = qv.grids(inputs, "video_grid_thw")
    seconds = inputs.get("second_per_grid_ts")
    intervals = None
    if len(video_grid):
        s = np.ones(len(video_grid), np.float32) if seconds is None else qv.as_numpy(seconds).reshape(-1)
        intervals = np.float32(v.tokens_per_second) * s.astype(np.float32)
    batch = qv.token_arrays(inputs, v.merge, intervals, split_video_frames=False)
    for kind, grid, arrays in qv.encoder_inputs(cfg, inputs, batch["input_ids"]):
        batch[kind] = {**arrays, "windows": qv.window_segments(grid, v.merge, v.window_size, v.patch_size)}
    cfg.text.check_positions(batch["positions"])
    return batch


ROPE_AXES, patch_dim, unit = qv.ROPE_AXES, qv.patch_dim, qv.unit


def vision_rows(config: HFConfig, seg: Any, grid: Any, pixels: np.ndarray, ints: np.ndarray, floats: np.ndarray,
                col: Mapping[str, int], bases: dict, where: str) -> None:
    """The packed vision rows of one segment (`hf_vision.vision_rows`) with their window ids."""
    v = config.vision

    def windows(g, ints, floats, col, bases):
        k, u = ints.shape[:2]
        w = qv.window_segments(g, v.merge, v.window_size, v.patch_size)
        ints[..., col["window"]] = (w + bases["window"]).reshape(k, u)
        bases["window"] += int(w.max())

    qv.vision_rows(config, seg, grid, pixels, ints, floats, col, bases, where, windows)


def vision_runs(config: HFConfig, inputs: Mapping[str, Any], batch: Mapping[str, Any]):
    """Token kinds and vision runs of one processor output (`hf_vision.vision_runs`)."""
    return qv.vision_runs(config, inputs, batch, frame_runs=False, seconds_meta=True)


processor_pixels = qv.processor_pixels


# ----------------------------------------------------------------- random weights (`model.hf.init`)
def vision_weight_shapes(cfg: HFConfig, out: dict) -> None:
    """{name: (initialiser, shape)} of the encoder and merger weights, into `out`."""
    from dhp_jax.model.hf.init import _linear, _norm

    v, raw = cfg.vision, cfg.fields["vision_config"]
    h, inter, d_out = v.hidden_size, int(raw["intermediate_size"]), int(raw["out_hidden_size"])
    wide, pre = h * v.merge ** 2, "model.visual"
    out[f"{pre}.patch_embed.proj.weight"] = ("normal", (h, v.in_channels, v.temporal_patch_size, v.patch_size,
                                                        v.patch_size))
    for i in range(v.depth):
        p = f"{pre}.blocks.{i}"
        _norm(out, f"{p}.norm1", h, False)
        _norm(out, f"{p}.norm2", h, False)
        _linear(out, f"{p}.attn.qkv", 3 * h, h, True)
        _linear(out, f"{p}.attn.proj", h, h, True)
        _linear(out, f"{p}.mlp.gate_proj", inter, h, True)
        _linear(out, f"{p}.mlp.up_proj", inter, h, True)
        _linear(out, f"{p}.mlp.down_proj", h, inter, True)
    _norm(out, f"{pre}.merger.ln_q", h, False)
    _linear(out, f"{pre}.merger.mlp.0", wide, wide, True)
    _linear(out, f"{pre}.merger.mlp.2", d_out, wide, True)

VISION_TP_SPLIT, encoder_stack = qv.VISION_TP_SPLIT, qv.encoder_stack
