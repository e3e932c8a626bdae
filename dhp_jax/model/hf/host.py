"""The host-side arrays of one processor output, per family (NumPy only: the torch backend and the
data path build `Sample`s with them without jax): token ids, rotary positions, and per modality
the encoder's patches and per-patch ids. Each family's module (`dhp_jax.model.hf.<family>`) takes
its function from here as its `prepare`; `prepare(config, inputs)` picks the family's."""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from dhp_jax.model.hf import qwen_vision as qv
from dhp_jax.model.hf.config import HFConfig
from dhp_jax.model.hf.families import interpolation_taps
from dhp_jax.model.hf.inputs import as_numpy, sample_tokens, vision_scatter_index


def prepare(cfg: HFConfig, inputs: Mapping[str, Any]) -> dict[str, Any]:
    """The host-side arrays of one sample of `cfg`'s family."""
    return FAMILIES[cfg.family](cfg, inputs)


def qwen2_5_vl(cfg: HFConfig, inputs: Mapping[str, Any]) -> dict[str, Any]:
    """Host-side arrays of one sample: the per-token arrays of `qwen_vision.token_arrays` and, per
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


def qwen3_vl(cfg: HFConfig, inputs: Mapping[str, Any]) -> dict[str, Any]:
    """Host-side arrays of one sample (see `qwen2_5_vl`), with the position-table taps."""
    v = cfg.vision
    batch = qv.token_arrays(inputs, v.merge, None, split_video_frames=True)
    for kind, grid, arrays in qv.encoder_inputs(cfg, inputs, batch["input_ids"]):
        taps, weights = interpolation_taps(grid, v.grid_side, v.merge)
        batch[kind] = {**arrays, "taps": taps, "tap_weights": weights}
    cfg.text.check_positions(batch["positions"])
    return batch


def internvl(cfg: HFConfig, inputs: Mapping[str, Any]) -> dict[str, Any]:
    """Host-side arrays of one sample: `input_ids`, `keep`, `positions` [L, 1]; with an image, its
    tiles as flattened patches [tiles, (H/P)(W/P), C*P*P] and the placeholder offsets."""
    v = cfg.vision
    ids, keep = sample_tokens(inputs)
    ids = ids.astype(np.int32)
    batch: dict[str, Any] = {"input_ids": ids, "keep": keep,
                             "positions": np.arange(len(ids), dtype=np.int32)[:, None]}
    cfg.text.check_positions(batch["positions"])
    if inputs.get("pixel_values") is not None:
        px = as_numpy(inputs["pixel_values"])
        (ph, pw), (h, w) = v.patch_size, v.image_size
        if px.ndim != 4 or px.shape[1:] != (v.channels, h, w):
            raise ValueError(f"pixel_values: shape {px.shape}, expected [tiles, {v.channels}, {h}, {w}] (the "
                             f"config's image_size; other tile sizes would need the position table resampled)")
        n = px.shape[0]
        patches = px.reshape(n, v.channels, h // ph, ph, w // pw, pw).transpose(0, 2, 4, 1, 3, 5)
        batch["image"] = {
            "patches": patches.reshape(n, (h // ph) * (w // pw), v.channels * ph * pw),
            "scatter": vision_scatter_index(ids, cfg.token_ids["image"],
                                            n * (h // ph) * (w // pw) // v.shuffle ** 2, "pixel_values"),
        }
    return batch


FAMILIES = {"qwen2_5_vl": qwen2_5_vl, "qwen3_vl": qwen3_vl, "internvl": internvl}
