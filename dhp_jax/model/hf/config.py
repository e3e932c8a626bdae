"""`HFConfig`: a checkpoint's config.json, parsed once into what the forward pass needs."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from typing import Any, Mapping

from dhp_jax.data import hf_config
from dhp_jax.model.hf import safetensors_io
from dhp_jax.model.hf.spec import TextConfig

REMATS = ("none", "layer", "selective")      # `dhp_jax.model.mllm.REMAT_POLICIES`


@dataclasses.dataclass(frozen=True, eq=False)
class HFConfig:
    """One model of a supported family. `raw` is config.json as read (written back unchanged by
    `save_pretrained`); `fields` the same as transformers reads it (`dhp_jax.data.hf_config.resolve`:
    nested layout, every field the project reads present); `text` the LLM's shape; `vision` the
    family's own vision-encoder config;
    `tied`: the LM head is the token embedding; `token_ids`: placeholder ids ("image", "video").

    How the engine runs the blocks (run-time choices, never values; `MLLMConfig`'s fields of the
    same names): `remat`, the recompute of every LLM and encoder block in the backward pass
    ("none", "layer", "selective"); `linear_chunk`, rows per chunk of the blocks' token-local work
    with the chunks of padding (and of the vision stream's dead rows) skipped (0: one pass;
    `PlanExecutor(linear_chunk=...)` sets it)."""

    family: str
    raw: Mapping[str, Any]
    text: TextConfig
    vision: Any
    tied: bool
    token_ids: Mapping[str, int]
    remat: str = "none"
    linear_chunk: int = 0

    def __post_init__(self) -> None:
        if self.remat not in REMATS:
            raise ValueError(f"HFConfig.remat must be one of {REMATS}, got {self.remat!r}")
        if isinstance(self.linear_chunk, bool) or not isinstance(self.linear_chunk, int) or self.linear_chunk < 0:
            raise ValueError(f"HFConfig.linear_chunk must be an integer >= 0 (0: no chunks), got {self.linear_chunk!r}")

    @functools.cached_property
    def fields(self) -> Mapping[str, Any]:
        return hf_config.resolve(self.raw)

    @property
    def vocab_size(self) -> int:
        return self.text.vocab_size

    @property
    def num_heads(self) -> int:
        """The LLM's query heads (what a Ulysses group splits)."""
        return self.text.shape.num_heads

    @property
    def name(self) -> str:
        return str(self.raw.get("_name_or_path") or self.family)


def read_config_json(path: str) -> dict:
    """config.json of a checkpoint directory (`dhp_jax.data.hf_config.read_config`)."""
    return hf_config.read_config(os.fspath(path))


def write_pretrained(out_dir: str, raw: Mapping[str, Any], weights: Mapping[str, Any], max_shard_bytes: int) -> None:
    """Write `weights` ({transformers name: numpy array}) as safetensors (sharded above
    `max_shard_bytes`) and config.json (`raw`, with `dtype` set to the weights' when they share one)."""
    os.makedirs(out_dir, exist_ok=True)
    safetensors_io.write_checkpoint(out_dir, weights, max_shard_bytes)
    raw = dict(raw)
    dtypes = {str(w.dtype) for w in weights.values()}
    if len(dtypes) == 1:
        raw["dtype"] = dtypes.pop()
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(raw, f, indent=2, sort_keys=True)


# vision-config fields that list special blocks by index, and whether they sit at the end
SPECIAL_BLOCKS = (("deepstack_visual_indexes", False), ("fullatt_block_indexes", True))


def with_depth(raw: Mapping[str, Any], layers: int, vision_layers: int, spread: bool = False) -> dict:
    """config.json dict `raw` with `layers` LLM layers and `vision_layers` encoder blocks. The
    blocks that differ (Qwen3-VL's DeepStack blocks, Qwen2.5-VL's full-attention blocks) keep
    their count where the depth allows, as the first blocks (DeepStack: their features are added
    to the first LLM layers) or the last ones (full attention); `spread`: at the same places in
    proportion instead (block i of D goes to round(i * vision_layers / D), one block per place).
    A block list the file leaves out is transformers' default list. The result is in the nested
    layout (`dhp_jax.data.hf_config.nested`)."""
    out = hf_config.nested(raw)
    out["text_config"]["num_hidden_layers"] = int(layers)
    full = hf_config.resolve(out)["vision_config"]
    v = out.setdefault("vision_config", {})
    key = "depth" if "depth" in full else "num_hidden_layers"
    old, n = int(full[key]), int(vision_layers)
    v[key] = n
    for field, at_end in SPECIAL_BLOCKS:
        if field not in full:
            continue
        v[field] = list(full[field])
        if spread:
            v[field] = sorted({min(n - 1, round(i * n / old)) for i in v[field]})
        else:
            k = min(len(v[field]), n)
            v[field] = list(range(n - k, n)) if at_end else list(range(k))
    return out
