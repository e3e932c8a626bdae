"""The three families' config.json fields and host-side tables, in plain Python and NumPy (no jax):
parsed here once for both backends (`dhp_jax.model.hf` and the torch backend `npu_backend.hf`).

Per family: the model types it reads, its legacy checkpoint renames (as transformers' own
conversion mapping), its vision-encoder config and `parse`, and the index tables the packed
streams need (InternVL's pixel-shuffle groups, Qwen3-VL's position-table taps). The math of each
family lives in its own module (`internvl.py`, `qwen2_5_vl.py`, `qwen3_vl.py`; torch: `npu_backend.hf`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import numpy as np

from dhp_jax.model.hf import qwen_vision as qv
from dhp_jax.data import hf_config
from dhp_jax.model.hf.config import HFConfig
from dhp_jax.model.hf.spec import TextConfig

FAMILIES = ("qwen2_5_vl", "qwen3_vl", "internvl")

# ----------------------------------------------------------------------------------------- InternVL
INTERNVL_TYPES = ("internvl",)
INTERNVL_RENAMES = ((r"^language_model\.lm_head", "lm_head"),
                    (r"^language_model\.model\.", "model.language_model."),
                    (r"^language_model", "model.language_model"),
                    (r"^vision_tower", "model.vision_tower"),
                    (r"^multi_modal_projector", "model.multi_modal_projector"))


def _pair(x: Any) -> tuple[int, int]:
    return (int(x[0]), int(x[1])) if isinstance(x, (list, tuple)) else (int(x), int(x))


@dataclasses.dataclass(frozen=True)
class InternVLVision:
    num_layers: int
    hidden_size: int
    num_heads: int
    act: str
    channels: int
    image_size: tuple[int, int]
    patch_size: tuple[int, int]
    norm: str
    eps: float
    qk_norm: bool
    final_norm: bool
    shuffle: int
    projector_act: str


def parse_internvl(raw: Mapping[str, Any], r: Mapping[str, Any] | None = None) -> HFConfig:
    """HFConfig of an InternVL config.json `raw` (resolved: `r`; the `-hf` layout or the chat one)."""
    r = hf_config.resolve(raw) if r is None else r
    v = r["vision_config"]
    if r["vision_feature_layer"] != -1:
        raise ValueError(f"internvl: vision_feature_layer {r['vision_feature_layer']} is not supported (only -1)")
    if r["vision_feature_select_strategy"] != "default":
        raise ValueError("internvl: only vision_feature_select_strategy 'default' (drop the CLS token) is supported")
    if v["norm_type"] not in ("layer_norm", "rms_norm"):
        raise ValueError(f"internvl: vision norm_type {v['norm_type']!r} is not layer_norm or rms_norm")
    ratio = float(r["downsample_ratio"])
    vision = InternVLVision(
        int(v["num_hidden_layers"]), int(v["hidden_size"]), int(v["num_attention_heads"]), v["hidden_act"],
        int(v["num_channels"]), _pair(v["image_size"]), _pair(v["patch_size"]), v["norm_type"],
        float(v["layer_norm_eps"]), bool(v["use_qk_norm"]), not v["use_mean_pooling"], int(round(1 / ratio)),
        r["projector_hidden_act"])
    return HFConfig("internvl", raw, TextConfig.from_dict(r["text_config"]), vision, bool(r["tie_word_embeddings"]),
                    {"image": int(r["image_token_id"])})


def internvl_conv_shapes(cfg: HFConfig) -> dict[str, tuple[int, ...]]:
    v = cfg.vision
    return {"model.vision_tower.embeddings.patch_embeddings.projection.weight":
            (v.hidden_size, v.channels) + v.patch_size}


def pixel_shuffle(x: Any, k: int) -> Any:
    """[n, s, s, c] -> [n, s/k, s/k, c*k*k], transformers' `InternVLModel.pixel_shuffle` order (numpy,
    jax or torch arrays alike: reshapes and axis swaps only)."""
    n, a, b, c = x.shape
    x = x.reshape(n, a, b // k, c * k).swapaxes(1, 2)
    x = x.reshape(n, b // k, a // k, c * k * k).swapaxes(1, 2)
    return x


def shuffle_groups(side: int, k: int) -> np.ndarray:
    """int[side*side / k**2, k**2]: the raster patch indices each InternVL LLM token joins."""
    return np.asarray(pixel_shuffle(np.arange(side * side).reshape(1, side, side, 1), k)).reshape(-1, k * k)


# --------------------------------------------------------------------------------------- Qwen2.5-VL
QWEN_RENAMES = ((r"^visual", "model.visual"),
                (r"^model(?!\.(language_model|visual))", "model.language_model"))
QWEN2_5_VL_TYPES = ("qwen2_5_vl",)


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


# ----------------------------------------------------------------------------------------- Qwen3-VL
QWEN3_VL_TYPES = ("qwen3_vl",)


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


@dataclasses.dataclass(frozen=True)
class Family:
    """What the loaders need of a family: its model types, legacy renames, parser, conv shapes."""

    model_types: tuple[str, ...]
    renames: tuple[tuple[str, str], ...]
    parse: Callable[[Mapping[str, Any], Mapping[str, Any]], HFConfig]
    conv_shapes: Callable[[HFConfig], dict[str, tuple[int, ...]]]


REGISTRY = {
    "qwen2_5_vl": Family(QWEN2_5_VL_TYPES, QWEN_RENAMES, parse_qwen2_5_vl, qv.conv_shapes),
    "qwen3_vl": Family(QWEN3_VL_TYPES, QWEN_RENAMES, parse_qwen3_vl, qv.conv_shapes),
    "internvl": Family(INTERNVL_TYPES, INTERNVL_RENAMES, parse_internvl, internvl_conv_shapes),
}


def parse_config(raw: Mapping[str, Any], where: str = "config.json") -> HFConfig:
    """HFConfig of a config.json dict (any published layout), read by `dhp_jax.data.hf_config.resolve`."""
    if raw.get("model_type") == "internvl_chat":
        raise ValueError(f"{where}: model_type 'internvl_chat' (InternVL's own checkpoint layout) has no loader here; "
                         f"use the '-hf' release of the model (model_type 'internvl')")
    r = hf_config.resolve(raw, where)
    return REGISTRY[r["model_type"]].parse(dict(raw), r)
