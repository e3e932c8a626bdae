"""The params tree of a family model as shapes only (`jax.ShapeDtypeStruct`), for abstract compiles.

`abstract_params(config)` maps the weight names and shapes of the config (`hf.init.weight_shapes`,
transformers' state-dict names; nothing allocated) to our tree by the checkpoint rule
(`dhp_jax.model.hf.checkpoint`), so the tree is exactly the one `load_pretrained` gives for a
checkpoint of that config (a test holds the names and shapes to transformers' own model). `with_depth` makes the same config with fewer layers (the memory bench
compiles a few layers and extrapolates: `dhp_jax.sharding.family_memory`).
"""

from __future__ import annotations

import copy
from typing import Any, Mapping

import jax
import jax.numpy as jnp

from dhp_jax.model.hf.checkpoint import leaf_shape, tree_from_weights


def abstract_params(config: Any, dtype: Any = jnp.float32) -> dict:
    """The params tree of family config `config` (an `HFConfig`) as `jax.ShapeDtypeStruct`s."""
    from dhp_jax.model.hf.api import LM_HEAD, family_module
    from dhp_jax.model.hf.init import weight_shapes
    renames = family_module(config.family).LEGACY_RENAMES
    return tree_from_weights(((k, s) for k, (_, s) in weight_shapes(config).items()), renames,
                             skip=(LM_HEAD,) if config.tied else (),
                             leaf=leaf_shape, convert=lambda shape: jax.ShapeDtypeStruct(shape, jnp.dtype(dtype)))


def with_depth(raw: Mapping[str, Any], layers: int, vision_layers: int) -> dict:
    """config.json dict `raw` with `layers` LLM layers and `vision_layers` encoder blocks. The
    blocks that differ keep their count where the depth allows: Qwen3-VL's DeepStack blocks become
    the first ones (their features are added to the first LLM layers), Qwen2.5-VL's
    full-attention blocks the last ones."""
    out = copy.deepcopy(dict(raw))
    out["text_config"]["num_hidden_layers"] = int(layers)
    v = out["vision_config"]
    v["depth" if "depth" in v else "num_hidden_layers"] = int(vision_layers)
    if "deepstack_visual_indexes" in v:
        v["deepstack_visual_indexes"] = list(range(min(len(v["deepstack_visual_indexes"]), vision_layers)))
    if "fullatt_block_indexes" in v:
        k = min(len(v["fullatt_block_indexes"]), vision_layers)
        v["fullatt_block_indexes"] = list(range(vision_layers - k, vision_layers))
    return out
