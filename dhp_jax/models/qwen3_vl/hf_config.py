"""Qwen3-VL, model side without jax (both engines read it): its `HFConfig` (`parse`), legacy
weight names, conv shapes, the position table's interpolation taps and the host-side arrays of
one processor output (`prepare`)."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import numpy as np

from dhp_jax.data import hf_config
from dhp_jax.model.hf.config import HFConfig
from dhp_jax.models.qwen_common import hf_vision as qv

MODEL_TYPES = ("qwen3_vl",)
LEGACY_RENAMES = qv.QWEN_RENAMES
# transformers' `save_pretrained` and the published releases keep the module names
# (`dhp_jax.model.hf.checkpoint.saved_weights`)
SAVED_RENAMES: tuple[tuple[str, str], ...] = ()
conv_shapes = qv.conv_shapes


@dataclasses.dataclass(frozen=True)
class Qwen3VLVision(qv.QwenVision):
    grid_side: int
    deepstack_blocks: tuple[int, ...]


def parse_qwen3_vl(raw: Mapping[str, Any], r: Mapping[str, Any] | None = None) -> HFConfig:
    """HFConfig of a Qwen3-VL config.json `raw` (resolved: `r`)."""
    r = hf_config.resolve(raw) if r is None else r
    v = r["vision_config"]
    vision = Qwen3VLVision(**qv.QwenVision.fields(v), grid_side=int(int(v["num_position_embeddings"]) ** 0.5),
                           deepstack_blocks=tuple(int(i) for i in v["deepstack_visual_indexes"]))
    return qv.qwen_config("qwen3_vl", raw, r, vision)


def interpolation_taps(grid_thw: np.ndarray, side: int, merge: int) -> tuple[np.ndarray, np.ndarray]:
    """(int32[N, 4] rows of `pos_embed`, float32[N, 4] weights): bilinear resampling with aligned
    corners of the side x side table to each frame's h x w patch grid, patches in the processor's
    order. Weights are computed in fp32 like transformers' (`src = i * (side - 1) / (n - 1)`)."""
    pos = qv.patch_positions(grid_thw, merge)
    sizes = np.repeat(grid_thw[:, 1:], grid_thw[:, 0] * grid_thw[:, 1] * grid_thw[:, 2], axis=0)

    def axis(index: np.ndarray, size: np.ndarray):
        src = index.astype(np.float32) * np.float32(side - 1) / np.maximum(size - 1, 1).astype(np.float32)
        floor = np.floor(src)
        taps = np.clip(floor.astype(np.int64)[:, None] + np.arange(2), 0, side - 1)
        weights = np.clip(np.float32(1) - np.abs(src[:, None] - floor[:, None] - np.arange(2, dtype=np.float32)),
                          0, None).astype(np.float32)
        return taps, weights

    ht, hw = axis(pos[:, 0], sizes[:, 0])
    wt, ww = axis(pos[:, 1], sizes[:, 1])
    taps = (ht[:, :, None] * side + wt[:, None, :]).reshape(-1, 4)
    weights = (hw[:, :, None] * ww[:, None, :]).reshape(-1, 4)
    return taps.astype(np.int32), weights.astype(np.float32)


VisionConfig = Qwen3VLVision
parse = parse_qwen3_vl


def prepare(cfg: HFConfig, inputs: Mapping[str, Any]) -> dict[str, Any]:
    """Host-side arrays of one sample (as Qwen2.5-VL's), with the position-table taps."""
    v = cfg.vision
    batch = qv.token_arrays(inputs, v.merge, None, split_video_frames=True)
    for kind, grid, arrays in qv.encoder_inputs(cfg, inputs, batch["input_ids"]):
        taps, weights = interpolation_taps(grid, v.grid_side, v.merge)
        batch[kind] = {**arrays, "taps": taps, "tap_weights": weights}
    cfg.text.check_positions(batch["positions"])
    return batch


ROPE_AXES, patch_dim, unit = qv.ROPE_AXES, qv.patch_dim, qv.unit


def vision_rows(config: HFConfig, seg: Any, grid: Any, pixels: np.ndarray, ints: np.ndarray, floats: np.ndarray,
                col: Mapping[str, int], bases: dict, where: str) -> None:
    """The packed vision rows of one segment (`hf_vision.vision_rows`) with their position-table taps
    and weights."""
    v = config.vision

    def taps(g, ints, floats, col, bases):
        k, u = ints.shape[:2]
        t, wts = interpolation_taps(g, v.grid_side, v.merge)
        n, width = t.shape[1], floats.shape[2] - t.shape[1]
        ints[..., col["tap0"]:col["tap0"] + n] = t.reshape(k, u, n)
        floats[..., width:] = wts.reshape(k, u, n)

    qv.vision_rows(config, seg, grid, pixels, ints, floats, col, bases, where, taps)


def vision_runs(config: HFConfig, inputs: Mapping[str, Any], batch: Mapping[str, Any]):
    """Token kinds and vision runs of one processor output (`hf_vision.vision_runs`)."""
    return qv.vision_runs(config, inputs, batch, frame_runs=True, seconds_meta=False)


processor_pixels = qv.processor_pixels


def vision_weight_shapes(cfg: HFConfig, out: dict) -> None:
    """The encoder's and mergers' weights (`hf_vision.vision_weight_shapes`), into `out`."""
    qv.vision_weight_shapes(cfg, out, deepstack_layout=True)


VISION_TP_SPLIT, encoder_stack = qv.VISION_TP_SPLIT, qv.encoder_stack
