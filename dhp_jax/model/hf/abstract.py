"""The params tree of a family model as shapes only (`jax.ShapeDtypeStruct`), for abstract compiles.

`abstract_params(config)` maps the weight names and shapes of the config (`hf.init.weight_shapes`,
transformers' state-dict names; nothing allocated) to our tree by the checkpoint rule
(`dhp_jax.model.hf.checkpoint`), so the tree is exactly the one `load_pretrained` gives for a
checkpoint of that config (a test holds the names and shapes to transformers' own model). The memory
bench (`dhp_jax.sharding.family_memory`) compiles a few layers of a config made shallower by
`dhp_jax.model.hf.config.with_depth` and extrapolates.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from dhp_jax.model.hf.checkpoint import leaf_shape, tree_from_weights


def abstract_params(config: Any, dtype: Any = jnp.float32) -> dict:
    """The params tree of family config `config` (an `HFConfig`) as `jax.ShapeDtypeStruct`s."""
    from dhp_jax.model.hf.api import LM_HEAD
    from dhp_jax.model.hf.families import hf_module
    from dhp_jax.model.hf.init import weight_shapes
    renames = hf_module(config.family).LEGACY_RENAMES
    return tree_from_weights(((k, s) for k, (_, s) in weight_shapes(config).items()), renames,
                             skip=(LM_HEAD,) if config.tied else (),
                             leaf=leaf_shape, convert=lambda shape: jax.ShapeDtypeStruct(shape, jnp.dtype(dtype)))
