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
# the names transformers' `save_pretrained` writes (its conversion mapping reversed) and the
# published releases hold: the encoder as `visual.*`, the LLM as `model.*`, `lm_head` as is
# (`dhp_jax.model.hf.checkpoint.saved_weights`, both engines' savers)
SAVED_RENAMES = ((r"^model\.visual\.", "visual."), (r"^model\.language_model\.", "model."))
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


def vision_weight_shapes(cfg: HFConfig, out: dict) -> None:
    """The encoder's and mergers' weights (`hf_vision.vision_weight_shapes`), into `out`."""
    qv.vision_weight_shapes(cfg, out, deepstack_layout=False)


VISION_TP_SPLIT, encoder_stack = qv.VISION_TP_SPLIT, qv.encoder_stack
