"""InternVL's `FamilySpec` (the transformers-native `-hf` layout): its config classes
(`InternVLConfig`, its LLM any of `qwen2`, `qwen3`, `qwen3_moe`, `llama` through AutoConfig, vision
`InternVLVisionConfig`), also read from InternVL's own chat layout (`internvl_chat`: `llm_config` +
`vision_config`, converted field by field); the GotOcr2 image processor with the InternVL
processor's `crop_to_patches=True` (the tile grid of 1..12 tiles whose aspect ratio is closest to
the image's, plus a thumbnail when there is more than one tile; `image_seq_length` tokens a tile)
and the InternVL video processor (each frame one tile resized to `size`)."""

from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

from dhp_jax.data.processors import CLIP_MEAN, CLIP_STD, VideoPlan, _resize, _torch_float_arange_int
from dhp_jax.models import ConfigRules, ExampleFiles, FamilySpec, MemoryTerms, register

NAME, VISION = "internvl", "internvl_vision"
HEADS = "=num_attention_heads"
WIDTH_OVER_HEADS = "=hidden_size//num_attention_heads"

FIELDS = {
    # the LLMs it is released with (text_config)
    "qwen2": dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=32, head_dim=WIDTH_OVER_HEADS, hidden_act="silu",
                  rms_norm_eps=1e-6, max_position_embeddings=32768, use_sliding_window=False, rope_theta=10000.0),
    "qwen3": dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=32, head_dim=128, hidden_act="silu",
                  rms_norm_eps=1e-6, max_position_embeddings=32768, use_sliding_window=False,
                  attention_bias=False, rope_theta=10000.0),
    # InternVL3.5-30B-A3B / -241B-A28B: a Qwen3-MoE LLM (`MoeSpec`)
    "qwen3_moe": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24,
                      num_attention_heads=32, num_key_value_heads=4, head_dim=WIDTH_OVER_HEADS, hidden_act="silu",
                      rms_norm_eps=1e-6, max_position_embeddings=32768, use_sliding_window=False,
                      attention_bias=False, rope_theta=10000.0, num_experts=128, num_experts_per_tok=8,
                      moe_intermediate_size=768, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=False,
                      router_aux_loss_coef=0.001),
    "llama": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=HEADS, head_dim=WIDTH_OVER_HEADS, hidden_act="silu",
                  rms_norm_eps=1e-6, max_position_embeddings=2048, attention_bias=False, rope_theta=10000.0),
    VISION: dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, attention_bias=False,
                 use_qk_norm=False, intermediate_size=4096, hidden_act="gelu", norm_type="layer_norm",
                 layer_norm_eps=1e-6, image_size=[448, 448], patch_size=[14, 14], num_channels=3,
                 use_mask_token=False, use_absolute_position_embeddings=True, use_mean_pooling=True),
    NAME: dict(image_token_id=151667, image_seq_length=256, downsample_ratio=0.5, projector_hidden_act="gelu",
               vision_feature_layer=-1, vision_feature_select_strategy="default", tie_word_embeddings=True),
}


def from_chat_layout(config: dict) -> dict:
    """InternVL's chat layout (`llm_config`) as the `-hf` one: text_config = llm_config; the
    vision fields renamed (qkv_bias -> attention_bias, qk_normalization -> use_qk_norm); no final
    vision norm (InternViT has none); the image placeholder assumed 151667, transformers'
    InternVLConfig default (the chat layout keeps <IMG_CONTEXT> in its tokenizer, not its config)."""
    v = config.get("vision_config") or {}
    if int(config.get("select_layer", -1)) != -1:
        raise ValueError(f"internvl_chat: select_layer {config['select_layer']} is not supported (only -1)")
    vision = {"model_type": VISION, "use_mean_pooling": True, "use_absolute_position_embeddings": True,
              "use_mask_token": False, "attention_bias": v.get("qkv_bias", True),
              "use_qk_norm": v.get("qk_normalization", False)}
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers", "hidden_act",
                "image_size", "patch_size", "num_channels", "norm_type", "layer_norm_eps"):
        if key in v:
            vision[key] = v[key]
    llm = dict(config.get("llm_config") or {})
    return {"model_type": NAME, "downsample_ratio": config.get("downsample_ratio", 0.5),
            "projector_hidden_act": "gelu", "text_config": llm, "vision_config": vision,
            "tie_word_embeddings": bool(llm.get("tie_word_embeddings", False)),
            "vision_feature_layer": -1, "vision_feature_select_strategy": "default",
            "image_token_id": int(config.get("image_token_id", FIELDS[NAME]["image_token_id"]))}


CONFIG = ConfigRules(FIELDS, ("qwen2", "qwen3", "qwen3_moe", "llama"), VISION, {"intern_vit_6b": VISION},
                     layouts={"internvl_chat": from_chat_layout},
                     text_kinds={"qwen2": (True, False, "plain"), "qwen3": (False, True, "plain"),
                                 "qwen3_moe": (False, True, "plain"),
                                 "llama": (False, False, "plain")},
                     text_section=lambda config: "llm_config." if config.get("model_type") == "internvl_chat"
                     else "text_config.")


def _pair(x: Any) -> int:
    if isinstance(x, (list, tuple)):
        if len(set(x)) != 1:
            raise ValueError(f"non-square size {list(x)} is not supported")
        return int(x[0])
    return int(x)


def facts(raw: Mapping[str, Any], d: int, where: str) -> dict[str, Any]:
    """InternViT's span is fixed by its tile: (448/14)^2 patches + the CLS token."""
    v = raw["vision_config"]
    vh, vi, vn = int(v["hidden_size"]), int(v["intermediate_size"]), int(v["num_attention_heads"])
    depth, patch, image = int(v["num_hidden_layers"]), _pair(v["patch_size"]), _pair(v["image_size"])
    shuffle = int(round(1 / float(raw["downsample_ratio"])))
    grid = (image // patch) ** 2
    channels, merge = int(v["num_channels"]), shuffle
    norm = 2 * vh if v["norm_type"] == "layer_norm" else vh
    layer = 4 * vh * vh + vh + 2 * vh * vi + vi + vh + 2 * norm + 2 * vh + (3 * vh if v["attention_bias"] else 0) \
        + (2 * vh if v["use_qk_norm"] else 0)
    vision = (channels * patch * patch * vh + vh + vh
              + (grid + 1) * vh * bool(v["use_absolute_position_embeddings"])
              + vh * bool(v["use_mask_token"]) + depth * layer
              + (0 if v["use_mean_pooling"] else 2 * vh))
    wide = vh * merge * merge
    projector = 2 * wide + wide * d + d + d * d + d
    rule = "internvl" if (image, grid // (merge * merge)) == (448, 256) else f"internvl-{image}"
    return dict(vh=vh, vi=vi, vn=vn, depth=depth, patch=patch, channels=channels, temporal=1, merge=merge, mlp=2,
                frame=grid + 1, window=0, window_layers=0, deepstack=0, proj_hidden=d, vision=vision,
                projector=projector, rule=rule)


def tile_grid(width: int, height: int, tile_w: int, tile_h: int, min_tiles: int, max_tiles: int) -> tuple[int, int]:
    """(columns, rows): InternVL's grid with the closest aspect ratio; a tie goes to the larger
    grid while the image covers more than half of it."""
    grids = sorted(((c, r) for c in range(1, max_tiles + 1) for r in range(1, max_tiles + 1)
                    if min_tiles <= c * r <= max_tiles), key=lambda g: g[0] * g[1])
    aspect, area = width / height, width * height
    best, best_diff = (1, 1), math.inf
    for c, r in grids:
        diff = abs(aspect - c / r)
        if diff < best_diff:
            best, best_diff = (c, r), diff
        elif diff == best_diff and area > 0.5 * tile_w * tile_h * c * r:
            best = (c, r)
    return best


class Processor:
    image_defaults = {"size": {"height": 384, "width": 384}, "min_patches": 1, "max_patches": 12,
                      "image_mean": CLIP_MEAN, "image_std": CLIP_STD}
    video_defaults = {"size": {"height": 384, "width": 384}, "image_mean": CLIP_MEAN, "image_std": CLIP_STD,
                      "do_sample_frames": False, "fps": None, "num_frames": None, "initial_shift": True}
    # its video processor takes every frame by default: a run samples 1 frame/s
    auto_sampling = {"fps": 1.0}

    def factor(self, p) -> int:
        """Pixels per LLM token along a side: the tile's."""
        return p.image["size"]["width"]

    def image_grid(self, p, width: int, height: int) -> tuple[int, int, int]:
        """(tiles, columns, rows)."""
        c = p.image
        cols, rows = tile_grid(width, height, c["size"]["width"], c["size"]["height"],
                               c["min_patches"], c["max_patches"])
        if c["max_patches"] <= 1:
            cols = rows = 1
        n = cols * rows
        return (n + 1 if n > 1 else 1), cols, rows

    def image_tokens(self, p, grid) -> int:
        return grid[0] * p.image_seq_length

    def process_image(self, p, rgb, grid) -> np.ndarray:
        c = p.image
        n, cols, rows = grid
        sw, sh = c["size"]["width"], c["size"]["height"]
        tiles = []
        if n > 1:
            big = _resize(rgb, cols * sw, rows * sh, c["resample"])
            for i in range(cols * rows):
                col, row = i % cols, i // cols
                tiles.append(big[row * sh:(row + 1) * sh, col * sw:(col + 1) * sw])
        tiles.append(_resize(rgb, sw, sh, c["resample"]))  # the thumbnail, or the one tile
        return np.stack([p._normalize(t, c) for t in tiles])

    def frame_indices(self, p, info, fps, num) -> np.ndarray:
        c, total = p.video, info.total_frames
        if num is None and fps is not None:
            num = int(total / info.fps * fps)
            if num <= 0:
                raise ValueError(f"a clip of {total} frames ({total / info.fps:.3g} s) gives no frame at {fps:g} "
                                 f"frames/s (InternVL's video processor samples int(seconds x fps) frames)")
        if num is None:
            return np.arange(total, dtype=np.int64)
        if num > total or num <= 0:
            raise ValueError(f"cannot sample {num} frames from a video of {total}")
        shift = c.get("initial_shift", True)
        shift = total / num / 2 if shift is True else float(shift or 0)
        return _torch_float_arange_int(shift, total, total / num)

    def video_plan(self, p, info, idx: np.ndarray) -> VideoPlan:
        n, s = len(idx), p.video["size"]
        return VideoPlan(idx, (n, 1, 1), n * p.image_seq_length, (s["width"], s["height"]), info.fps)

    def process_video(self, p, x: np.ndarray) -> np.ndarray:
        return x

    def model_inputs(self, out, images, image_grids, videos, plans, order) -> None:
        """Images' tiles and videos' frames in the order the text names them, one `pixel_values`."""
        it_i, it_v, parts = iter(images), iter(videos), []
        for k in order:
            parts.append(next(it_i) if k == "image" else next(it_v))
        if parts:
            out["pixel_values"] = np.concatenate(parts)


TOKENS = {"context_image_token": "<IMG_CONTEXT>", "start_image_token": "<img>",
          "end_image_token": "</img>", "video_token": "<video>"}


class Chat:
    """An image is `<img>`, its context tokens, `</img>`; a video one `FrameN: <img>...</img>` line
    a frame."""

    tokens = TOKENS

    def placeholders(self, names: dict, token_id) -> tuple[str, str, list[int], list[int]]:
        return (names["context_image_token"], names["video_token"],
                [token_id(names[k]) for k in ("context_image_token", "start_image_token", "end_image_token")], [])

    def image_expansion(self, ct, tokens: int) -> str:
        return ct.names["start_image_token"] + ct.image_placeholder * tokens + ct.names["end_image_token"]

    def video_expansion(self, ct, plan, image_seq_length: int, merge: int) -> str:
        n = ct.names
        return "\n".join(f"Frame{i + 1}: {n['start_image_token']}{n['context_image_token'] * image_seq_length}"
                         f"{n['end_image_token']}" for i in range(plan.grid[0]))


TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}{% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' %}"
    "{{ '<IMG_CONTEXT>\n' }}{% elif content['type'] == 'video' %}{{ '<video>\n' }}{% elif content['type'] == 'text' %}"
    "{{ content['text'] }}{% endif %}{% endfor %}{% endif %}{{ '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

EXAMPLE = ExampleFiles(
    "InternVLProcessor", TEMPLATE,
    {"image_processor_type": "GotOcr2ImageProcessor", "size": {"height": 112, "width": 112},
     "crop_to_patches": False, "min_patches": 1, "max_patches": 4,
     "image_mean": [0.485, 0.456, 0.406], "image_std": [0.229, 0.224, 0.225], "resample": 3},
    {"video_processor_type": "InternVLVideoProcessor", "size": {"height": 112, "width": 112},
     "image_mean": [0.485, 0.456, 0.406], "image_std": [0.229, 0.224, 0.225],
     "do_sample_frames": True, "num_frames": 4, "initial_shift": True, "resample": 3},
    {"image_seq_length": 16},
    ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<img>", "</img>", "<IMG_CONTEXT>", "<video>"],
    dict(start_image_token="<img>", end_image_token="</img>", context_image_token="<IMG_CONTEXT>",
         video_token="<video>"),
    {"image": "<IMG_CONTEXT>"}, published_extra={"image_seq_length": 256}, accepts_image_seq_length=True)


def encoder_saved(m: Any, v: int, w: int, ff: int) -> int:
    """As the Qwen encoders' (no rotary tables), and the layer scales keep the two branch outputs
    they multiply (the projection's and fc2's)."""
    return 6 * v + 5 * w + m.vision_heads + ff


def tail(m: Any, rows: int, v: int, wide: int, mid: int, levels: int) -> tuple[int, int]:
    """The projector (its LayerNorm's input and output, 4 patches wide, its activation's input and
    output); the tile's CLS-token mask (one per encoder element)."""
    return 2 * wide + 2 * mid, rows * v


# the encoder block's backward-pass cotangents (exact GELU: its VJP materialises erfc and exp of
# fc1's output), fitted as Qwen2.5-VL's; one CLS row a token, one rotary axis; on a rank of t > 1
# devices in the psum form, three all-reduce buffers live in a block's ring backward pass (the layer
# scales multiply the row-split GEMMs' outputs, and XLA combines a block's all-reduces: the MLP
# phase's result beside the attention phase's operand and result)
MEMORY = MemoryTerms(encoder_cotangents=(3, 6), cls_rows=1, position_axes=1, llm_qk_norm=False,
                     encoder_saved=encoder_saved, tail=tail, psum_buffers=3)
LAYER_SCALE = 0.1


def tiny_config(token_ids: Mapping[str, int], vocab_size: int, text: dict) -> dict[str, Any]:
    """112-px tiles of 14-px patches, 16 tokens a tile (the example's processor files)."""
    return {"model_type": NAME, "architectures": ["InternVLForConditionalGeneration"],
            "text_config": {**text, "model_type": "qwen2",
                            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
            "vision_config": {"model_type": VISION, "hidden_size": 32, "num_hidden_layers": 2,
                              "num_attention_heads": 2, "intermediate_size": 64, "image_size": [112, 112],
                              "patch_size": [14, 14], "attention_bias": True, "use_qk_norm": False,
                              "norm_type": "layer_norm", "layer_norm_eps": 1e-6, "use_mean_pooling": True,
                              "hidden_act": "gelu", "num_channels": 3, "layer_scale_init_value": LAYER_SCALE},
            "downsample_ratio": 0.5, "projector_hidden_act": "gelu", "vision_feature_layer": -1,
            "vision_feature_select_strategy": "default", "image_token_id": token_ids["image"],
            "image_seq_length": 16, "tie_word_embeddings": False}


class Demo:
    """Every frame (or image) is `<img>`, its tiles' placeholders (4 a tile at the demo's 8-px tiles:
    p tokens take ceil(p / 4) tiles), `</img>`, with `pixel_values` [tiles, 3, H, W]."""

    def shrink(self, raw: dict) -> None:
        raw["vision_config"].update(image_size=[8, 8], patch_size=[2, 2])
        raw["image_seq_length"] = 4

    def setup(self, pipe, hf_config) -> int:
        v = hf_config.vision
        pipe.tile = (v.channels, v.image_size[0], v.image_size[1])
        pipe.per_tile = (v.image_size[0] // v.patch_size[0]) * (v.image_size[1] // v.patch_size[1]) // v.shuffle ** 2
        return int(np.prod(pipe.tile))

    def add_vision(self, pipe, add, rows, grid, modality, n, per_frame, pixels, tokens) -> None:
        start, end = tokens["vision_start"], tokens["vision_end"]
        tiles = -(-per_frame // pipe.per_tile)
        for _ in range(n // per_frame):
            add([start] + [tokens["image"]] * (tiles * pipe.per_tile) + [end],
                [0] * (tiles * pipe.per_tile + 2), [-100] * (tiles * pipe.per_tile + 2))
            rows["image"].append(pixels(tiles).reshape((tiles,) + pipe.tile))

    def finish(self, inputs, kinds, rows, grid) -> None:
        if rows["image"]:
            inputs["pixel_values"] = np.concatenate(rows["image"])


SPEC = register(FamilySpec(
    name=NAME, model_types=(NAME,), name_prefixes=("internvl", "intern-vl"),
    config=CONFIG, facts=facts, processor=Processor(),
    processor_names=("internvl", "gotocr2"), chat=Chat(), example=EXAMPLE, vision_rule="internvl",
    published_model="internvl3-8b", memory=MEMORY, tiny_config=tiny_config, demo=Demo(),
    hf_module="dhp_jax.models.internvl.hf_config", jax_module="dhp_jax.models.internvl.jax_model",
    torch_module="dhp_jax.models.internvl.torch_model"))
