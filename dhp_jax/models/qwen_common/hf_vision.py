"""What Qwen2.5-VL and Qwen3-VL share: the host-side index arithmetic over `grid_thw` (patch
positions, attention segments, M-RoPE positions of the LLM tokens) and the patch embedding.

All of it is computed in numpy from the processor's outputs before the model runs, and all of it
is per token (per patch for the encoder, per LLM token for the decoder), so it can travel with its
tokens through any layout of a packed stream.

Patch order: the Qwen processors emit an image's patches block-major over spatial-merge blocks
(merge block row, merge block column, row in block, column in block), frame after frame; the
encoder's merger joins each `merge**2` consecutive patches into one LLM token.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Iterator, Mapping

import numpy as np

from dhp_jax.model.hf.config import HFConfig
from dhp_jax.model.hf.inputs import as_numpy, sample_tokens, vision_scatter_index
from dhp_jax.model.hf.spec import RopeSpec, TextConfig

# (modality, pixel key, grid key) of the processor outputs, in the order the model encodes them
VISION_EPS = 1e-6        # the vision norms' and mergers' eps: fixed in transformers, not configured
# the legacy checkpoint names both families' weights were saved under (transformers' own conversion mapping)
QWEN_RENAMES = ((r"^visual", "model.visual"),
                (r"^model(?!\.(language_model|visual))", "model.language_model"))
MODALITIES = (("image", "pixel_values", "image_grid_thw"), ("video", "pixel_values_videos", "video_grid_thw"))


@dataclasses.dataclass(frozen=True)
class QwenVision:
    """The vision-encoder fields both Qwen families have (a family's VisionConfig adds its own)."""

    depth: int
    hidden_size: int
    num_heads: int
    act: str
    in_channels: int
    temporal_patch_size: int
    patch_size: int
    merge: int
    rope: RopeSpec

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @staticmethod
    def fields(v: Mapping[str, Any]) -> dict[str, Any]:
        """The shared fields from a resolved `vision_config` (`dhp_jax.data.hf_config.resolve`)."""
        heads = int(v["num_heads"])
        return dict(depth=int(v["depth"]), hidden_size=int(v["hidden_size"]), num_heads=heads,
                    act=v["hidden_act"], in_channels=int(v["in_channels"]),
                    temporal_patch_size=int(v["temporal_patch_size"]), patch_size=int(v["patch_size"]),
                    merge=int(v["spatial_merge_size"]),
                    rope=RopeSpec.vision_2d(float(v["rope_theta"]), int(v["hidden_size"]) // heads))


def qwen_config(family: str, raw: Mapping[str, Any], r: Mapping[str, Any], vision: QwenVision) -> HFConfig:
    """HFConfig of a Qwen-VL config.json `raw` (resolved: `r`) once its vision config is parsed."""
    return HFConfig(family, raw, TextConfig.from_dict(r["text_config"]), vision, bool(r["tie_word_embeddings"]),
                    {"image": int(r["image_token_id"]), "video": int(r["video_token_id"])})


def conv_shapes(cfg: HFConfig) -> dict[str, tuple[int, ...]]:
    """The patch embedding's Conv3d weight shape (out, C, T, P, P)."""
    v = cfg.vision
    return {"model.visual.patch_embed.proj.weight":
            (v.hidden_size, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size)}


def encoder_inputs(cfg: HFConfig, inputs: Mapping[str, Any], input_ids: np.ndarray
                   ) -> Iterator[tuple[str, np.ndarray, dict[str, np.ndarray]]]:
    """(modality, grid_thw, arrays) for each modality present: its flattened `pixels`, per-patch
    `patch_positions` (row, column) and `frames`, and `scatter` (the placeholder offsets)."""
    v = cfg.vision
    for kind, pixel_key, grid_key in MODALITIES:
        if inputs.get(pixel_key) is None:
            continue
        grid = grids(inputs, grid_key)
        frames = frame_segments(grid)
        yield kind, grid, {
            "pixels": patch_rows(inputs[pixel_key], grid, v.patch_dim, pixel_key),
            "patch_positions": patch_positions(grid, v.merge), "frames": frames,
            "scatter": vision_scatter_index(input_ids, cfg.token_ids[kind], len(frames) // v.merge ** 2, pixel_key),
        }


def grids(inputs: Mapping[str, Any], key: str) -> np.ndarray:
    """int64[n, 3] (t, h, w) patch grids of `key` (empty when absent)."""
    g = inputs.get(key)
    return np.zeros((0, 3), np.int64) if g is None else as_numpy(g).astype(np.int64).reshape(-1, 3)


def patch_positions(grid_thw: np.ndarray, merge: int) -> np.ndarray:
    """int32[N, 2]: (row, column) of every patch in its frame, in the processor's patch order."""
    out = []
    for t, h, w in grid_thw.tolist():
        rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        shape = (h // merge, merge, w // merge, merge)
        rows = rows.reshape(shape).transpose(0, 2, 1, 3).reshape(-1)
        cols = cols.reshape(shape).transpose(0, 2, 1, 3).reshape(-1)
        out.append(np.tile(np.stack([rows, cols], axis=-1), (t, 1)))
    return np.concatenate(out).astype(np.int32) if out else np.zeros((0, 2), np.int32)


def frame_segments(grid_thw: np.ndarray) -> np.ndarray:
    """int32[N]: 1-based frame index of every patch (the encoder attends within a frame)."""
    sizes = np.repeat(grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0])
    return np.repeat(np.arange(1, len(sizes) + 1), sizes).astype(np.int32)


def window_segments(grid_thw: np.ndarray, merge: int, window_size: int, patch_size: int) -> np.ndarray:
    """int32[N]: 1-based window index of every patch (Qwen2.5-VL's window attention): the merged
    tokens of a frame are tiled by square windows of `window_size // merge // patch_size` merged
    tokens a side; a window never spans two frames. As a mask over the patches in their own order
    this is transformers' window attention without its reordering of the tokens."""
    side = window_size // merge // patch_size
    if side < 1:
        raise ValueError(f"vision window_size {window_size} is smaller than one merged token "
                         f"({merge} x {patch_size} px)")
    out, base = [], 0
    for t, h, w in grid_thw.tolist():
        lh, lw = h // merge, w // merge
        nwh, nww = -(-lh // side), -(-lw // side)
        frame = np.arange(t)[:, None, None]
        win = (np.arange(lh) // side)[None, :, None] * nww + (np.arange(lw) // side)[None, None, :]
        ids = base + frame * (nwh * nww) + win                       # [t, lh, lw], one per merged token
        out.append(np.repeat(ids.reshape(-1), merge * merge))
        base += t * nwh * nww
    return (np.concatenate(out) + 1).astype(np.int32) if out else np.zeros(0, np.int32)


def patch_rows(pixels: Any, grid_thw: np.ndarray, patch_dim: int, what: str) -> np.ndarray:
    """float32[N, patch_dim] flattened patches, checked against the grids."""
    x = as_numpy(pixels)
    n = int(np.sum(np.prod(grid_thw, axis=1)))
    if x.ndim != 2 or x.shape != (n, patch_dim):
        raise ValueError(f"{what}: shape {x.shape}, but its grid_thw {grid_thw.tolist()} needs ({n}, {patch_dim})")
    return x


def mrope_positions(input_ids: np.ndarray, token_types: np.ndarray | None, keep: np.ndarray,
                    image_grid: np.ndarray, video_grid: np.ndarray, merge: int,
                    video_intervals: np.ndarray | None) -> np.ndarray:
    """int64[L, 3] (t, h, w) rotary positions of the LLM tokens of one sample.

    Text tokens count on from where the previous span ended, on all three axes. A vision span
    (a run of tokens of one type in `token_types`: 1 image, 2 video) takes the next grid of its
    kind: t = start + frame * interval (interval 1 for images, `video_intervals[i]` for video i,
    truncated to an integer), h = start + row, w = start + column over the merged grid; the text
    after it resumes at start + max(h, w) // merge. Tokens `keep` drops (padding) get 0. Without
    any grid every axis is the plain offset 0..L-1."""
    n = input_ids.shape[0]
    if len(image_grid) == 0 and len(video_grid) == 0:
        return np.repeat(np.arange(n, dtype=np.int64)[:, None], 3, axis=1)
    if token_types is None:
        raise ValueError("inputs have image/video grids but no mm_token_type_ids; the M-RoPE positions "
                         "depend on them (the processor returns them with input_ids)")
    kept = np.nonzero(keep)[0]
    types = token_types[kept].tolist()
    queues = {1: list(image_grid), 2: list(video_grid)}
    intervals = {1: [1.0] * len(image_grid), 2: list(video_intervals if video_intervals is not None
                                                       else [1.0] * len(video_grid))}
    pos, chunks, start = 0, [], 0
    for kind, run in itertools.groupby(types):
        length = len(list(run))
        if kind == 0:
            chunks.append(np.repeat((pos + np.arange(length))[:, None], 3, axis=1))
        else:
            if kind not in queues or not queues[kind]:
                raise ValueError(f"token {start}: a run of mm_token_type {kind} with no {('image', 'video')[kind - 1]} "
                                 f"grid left for it")
            t, h, w = (int(v) for v in queues[kind].pop(0))
            interval = np.float32(intervals[kind].pop(0))
            lh, lw = h // merge, w // merge
            if t * lh * lw != length:
                raise ValueError(f"token {start}: a run of {length} {('image', 'video')[kind - 1]} tokens, but its "
                                 f"grid (t, h, w) = {(t, h, w)} makes {t * lh * lw}")
            tt = (np.arange(t, dtype=np.float32) * interval).astype(np.int64)
            tt, hh, ww = np.meshgrid(tt, np.arange(lh), np.arange(lw), indexing="ij")
            chunks.append(np.stack([tt.reshape(-1), hh.reshape(-1), ww.reshape(-1)], axis=1) + pos)
            pos += max(h, w) // merge
            start += length
            continue
        pos += length
        start += length
    out = np.zeros((n, 3), np.int64)
    out[kept] = np.concatenate(chunks)
    return out


def token_arrays(inputs: Mapping[str, Any], merge: int, video_intervals: np.ndarray | None,
                 split_video_frames: bool) -> dict[str, np.ndarray]:
    """Per-token arrays of one sample (batch size 1): `input_ids` int32[L], `keep` bool[L] (the
    attention mask), `positions` int32[L, 3] (M-RoPE). Qwen3-VL puts a timestamp between video
    frames, so each frame is its own span (`split_video_frames`)."""
    ids, keep = sample_tokens(inputs)
    types = inputs.get("mm_token_type_ids")
    types = None if types is None else as_numpy(types).reshape(-1).astype(np.int64)
    image_grid, video_grid = grids(inputs, "image_grid_thw"), grids(inputs, "video_grid_thw")
    if split_video_frames and len(video_grid):
        video_grid = np.repeat(video_grid, video_grid[:, 0], axis=0)
        video_grid[:, 0] = 1
    positions = mrope_positions(ids, types, keep, image_grid, video_grid, merge, video_intervals)
    return {"input_ids": ids.astype(np.int32), "keep": keep, "positions": positions.astype(np.int32)}


# ----------------------------------------------------------------- the packed streams (`model.hf.packed`)
ROPE_AXES = 3        # M-RoPE: (t, h, w)


def patch_dim(config: HFConfig) -> int:
    return config.vision.patch_dim


def unit(config: HFConfig) -> int:
    """Vision rows per LLM slot: the merge**2 patches the merger joins."""
    return config.vision.merge ** 2


def vision_rows(config: HFConfig, seg: Any, grid: Any, pixels: np.ndarray, ints: np.ndarray, floats: np.ndarray,
                col: Mapping[str, int], bases: dict, where: str, extra: Any) -> None:
    """Fill one vision segment's rows of the packed vision stream (`ints` [k, unit, ...], `floats`
    [k, unit, patch_dim + taps]): pixels, (row, column) in the frame, frame ids; then the
    family's own columns (`extra(g, ints, floats, col, bases)`: windows, position-table taps)."""
    k, u, width = ints.shape[0], ints.shape[1], patch_dim(config)
    t, h, w = (int(x) for x in grid)
    if pixels.shape != (k, u * width) or t * h * w != k * u:
        raise ValueError(f"{where}: {seg.modality} pixels {pixels.shape} do not make the grid {(t, h, w)} "
                         f"of {u}-patch tokens of width {width}")
    g = np.array([[t, h, w]], np.int64)
    floats[..., :width] = pixels.reshape(k, u, width)
    pos = patch_positions(g, config.vision.merge).reshape(k, u, 2)
    ints[..., col["row"]], ints[..., col["col"]] = pos[..., 0], pos[..., 1]
    ints[..., col["frame"]] = (frame_segments(g) + bases["frame"]).reshape(k, u)
    bases["frame"] += t
    extra(g, ints, floats, col, bases)


# ----------------------------------------------------------------- samples (`model.hf.sample`)
def vision_runs(config: HFConfig, inputs: Mapping[str, Any], batch: Mapping[str, Any], *, frame_runs: bool,
                seconds_meta: bool) -> tuple[np.ndarray, dict[str, list]]:
    """(each token's kind: `mm_token_type_ids`, per modality the (pixels [tokens, merge**2 *
    patch_dim], tokens per frame, meta) of each run in order). `frame_runs`: a video is one run per
    frame (Qwen3-VL); `seconds_meta`: a video run carries its `second_per_grid_ts` (Qwen2.5-VL)."""
    ids = batch["input_ids"]
    kinds = as_numpy(inputs["mm_token_type_ids"]).reshape(-1) if inputs.get("mm_token_type_ids") is not None \
        else np.zeros_like(ids)
    v = config.vision
    unit = v.merge ** 2
    out: dict[str, list] = {"image": [], "video": []}
    seconds = inputs.get("second_per_grid_ts")
    seconds = None if seconds is None else as_numpy(seconds).reshape(-1)
    for modality, pixel_key, grid_key in MODALITIES:
        if inputs.get(pixel_key) is None:
            continue
        rows = as_numpy(inputs[pixel_key]).astype(np.float32)
        at = 0
        for i, (t, h, w) in enumerate(grids(inputs, grid_key).tolist()):
            per_frame = h * w
            pieces = [(1, rows[at + f * per_frame: at + (f + 1) * per_frame]) for f in range(t)] \
                if frame_runs and modality == "video" else [(t, rows[at: at + t * per_frame])]
            for frames, patch in pieces:
                extra: dict[str, Any] = {"grid_thw": (frames, h, w)}
                if seconds_meta and modality == "video":
                    extra["second_per_grid_ts"] = float(seconds[i]) if seconds is not None else 1.0
                out[modality].append((patch.reshape(-1, unit * patch.shape[1]), per_frame // unit, extra))
            at += t * per_frame
    return kinds, out


def processor_pixels(config: HFConfig, out: dict, kinds: np.ndarray, pixels: dict, grids_: dict,
                     seconds: list) -> None:
    """The processor's keys of a sample's vision runs, back from a `Sample` (`inputs_from_sample`)."""
    out["mm_token_type_ids"] = kinds[None]
    unit = config.vision.merge ** 2
    for modality, pixel_key, grid_key in MODALITIES:
        if pixels[modality]:
            rows = np.concatenate(pixels[modality])
            out[pixel_key] = rows.reshape(rows.shape[0] * unit, rows.shape[1] // unit)
            out[grid_key] = np.array(grids_[modality], np.int64)
    if seconds:
        out["second_per_grid_ts"] = np.array(seconds, np.float32)


# ----------------------------------------------------------------- tensor parallelism (`sharding.tensor`)
# The Qwen vision encoders' blocks (Qwen2.5-VL: gated MLP; Qwen3-VL: fc1 / fc2): the fused qkv by
# heads inside each of q, k and v ("qkv": 3 parts of H heads), proj by row, the MLP's first
# matrices (and biases) by column and its last by row; the row-split biases and the norms
# replicated.
VISION_TP_SPLIT = {"attn/qkv/kernel": (1, "qkv"), "attn/qkv/bias": (0, "qkv"), "attn/proj/kernel": (0, "heads"),
                   "mlp/gate_proj/kernel": (1, "mlp"), "mlp/gate_proj/bias": (0, "mlp"),
                   "mlp/up_proj/kernel": (1, "mlp"), "mlp/up_proj/bias": (0, "mlp"),
                   "mlp/down_proj/kernel": (0, "mlp"),
                   "mlp/linear_fc1/kernel": (1, "mlp"), "mlp/linear_fc1/bias": (0, "mlp"),
                   "mlp/linear_fc2/kernel": (0, "mlp")}


def encoder_stack(config: HFConfig) -> tuple[tuple[str, ...], int]:
    """(params path, block count) of the encoder's scanned blocks."""
    return ("model", "visual", "blocks"), config.vision.depth


# ----------------------------------------------------------------- random weights (`model.hf.init`)
def vision_weight_shapes(cfg: HFConfig, out: dict, *, deepstack_layout: bool) -> None:
    """{name: (initialiser, shape)} of the encoder's and mergers' weights, into `out`.
    `deepstack_layout` (Qwen3-VL): a conv bias and a learned position table, LayerNorms with
    biases, an fc1 / fc2 MLP, LayerNorm mergers and one per DeepStack level; else (Qwen2.5-VL)
    RMSNorms, a gated MLP and the `ln_q` merger."""
    from dhp_jax.model.hf.init import _linear, _norm

    v, raw = cfg.vision, cfg.fields["vision_config"]
    h, inter, d_out = v.hidden_size, int(raw["intermediate_size"]), int(raw["out_hidden_size"])
    wide, pre = h * v.merge ** 2, "model.visual"
    out[f"{pre}.patch_embed.proj.weight"] = ("normal", (h, v.in_channels, v.temporal_patch_size, v.patch_size,
                                                        v.patch_size))
    if deepstack_layout:
        out[f"{pre}.patch_embed.proj.bias"] = ("zeros", (h,))
        out[f"{pre}.pos_embed.weight"] = ("normal", (v.grid_side ** 2, h))
    mlp = (("linear_fc1", inter, h), ("linear_fc2", h, inter)) if deepstack_layout else \
        (("gate_proj", inter, h), ("up_proj", inter, h), ("down_proj", h, inter))
    for i in range(v.depth):
        p = f"{pre}.blocks.{i}"
        _norm(out, f"{p}.norm1", h, deepstack_layout)
        _norm(out, f"{p}.norm2", h, deepstack_layout)
        _linear(out, f"{p}.attn.qkv", 3 * h, h, True)
        _linear(out, f"{p}.attn.proj", h, h, True)
        for name, n_out, n_in in mlp:
            _linear(out, f"{p}.mlp.{name}", n_out, n_in, True)
    if deepstack_layout:
        mergers = [("merger", h)] + [(f"deepstack_merger_list.{k}", wide) for k in range(len(v.deepstack_blocks))]
        for name, norm_width in mergers:
            _norm(out, f"{pre}.{name}.norm", norm_width, True)
            _linear(out, f"{pre}.{name}.linear_fc1", wide, wide, True)
            _linear(out, f"{pre}.{name}.linear_fc2", d_out, wide, True)
    else:
        _norm(out, f"{pre}.merger.ln_q", h, False)
        _linear(out, f"{pre}.merger.mlp.0", wide, wide, True)
        _linear(out, f"{pre}.merger.mlp.2", d_out, wide, True)
