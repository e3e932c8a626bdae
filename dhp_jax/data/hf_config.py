"""The one reader of a Hugging Face `config.json` of the supported families, read as transformers
reads it; every other part (the engine `dhp_jax.model.hf`, the torch backend `npu_backend.hf`,
the planner's `ModelFacts`) takes its fields from `resolve`.

Layouts accepted (all those in which the families' checkpoints have been published):

- `qwen2_5_vl` nested (`text_config` + `vision_config`) or flat (the Qwen2-VL / Qwen2.5-VL
  releases: the text fields at the top level, `rope_scaling` {"type": "mrope", ...} there);
- `qwen3_vl`, `internvl` (the `-hf` releases) nested;
- `internvl_chat` (InternVL's own layout: `llm_config` + `vision_config`), converted field by
  field to the `-hf` layout as InternVL's conversion to `-hf` does.

`resolve` gives one dict in the nested transformers-5 layout in which every field the project
reads is present: a field absent from config.json gets transformers' default for that config's
model type (`FIELDS`, one table; `tests/test_hf_config.py` builds every transformers config
class with only its required fields and compares). Rotary parameters are read from
`rope_parameters` or `rope_scaling` (the latter wins, as in transformers), `type` or `rope_type`,
`rope_theta` inside or beside them; the LM head is tied by transformers' rule (`TIE_RULES`).

Rotary scaling: `linear` divides the inverse frequencies by `factor` (computed); `dynamic` equals
the default rotary up to `max_position_embeddings` (transformers recomputes the frequencies only
past it), so it is read as default and the engine refuses longer positions
(`rope_exact_positions`); `yarn`, `longrope` and `llama3` change the rotary at every length and
are refused, naming the field.

Pure Python (the planner imports it; no jax).
"""

from __future__ import annotations

import copy
import os
import re
from pathlib import Path
from typing import Any, Mapping

from dhp_jax.data.jsonl import read_json_file

FAMILIES = ("internvl", "qwen2_5_vl", "qwen3_vl")

# Rotary fields: read from rope_parameters / rope_scaling (`rope_theta` also beside them); the
# M-RoPE split's default is the rotary module's (Qwen2_5_VLRotaryEmbedding, Qwen3VLTextRotaryEmbedding)
ROPE_KEYS = ("rope_theta", "mrope_section")

# Derived defaults (transformers computes them from other fields of the same config)
HEADS = "=num_attention_heads"            # num_key_value_heads absent or null: one KV head per query head
WIDTH_OVER_HEADS = "=hidden_size//num_attention_heads"   # head_dim absent or null

# {config model_type: {field: transformers 5 default}}: every field the project reads, per config class
FIELDS: dict[str, dict[str, Any]] = {
    # the LLMs (text_config)
    "qwen2": dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=32, head_dim=WIDTH_OVER_HEADS, hidden_act="silu",
                  rms_norm_eps=1e-6, max_position_embeddings=32768, use_sliding_window=False, rope_theta=10000.0),
    "qwen3": dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=32, head_dim=128, hidden_act="silu",
                  rms_norm_eps=1e-6, max_position_embeddings=32768, use_sliding_window=False,
                  attention_bias=False, rope_theta=10000.0),
    "llama": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=HEADS, head_dim=WIDTH_OVER_HEADS, hidden_act="silu",
                  rms_norm_eps=1e-6, max_position_embeddings=2048, attention_bias=False, rope_theta=10000.0),
    "qwen2_5_vl_text": dict(vocab_size=152064, hidden_size=8192, intermediate_size=29568, num_hidden_layers=80,
                            num_attention_heads=64, num_key_value_heads=8, head_dim=WIDTH_OVER_HEADS,
                            hidden_act="silu", rms_norm_eps=1e-5, max_position_embeddings=32768,
                            use_sliding_window=False, rope_theta=1000000.0, mrope_section=[16, 24, 24]),
    "qwen3_vl_text": dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                          num_attention_heads=32, num_key_value_heads=32, head_dim=128, hidden_act="silu",
                          rms_norm_eps=1e-6, max_position_embeddings=128000, attention_bias=False,
                          rope_theta=500000.0, mrope_section=[24, 20, 20]),
    # the vision encoders (vision_config)
    "qwen2_5_vl_vision": dict(depth=32, hidden_size=3584, hidden_act="silu", intermediate_size=3420, num_heads=16,
                              in_channels=3, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                              tokens_per_second=4, window_size=112, out_hidden_size=3584,
                              fullatt_block_indexes=[7, 15, 23, 31], rope_theta=10000.0),
    "qwen3_vl_vision": dict(depth=27, hidden_size=1152, hidden_act="gelu_pytorch_tanh", intermediate_size=4304,
                            num_heads=16, in_channels=3, patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                            out_hidden_size=3584, num_position_embeddings=2304, deepstack_visual_indexes=[8, 16, 24],
                            rope_theta=10000.0),
    "internvl_vision": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, attention_bias=False,
                            use_qk_norm=False, intermediate_size=4096, hidden_act="gelu", norm_type="layer_norm",
                            layer_norm_eps=1e-6, image_size=[448, 448], patch_size=[14, 14], num_channels=3,
                            use_mask_token=False, use_absolute_position_embeddings=True, use_mean_pooling=True),
    # the models (top level)
    "qwen2_5_vl": dict(image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
                       vision_end_token_id=151653, tie_word_embeddings=False),
    "qwen3_vl": dict(image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
                     vision_end_token_id=151653, tie_word_embeddings=False),
    "internvl": dict(image_token_id=151667, image_seq_length=256, downsample_ratio=0.5, projector_hidden_act="gelu",
                     vision_feature_layer=-1, vision_feature_select_strategy="default", tie_word_embeddings=True),
}

# model_type -> (text model_type when text_config names none, vision model_type)
SUB_TYPES = {"qwen2_5_vl": ("qwen2_5_vl_text", "qwen2_5_vl_vision"),
             "qwen3_vl": ("qwen3_vl_text", "qwen3_vl_vision"),
             "internvl": ("qwen2", "internvl_vision")}
# the text model types each family's LLM may be (transformers builds InternVL's through AutoConfig)
TEXT_TYPES = {"qwen2_5_vl": ("qwen2_5_vl_text",), "qwen3_vl": ("qwen3_vl_text",),
              "internvl": ("qwen2", "qwen3", "llama")}
# the vision_config model_type older files carry, renamed by transformers on load
VISION_ALIASES = {"qwen2_5_vl": "qwen2_5_vl_vision", "qwen3_vl": "qwen3_vl_vision", "intern_vit_6b": "internvl_vision"}

# LM head tied to the embedding, as transformers 5 decides: the model's top-level flag (its
# default in FIELDS); Qwen2.5-VL's config also ties when text_config says so (Qwen2_5_VLConfig.__post_init__)
TIE_RULES = {"qwen2_5_vl": "top-level or text_config", "qwen3_vl": "top-level", "internvl": "top-level"}

# rotary kinds: computed exactly, exact below max_position_embeddings, or refused
ROPE_COMPUTED = ("default", "linear")
ROPE_EXACT_BELOW_MAX = ("dynamic",)


HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache, as huggingface_hub finds it: $HF_HUB_CACHE, else $HF_HOME/hub,
    else $XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
    return Path(xdg).expanduser() / "huggingface" / "hub"


def checkpoint_dir(name: str | os.PathLike) -> str:
    """A checkpoint directory: `name` itself when it is a directory (or no Hub id); a Hub id
    ("Qwen/Qwen2.5-VL-7B-Instruct") is looked up in the local Hugging Face cache, as transformers
    does offline: models--<org>--<name>/refs/main names the revision, snapshots/<revision> holds
    the files. An id not in the cache is an error that names the command that downloads it."""
    text = os.fspath(name)
    if os.path.isdir(text) or not HUB_ID.match(text) or os.path.exists(text):
        return text
    cache = hub_cache_dir()
    repo = cache / ("models--" + text.replace("/", "--"))
    snapshots = repo / "snapshots"
    revision = None
    ref = repo / "refs" / "main"
    if ref.is_file():
        revision = ref.read_text().strip()
    elif snapshots.is_dir():
        found = sorted(p.name for p in snapshots.iterdir() if p.is_dir())
        revision = found[0] if len(found) == 1 else None
    if revision and (snapshots / revision / "config.json").is_file():
        return str(snapshots / revision)
    raise FileNotFoundError(f"{text!r} is neither a directory nor a model in the local Hugging Face cache ({cache}); "
                            f"download it with `hf download {text}` (or `huggingface-cli download {text}`)")


def read_config(config: Mapping[str, Any] | str | os.PathLike) -> dict[str, Any]:
    """A config dict as is, or config.json of a checkpoint directory (or the file itself, or a Hub
    id in the local cache: `checkpoint_dir`)."""
    if isinstance(config, Mapping):
        return dict(config)
    path = Path(checkpoint_dir(config))
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"{path}: " + ("no config.json (a directory written by save_pretrained)"
                                               if path.exists() else "does not exist"))
    return read_json_file(file, fix="copy or save the checkpoint again")


def _nested_qwen(config: Mapping[str, Any], family: str) -> dict[str, Any]:
    """A flat Qwen2-VL / Qwen2.5-VL config moved into the nested layout, as Qwen2_5_VLConfig does
    when it has no text_config: the text model's fields (and the rotary ones) go to text_config."""
    out = dict(config)
    text_type = SUB_TYPES[family][0]
    keys = set(FIELDS[text_type]) | {"rope_parameters", "rope_scaling", "rope_theta", "max_window_layers",
                                     "sliding_window", "layer_types", "attention_dropout", "initializer_range",
                                     "use_cache", "bos_token_id", "eos_token_id", "pad_token_id"}
    out["text_config"] = {k: out.pop(k) for k in sorted(keys) if k in out}
    out["text_config"]["model_type"] = text_type
    return out


def _nested_internvl_chat(config: Mapping[str, Any]) -> dict[str, Any]:
    """InternVL's chat layout (`llm_config`) as the `-hf` one: text_config = llm_config; the
    vision fields renamed (qkv_bias -> attention_bias, qk_normalization -> use_qk_norm); no final
    vision norm (InternViT has none); the image placeholder assumed 151667, transformers'
    InternVLConfig default (the chat layout keeps <IMG_CONTEXT> in its tokenizer, not its config)."""
    v = config.get("vision_config") or {}
    if int(config.get("select_layer", -1)) != -1:
        raise ValueError(f"internvl_chat: select_layer {config['select_layer']} is not supported (only -1)")
    vision = {"model_type": "internvl_vision", "use_mean_pooling": True, "use_absolute_position_embeddings": True,
              "use_mask_token": False, "attention_bias": v.get("qkv_bias", True),
              "use_qk_norm": v.get("qk_normalization", False)}
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers", "hidden_act",
                "image_size", "patch_size", "num_channels", "norm_type", "layer_norm_eps"):
        if key in v:
            vision[key] = v[key]
    llm = dict(config.get("llm_config") or {})
    return {"model_type": "internvl", "downsample_ratio": config.get("downsample_ratio", 0.5),
            "projector_hidden_act": "gelu", "text_config": llm, "vision_config": vision,
            "tie_word_embeddings": bool(llm.get("tie_word_embeddings", False)),
            "vision_feature_layer": -1, "vision_feature_select_strategy": "default",
            "image_token_id": int(config.get("image_token_id", FIELDS["internvl"]["image_token_id"]))}


def nested(config: Mapping[str, Any]) -> dict[str, Any]:
    """The nested transformers layout of a config dict (a copy; absent fields stay absent): a flat
    Qwen2-VL / Qwen2.5-VL file gets its text_config, InternVL's chat layout its `-hf` form. The
    result is still a config.json transformers loads."""
    config = copy.deepcopy(dict(config))
    family = config.get("model_type")
    if family == "internvl_chat":
        return _nested_internvl_chat(config)
    if family == "qwen2_5_vl" and not isinstance(config.get("text_config"), Mapping):
        return _nested_qwen(config, family)
    return config


def _default(cfg: Mapping[str, Any], key: str, default: Any) -> Any:
    if default == HEADS:
        return cfg["num_attention_heads"]
    if default == WIDTH_OVER_HEADS:
        return cfg["hidden_size"] // cfg["num_attention_heads"]
    return copy.deepcopy(default)


def _filled(cfg: Mapping[str, Any], model_type: str) -> dict[str, Any]:
    """`cfg` with every field of FIELDS[model_type] present (transformers' default where absent;
    a derived default where absent or null)."""
    table = FIELDS[model_type]
    out = dict(cfg)
    for key, default in table.items():
        if key in ROPE_KEYS or isinstance(default, str) and default.startswith("="):
            continue
        if key not in out:
            out[key] = copy.deepcopy(default)
    for key, default in table.items():          # derived ones after the fields they derive from
        if isinstance(default, str) and default.startswith("=") and out.get(key) is None:
            out[key] = _default(out, key, default)
    # null in the file: one KV head per query head (the configs' __post_init__), head_dim from the
    # width (what the attention modules fall back to)
    if "num_key_value_heads" in table and out["num_key_value_heads"] is None:
        out["num_key_value_heads"] = _default(out, "num_key_value_heads", HEADS)
    if "head_dim" in table and out["head_dim"] is None:
        out["head_dim"] = _default(out, "head_dim", WIDTH_OVER_HEADS)
    out["model_type"] = model_type
    return out


def _rope(cfg: Mapping[str, Any], defaults: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The rotary parameters as transformers standardises them: `rope_scaling` (else
    `rope_parameters`), `rope_type` (else `type`; Qwen's "mrope" is "default"), `rope_theta` inside,
    else beside, else the model type's default."""
    params = dict(cfg.get("rope_scaling") or cfg.get("rope_parameters") or {})
    params.setdefault("rope_theta", cfg.get("rope_theta", defaults["rope_theta"]))
    if "mrope_section" in defaults:
        params.setdefault("mrope_section", list(defaults["mrope_section"]))
    kind = params.get("rope_type", params.get("type", "default"))
    params["rope_type"] = "default" if kind == "mrope" else kind
    params.pop("type", None)
    params["rope_theta"] = float(params["rope_theta"])
    kind = params["rope_type"]
    field = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
    if kind not in ROPE_COMPUTED + ROPE_EXACT_BELOW_MAX:
        raise ValueError(f"{where}{field}: rope_type {kind!r} is not supported (it changes the rotary at every "
                         f"length; supported: {', '.join(ROPE_COMPUTED + ROPE_EXACT_BELOW_MAX)})")
    if kind != "default":
        if "factor" not in params:
            raise ValueError(f"{where}{field}: rope_type {kind!r} needs a 'factor'")
        params["factor"] = float(params["factor"])
    return params


def _text(t: Mapping[str, Any], family: str, where: str) -> dict[str, Any]:
    """The resolved text_config; `where` prefixes the field names in errors ("FILE: text_config.",
    or "FILE: " for a flat file)."""
    model_type = t.get("model_type") or SUB_TYPES[family][0]
    if model_type not in TEXT_TYPES[family]:
        raise ValueError(f"{where}model_type {model_type!r} is not supported for {family} "
                         f"(known: {', '.join(TEXT_TYPES[family])})")
    out = _filled(t, model_type)
    out["rope_parameters"] = _rope(t, FIELDS[model_type], where)
    out["rope_theta"] = out["rope_parameters"]["rope_theta"]
    out.pop("rope_scaling", None)
    if out.get("use_sliding_window"):
        raise ValueError(f"{where}use_sliding_window: sliding-window attention is not supported")
    heads, kv = int(out["num_attention_heads"]), int(out["num_key_value_heads"])
    if heads % kv:
        raise ValueError(f"{where}num_attention_heads {heads} is not a multiple of "
                         f"num_key_value_heads {kv}")
    return out


def _vision(v: Mapping[str, Any], family: str, where: str) -> dict[str, Any]:
    model_type = v.get("model_type") or SUB_TYPES[family][1]
    model_type = VISION_ALIASES.get(model_type, model_type)
    if model_type != SUB_TYPES[family][1]:
        raise ValueError(f"{where}: vision_config.model_type {model_type!r} is not {SUB_TYPES[family][1]!r}")
    out = _filled(v, model_type)
    if "rope_theta" in FIELDS[model_type]:
        rope = dict(v.get("rope_parameters") or {})
        out["rope_theta"] = float(rope.get("rope_theta", v.get("rope_theta", FIELDS[model_type]["rope_theta"])))
    return out


def tied(config: Mapping[str, Any]) -> bool:
    """Whether transformers 5 ties the LM head to the token embedding (`TIE_RULES`), of a nested config."""
    family = config.get("model_type")
    top = bool(config.get("tie_word_embeddings", FIELDS[family]["tie_word_embeddings"]))
    if TIE_RULES[family] == "top-level or text_config":
        return top or bool((config.get("text_config") or {}).get("tie_word_embeddings", False))
    return top


def resolve(config: Mapping[str, Any], where: str = "config.json") -> dict[str, Any]:
    """The config as transformers reads it: nested layout, every field the project reads present
    (`FIELDS`), `text_config.rope_parameters` standardised, `tie_word_embeddings` the resolved
    flag. `where` names the file in errors."""
    raw = nested(config)
    family = raw.get("model_type")
    if family not in FAMILIES:
        raise ValueError(f"{where}: model_type {family!r} is not one of {', '.join(FAMILIES)} (or internvl_chat)")
    for key in ("text_config", "vision_config"):
        if raw.get(key) is not None and not isinstance(raw.get(key), Mapping):
            raise ValueError(f"{where}: {key} is not an object")
    out = _filled(raw, family)
    out["tie_word_embeddings"] = tied(raw)
    flat = family == "qwen2_5_vl" and not isinstance(config.get("text_config"), Mapping)
    section = "" if flat else "llm_config." if config.get("model_type") == "internvl_chat" else "text_config."
    out["text_config"] = _text(raw.get("text_config") or {}, family, f"{where}: {section}")
    out["vision_config"] = _vision(raw.get("vision_config") or {}, family, where)
    return out


def rope_exact_positions(text: Mapping[str, Any]) -> int | None:
    """Positions below this bound are computed exactly (a `dynamic` rotary: max_position_embeddings,
    where transformers starts rescaling); None: every position is."""
    if text["rope_parameters"]["rope_type"] in ROPE_EXACT_BELOW_MAX:
        return int(text["max_position_embeddings"])
    return None
