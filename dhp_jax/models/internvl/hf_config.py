"""InternVL (`-hf` layout), model side without jax (both engines read it): its `HFConfig`
(`parse`), legacy weight names, conv shapes, the pixel shuffle and its index tables, and the
host-side arrays of one processor output (`prepare`)."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import numpy as np

from dhp_jax.data import hf_config
from dhp_jax.model.hf.config import HFConfig
from dhp_jax.model.hf.inputs import as_numpy, sample_tokens, vision_scatter_index
from dhp_jax.model.hf.spec import TextConfig

MODEL_TYPES = ("internvl",)
PROJECTOR_EPS = 1e-5     # torch LayerNorm's default: the projector's norm is not configured
QK_NORM_EPS = 1e-6       # InternViT's QK-norm
INTERNVL_RENAMES = ((r"^language_model\.lm_head", "lm_head"),
                    (r"^language_model\.model\.", "model.language_model."),
                    (r"^language_model", "model.language_model"),
                    (r"^vision_tower", "model.vision_tower"),
                    (r"^multi_modal_projector", "model.multi_modal_projector"))
# the names transformers' `save_pretrained` writes (its conversion mapping reversed) and the
# published `-hf` releases hold: the LLM as `language_model.model.*` with its head, the encoder and
# the projector at the top (`dhp_jax.model.hf.checkpoint.saved_weights`, both engines' savers)
SAVED_RENAMES = ((r"^model\.language_model\.", "language_model.model."),
                 (r"^lm_head\.", "language_model.lm_head."),
                 (r"^model\.vision_tower\.", "vision_tower."),
                 (r"^model\.multi_modal_projector\.", "multi_modal_projector."))


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


VisionConfig = InternVLVision
parse = parse_internvl
conv_shapes = internvl_conv_shapes
LEGACY_RENAMES = INTERNVL_RENAMES
# a Qwen3-MoE LLM's experts as InternVL3.5's releases store them: `mlp.experts.{e}.gate_proj.weight`
# [I, d], `up_proj.weight` [I, d], `down_proj.weight` [d, I] (`dhp_jax.model.hf.moe.EXPERT_LAYOUTS`)
EXPERT_LAYOUT = "per_expert"


def prepare(cfg: HFConfig, inputs: Mapping[str, Any]) -> dict[str, Any]:
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


# ----------------------------------------------------------------- the packed streams (`model.hf.packed`)
ROPE_AXES = 1        # 1-D rotary positions


def patch_dim(config: HFConfig) -> int:
    v = config.vision
    return v.channels * v.patch_size[0] * v.patch_size[1]


def unit(config: HFConfig) -> int:
    """Vision rows per LLM slot: the k*k patches the pixel shuffle joins, plus the tile's CLS row."""
    return config.vision.shuffle ** 2 + 1


def vision_rows(config: HFConfig, seg: Any, grid: Any, pixels: np.ndarray, ints: np.ndarray, floats: np.ndarray,
                col: Mapping[str, int], bases: dict, where: str) -> None:
    """One image segment's rows: its tiles' patches in pixel-shuffle groups, tile ids, position-table
    rows, and each tile's CLS row on its first token."""
    v = config.vision
    k, width = ints.shape[0], patch_dim(config)
    kk = v.shuffle ** 2
    tiles, side, _ = (int(x) for x in grid)
    per_tile = side * side // kk
    if pixels.shape != (k, kk * width) or tiles * per_tile != k:
        raise ValueError(f"{where}: image pixels {pixels.shape} do not make {tiles} tiles of {per_tile} "
                         f"tokens of {kk} x {width}")
    groups = shuffle_groups(side, v.shuffle)                        # [per_tile, kk] raster patch index
    floats[:, :kk, :width] = pixels.reshape(k, kk, width)
    tile = np.arange(k) // per_tile
    ints[:, :kk, col["frame"]] = bases["frame"] + 1 + tile[:, None]
    ints[:, :kk, col["table"]] = 1 + groups[np.arange(k) % per_tile]
    first = np.arange(k) % per_tile == 0                            # the CLS row of each tile
    ints[first, kk, col["frame"]] = bases["frame"] + 1 + tile[first]
    ints[first, kk, col["cls"]] = 1
    bases["frame"] += tiles


# ----------------------------------------------------------------- samples (`model.hf.sample`)
def vision_runs(config: HFConfig, inputs: Mapping[str, Any], batch: Mapping[str, Any]):
    """(each token's kind: 1 on image placeholders, the image runs): each run of placeholders takes
    as many tiles as its tokens need; pixels [tokens, k*k * C*P*P], a token's k x k patches in
    pixel-shuffle order."""
    from dhp_jax.model.hf.sample import _runs

    ids = batch["input_ids"]
    kinds = (ids == config.token_ids["image"]).astype(np.int64)
    if inputs.get("pixel_values") is None:
        return kinds, {"image": [], "video": []}
    v = config.vision
    patches = batch["image"]["patches"].astype(np.float32)                  # [tiles, hw, C*P*P]
    tiles, hw, width = patches.shape
    side, k = int(round(hw ** 0.5)), v.shuffle
    groups = shuffle_groups(side, k)
    per_tile = hw // (k * k)
    runs = [(a, b) for kind, a, b in _runs(kinds) if kind]
    out, at = [], 0
    for a, b in runs:
        if (b - a) % per_tile:
            raise ValueError(f"internvl: an image run of {b - a} tokens is not whole tiles of {per_tile} tokens")
        n = (b - a) // per_tile
        rows = patches[at: at + n][:, groups].reshape(n * per_tile, k * k * width)
        out.append((rows, per_tile, {"grid_thw": (n, side, side)}))
        at += n
    return kinds, {"image": out, "video": []}


def processor_pixels(config: HFConfig, out: dict, kinds: np.ndarray, pixels: dict, grids_: dict,
                     seconds: list) -> None:
    """`pixel_values` [tiles, C, H, W] back from the runs' pixel-shuffled rows."""
    if not pixels["image"]:
        return
    v = config.vision
    k, (ph, pw), (h, w) = v.shuffle, v.patch_size, v.image_size
    side = h // ph
    groups = shuffle_groups(side, k)
    rows = np.concatenate(pixels["image"])
    per_tile = groups.shape[0]
    tiles = rows.shape[0] // per_tile
    patches = np.empty((tiles, side * side, rows.shape[1] // (k * k)), np.float32)
    patches[:, groups] = rows.reshape(tiles, per_tile, k * k, -1)
    px = patches.reshape(tiles, side, w // pw, v.channels, ph, pw).transpose(0, 3, 1, 4, 2, 5)
    out["pixel_values"] = px.reshape(tiles, v.channels, h, w)


# ----------------------------------------------------------------- random weights (`model.hf.init`)
def vision_weight_shapes(cfg: HFConfig, out: dict) -> None:
    """{name: (initialiser, shape)} of InternViT's and the projector's weights, into `out`."""
    from dhp_jax.model.hf.init import _linear, _norm

    v, raw = cfg.vision, cfg.fields["vision_config"]
    d, inter = v.hidden_size, int(raw["intermediate_size"])
    pre = "model.vision_tower"
    patches = (v.image_size[0] // v.patch_size[0]) * (v.image_size[1] // v.patch_size[1])
    out[f"{pre}.embeddings.cls_token"] = ("normal", (1, 1, d))
    out[f"{pre}.embeddings.patch_embeddings.projection.weight"] = ("normal", (d, v.channels) + v.patch_size)
    out[f"{pre}.embeddings.patch_embeddings.projection.bias"] = ("zeros", (d,))
    if raw.get("use_absolute_position_embeddings", True):
        out[f"{pre}.embeddings.position_embeddings"] = ("normal", (1, patches + 1, d))
    bias = bool(raw.get("attention_bias", False))
    ln = v.norm == "layer_norm"
    for i in range(v.num_layers):
        p = f"{pre}.encoder.layer.{i}"
        for k in ("q_proj", "k_proj", "v_proj"):
            _linear(out, f"{p}.attention.{k}", d, d, bias)
        _linear(out, f"{p}.attention.projection_layer", d, d, True)
        if v.qk_norm:
            _norm(out, f"{p}.attention.q_norm", d, False)
            _norm(out, f"{p}.attention.k_norm", d, False)
        _norm(out, f"{p}.layernorm_before", d, ln)
        _norm(out, f"{p}.layernorm_after", d, ln)
        out[f"{p}.lambda_1"] = ("scale", (d,))
        out[f"{p}.lambda_2"] = ("scale", (d,))
        _linear(out, f"{p}.mlp.fc1", inter, d, True)
        _linear(out, f"{p}.mlp.fc2", d, inter, True)
    if v.final_norm:
        _norm(out, f"{pre}.layernorm", d, True)
    wide, text_d = d * v.shuffle ** 2, cfg.text.hidden_size
    _norm(out, "model.multi_modal_projector.layer_norm", wide, True)
    _linear(out, "model.multi_modal_projector.linear_1", text_d, wide, True)
    _linear(out, "model.multi_modal_projector.linear_2", text_d, text_d, True)


# ----------------------------------------------------------------- tensor parallelism (`sharding.tensor`)
# InternViT's layers: q/k/v and their biases, and the QK-norm scales over the whole width, by
# heads; projection_layer and fc2 by row, fc1 by column; the layer scales lambda_1 / lambda_2, the
# norms and the row-split biases replicated.
VISION_TP_SPLIT = {"attention/q_proj/kernel": (1, "heads"), "attention/q_proj/bias": (0, "heads"),
                   "attention/k_proj/kernel": (1, "heads"), "attention/k_proj/bias": (0, "heads"),
                   "attention/v_proj/kernel": (1, "heads"), "attention/v_proj/bias": (0, "heads"),
                   "attention/q_norm/scale": (0, "heads"), "attention/k_norm/scale": (0, "heads"),
                   "attention/projection_layer/kernel": (0, "heads"), "mlp/fc1/kernel": (1, "mlp"),
                   "mlp/fc1/bias": (0, "mlp"), "mlp/fc2/kernel": (0, "mlp")}


def encoder_stack(config: HFConfig) -> tuple[tuple[str, ...], int]:
    """(params path, block count) of the encoder's scanned layers."""
    return ("model", "vision_tower", "encoder", "layer"), config.vision.num_layers
