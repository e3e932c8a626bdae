"""The one reader of a Hugging Face `config.json` of the registered families (`dhp_jax.models`),
read as transformers reads it; every other part (the engine `dhp_jax.model.hf`, the torch backend
`npu_backend.hf`, the planner's `ModelFacts`) takes its fields from `resolve`.

Layouts accepted: each family's nested transformers layout, and what its `ConfigRules` converts
(`nest`: Qwen2.5-VL's flat releases, the text fields at the top level; `layouts`: InternVL's own
chat layout `internvl_chat`, converted field by field as InternVL's conversion to `-hf` does).

`resolve` gives one dict in the nested transformers-5 layout in which every field the project
reads is present: a field absent from config.json gets transformers' default for that config's
model type (`FIELDS`, the families' rows; `tests/test_published_layouts.py` builds every transformers config
class with only its required fields and compares). Rotary parameters are read from
`rope_parameters` or `rope_scaling` (the latter wins, as in transformers), `type` or `rope_type`,
`rope_theta` inside or beside them; the LM head is tied by transformers' rule (`tied`).

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

from dhp_jax import models
from dhp_jax.data.jsonl import read_json_file

# Rotary fields: read from rope_parameters / rope_scaling (`rope_theta` also beside them); the
# M-RoPE split's default is the rotary module's (Qwen2_5_VLRotaryEmbedding, Qwen3VLTextRotaryEmbedding)
ROPE_KEYS = ("rope_theta", "mrope_section")

# Field names transformers' config classes map onto a field of FIELDS (their `attribute_map`):
# Qwen3MoeConfig / Qwen3VLMoeTextConfig write `num_experts` as `num_local_experts`
ALIASES = {"num_local_experts": "num_experts"}

# Derived defaults (transformers computes them from other fields of the same config)
HEADS = "=num_attention_heads"            # num_key_value_heads absent or null: one KV head per query head
WIDTH_OVER_HEADS = "=hidden_size//num_attention_heads"   # head_dim absent or null

# Each family's rows (every field the project reads, per config class, with transformers 5's
# default), its text and vision model types and its layouts are its `FamilySpec.config`
# (`dhp_jax.models`). `FIELDS` ({model_type: {field: default}}) and `FAMILIES` are those of the
# registered families.


def __getattr__(name: str):
    if name == "FIELDS":
        return models.fields()
    if name == "FAMILIES":
        return models.names()
    if name == "TEXT_TYPES":
        return {s.name: s.config.text_types for s in models.specs()}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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


def nested(config: Mapping[str, Any]) -> dict[str, Any]:
    """The nested transformers layout of a config dict (a copy; absent fields stay absent): the
    family's `ConfigRules.nest` (a flat file gets its text_config) or the converter of another
    layout it reads (`ConfigRules.layouts`). The result is still a config.json transformers loads."""
    config = copy.deepcopy(dict(config))
    family = models.spec_for_type(str(config.get("model_type")))
    if family is None:
        return config
    rules = family.config
    if config.get("model_type") in rules.layouts:
        return rules.layouts[config["model_type"]](config)
    return rules.nest(config) if rules.nest else config


def _default(cfg: Mapping[str, Any], key: str, default: Any) -> Any:
    if default == HEADS:
        return cfg["num_attention_heads"]
    if default == WIDTH_OVER_HEADS:
        return cfg["hidden_size"] // cfg["num_attention_heads"]
    return copy.deepcopy(default)


def _filled(cfg: Mapping[str, Any], model_type: str) -> dict[str, Any]:
    """`cfg` with every field of FIELDS[model_type] present (transformers' default where absent;
    a derived default where absent or null)."""
    table = models.fields()[model_type]
    out = dict(cfg)
    for alias, key in ALIASES.items():           # the configs' attribute_map: both names, one field
        if key in table and key not in out and alias in out:
            out[key] = out[alias]
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


def _text(t: Mapping[str, Any], family: models.FamilySpec, where: str) -> dict[str, Any]:
    """The resolved text_config; `where` prefixes the field names in errors ("FILE: text_config.",
    or "FILE: " for a flat file)."""
    types = family.config.text_types
    model_type = t.get("model_type") or types[0]
    if model_type not in types:
        raise ValueError(f"{where}model_type {model_type!r} is not supported for {family.name} "
                         f"(known: {', '.join(types)})")
    out = _filled(t, model_type)
    out["rope_parameters"] = _rope(t, family.config.fields[model_type], where)
    out["rope_theta"] = out["rope_parameters"]["rope_theta"]
    out.pop("rope_scaling", None)
    if out.get("use_sliding_window"):
        raise ValueError(f"{where}use_sliding_window: sliding-window attention is not supported")
    heads, kv = int(out["num_attention_heads"]), int(out["num_key_value_heads"])
    if heads % kv:
        raise ValueError(f"{where}num_attention_heads {heads} is not a multiple of "
                         f"num_key_value_heads {kv}")
    return out


def _vision(v: Mapping[str, Any], family: models.FamilySpec, where: str) -> dict[str, Any]:
    want = family.config.vision_type
    model_type = v.get("model_type") or want
    model_type = family.config.vision_aliases.get(model_type, model_type)
    if model_type != want:
        raise ValueError(f"{where}: vision_config.model_type {model_type!r} is not {want!r}")
    out = _filled(v, model_type)
    table = family.config.fields[model_type]
    if "rope_theta" in table:
        rope = dict(v.get("rope_parameters") or {})
        out["rope_theta"] = float(rope.get("rope_theta", v.get("rope_theta", table["rope_theta"])))
    return out


def tied(config: Mapping[str, Any]) -> bool:
    """Whether transformers 5 ties the LM head to the token embedding, of a nested config: the
    model's top-level flag (its default in the family's rows); a family whose `ConfigRules.tie_text`
    is set (Qwen2.5-VL, `Qwen2_5_VLConfig.__post_init__`) also ties when text_config says so."""
    family = models.spec(config.get("model_type"))
    top = bool(config.get("tie_word_embeddings", family.config.fields[family.name]["tie_word_embeddings"]))
    if family.config.tie_text:
        return top or bool((config.get("text_config") or {}).get("tie_word_embeddings", False))
    return top


def resolve(config: Mapping[str, Any], where: str = "config.json") -> dict[str, Any]:
    """The config as transformers reads it: nested layout, every field the project reads present
    (`FIELDS`), `text_config.rope_parameters` standardised, `tie_word_embeddings` the resolved
    flag. `where` names the file in errors."""
    raw = nested(config)
    family = models.spec_for_type(str(raw.get("model_type")))
    if family is None or raw.get("model_type") != family.name:
        layouts = [t for s in models.specs() for t in s.config.layouts]
        raise ValueError(f"{where}: model_type {raw.get('model_type')!r} is not one of {', '.join(models.names())}"
                         + (f" (or {', '.join(layouts)})" if layouts else ""))
    for key in ("text_config", "vision_config"):
        if raw.get(key) is not None and not isinstance(raw.get(key), Mapping):
            raise ValueError(f"{where}: {key} is not an object")
    out = _filled(raw, family.name)
    out["tie_word_embeddings"] = tied(raw)
    section = family.config.text_section(config)
    out["text_config"] = _text(raw.get("text_config") or {}, family, f"{where}: {section}")
    out["vision_config"] = _vision(raw.get("vision_config") or {}, family, where)
    return out


def rope_exact_positions(text: Mapping[str, Any]) -> int | None:
    """Positions below this bound are computed exactly (a `dynamic` rotary: max_position_embeddings,
    where transformers starts rescaling); None: every position is."""
    if text["rope_parameters"]["rope_type"] in ROPE_EXACT_BELOW_MAX:
        return int(text["max_position_embeddings"])
    return None
