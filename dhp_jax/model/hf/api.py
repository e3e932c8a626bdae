"""Load, run and save Hugging Face checkpoints of the supported families (no transformers needed)."""

from __future__ import annotations

import os
from types import ModuleType
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from dhp_jax.data.hf_config import checkpoint_dir
from dhp_jax.model.attention import dense_attention
from dhp_jax.model.hf import moe, safetensors_io
from dhp_jax.model.hf.checkpoint import saved_weights, tree_from_weights, weights_from_tree
from dhp_jax.model.hf.config import HFConfig, read_config_json, write_pretrained
from dhp_jax import models
from dhp_jax.model.hf.families import hf_module, parse_config
from dhp_jax.model.hf.layers import AttentionFn, Params
from dhp_jax.model.hf.text import lm_head

LM_HEAD = "lm_head.weight"


def init_shapes(config: HFConfig) -> dict[str, tuple[int, ...]]:
    """{transformers name: torch shape} of every weight of `config` (`init.weight_shapes`)."""
    from dhp_jax.model.hf.init import weight_shapes
    return {name: shape for name, (_, shape) in weight_shapes(config).items()}


def family_module(family: str) -> ModuleType:
    """The family's JAX module (`FamilySpec.jax_module`: its `hidden` forward); its model side without
    jax (config, renames, host arrays) is `families.hf_module`."""
    return models.spec(family).engine_module("jax")


def load_config(path: str) -> HFConfig:
    """The HFConfig of a checkpoint directory's config.json (no weights read); `path` may be a Hub
    id in the local Hugging Face cache (`dhp_jax.data.hf_config.checkpoint_dir`)."""
    path = checkpoint_dir(path)
    return parse_config(read_config_json(path), where=os.path.join(path, "config.json"))


def load_pretrained(path: str, dtype: str = "float32") -> tuple[HFConfig, dict]:
    """(config, params) of a directory written by transformers' `save_pretrained` (or a Hub id in
    the local Hugging Face cache): config.json and model.safetensors (or its shards, with
    model.safetensors.index.json), read memory-mapped and converted leaf by leaf to `dtype`.
    Weights under the published checkpoints' older names are renamed as transformers renames them."""
    path = checkpoint_dir(path)
    config = load_config(path)
    target = jnp.dtype(dtype)
    named = safetensors_io.read_checkpoint(path)
    if config.text.moe is not None:     # the experts' published layout -> transformers' fused one
        named = moe.load_experts(named, moe.layout_of(hf_module(config.family)), init_shapes(config))
    params = tree_from_weights(named, hf_module(config.family).LEGACY_RENAMES,
                               skip=(LM_HEAD,) if config.tied else (),
                               convert=lambda a: jnp.asarray(np.asarray(a, dtype=target)))
    check_params(config, params)
    return config, params


def check_params(config: HFConfig, params: Mapping) -> None:
    """Raise if the tree lacks the top-level parts the forward pass reads."""
    need = [("model", "language_model", "embed_tokens"), ("model", "language_model", "norm")]
    if not config.tied:
        need.append(("lm_head",))
    for path in need:
        node = params
        for key in path:
            if not isinstance(node, Mapping) or key not in node:
                raise ValueError(f"{config.family} checkpoint has no {'.'.join(path)}.* weights")
            node = node[key]


def prepare(config: HFConfig, inputs: Mapping[str, Any]) -> dict[str, Any]:
    """The host-side arrays of one processor output (token ids, rotary positions, encoder ids)."""
    return hf_module(config.family).prepare(config, inputs)


def hidden_states(config: HFConfig, params: Params, inputs: Mapping[str, Any],
                  attn_fn: AttentionFn = dense_attention) -> jax.Array:
    """Final LLM hidden states [L, d] of one sample (before the LM head)."""
    return family_module(config.family).hidden(config, params, prepare(config, inputs), attn_fn)


def logits(config: HFConfig, params: Params, inputs: Mapping[str, Any],
           attn_fn: AttentionFn = dense_attention) -> jax.Array:
    """float32[L, vocab] logits of one sample, `inputs` as the family's processor emits them
    (batch size 1); `attn_fn` is the attention every block calls (the engine hands in its own)."""
    return lm_head(params, hidden_states(config, params, inputs, attn_fn), config.tied)


def to_state_dict(config: HFConfig, tree: Mapping) -> dict[str, np.ndarray]:
    """{transformers parameter name: numpy array} of a parameter or gradient tree. A tied LM head
    appears once, as the embedding (`lm_head.weight` is not repeated)."""
    conv = hf_module(config.family).conv_shapes(config)
    # on the host first: transposing device arrays would compile one program per leaf shape
    return {k: np.ascontiguousarray(v) for k, v in weights_from_tree(jax.tree.map(np.asarray, tree), conv).items()}


def save_pretrained(config: HFConfig, params: Params, out_dir: str, max_shard_bytes: int = 5 * 2**30) -> None:
    """Write config.json and model.safetensors (sharded above `max_shard_bytes`) that transformers'
    `from_pretrained` loads. The weights keep the dtype of `params`; config.json its own fields; the
    names are those transformers' `save_pretrained` writes for the family, a mixture of experts'
    experts in its releases' layout (`checkpoint.saved_weights`, as the torch backend's
    `npu_backend.hf.save_family` writes them)."""
    weights = saved_weights(to_state_dict(config, params), hf_module(config.family), config.text.moe is not None)
    write_pretrained(out_dir, config.raw, weights, max_shard_bytes)
