"""The families' forward pass and loss on one device's shard of the packed streams of
`dhp_jax.model.hf.packed` (what a DHP group program runs; the torch twin is `npu_backend.hf`)."""

from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp

from dhp_jax import models
from dhp_jax.model.attention import AttnIds
from dhp_jax.model.hf.config import HFConfig
from dhp_jax.model.hf.layers import AttentionFn, Params
from dhp_jax.model.hf.packed import LLM_INTS, VISION_INTS, patch_dim, unit
from dhp_jax.model.mllm import LOSS_CHUNK, head_loss_sum
from dhp_jax.model.tensor_parallel import TensorHooks, vocab_embed


def _encode(config: HFConfig, params: Params, vi: Mapping[str, jax.Array], pixels: jax.Array,
            tap_weights: jax.Array, attn_fn: AttentionFn, tp: TensorHooks | None = None) -> tuple[jax.Array, list]:
    """(merged features [S, d], DeepStack features [levels] of [S, d]) of a vision stream [S * unit].
    `tp`: tensor parallelism, the encoder's blocks split (sequence-parallel with `tp.sequence`: the
    family's `encode`), the patch embedding and the projector or mergers replicated. The family's
    `encode_stream` (its `jax_model`, `dhp_jax.models.<family>`) runs it on the stream's rows."""
    s = pixels.shape[0] // unit(config)
    live = vi["frame"] > 0               # the rows of vision tokens (the others are dead: nothing reads them)
    return models.spec(config.family).engine_module("jax").encode_stream(config, params, vi, pixels, tap_weights,
                                                                         attn_fn, tp, s, live)


def packed_loss_sum(config: HFConfig, params: Params, llm_ints: jax.Array, llm_floats: jax.Array,
                    vision_ints: jax.Array, vision_floats: jax.Array, attn_fn: AttentionFn,
                    loss_chunk: int = LOSS_CHUNK, tp: TensorHooks | None = None) -> jax.Array:
    """Sum over the stream's tokens of weight * cross entropy (fp32): the family's forward pass on
    one device's shard of the two streams (`FamilyLayout.inputs`), attention by `attn_fn`.
    `tp`: tensor parallelism (`dhp_jax.sharding.tensor_parallel`), `params` one device's share: the LLM
    layers and the encoder's blocks split (`text.text_forward`, `_encode`; sequence-parallel with
    `tp.sequence`), the embedding and the LM head vocab-parallel (`dhp_jax.model.tensor_parallel`), the
    patch embedding and the projector or mergers whole."""
    from dhp_jax.model.hf.text import text_forward
    col = {k: llm_ints[:, i] for i, k in enumerate(LLM_INTS)}
    vi = {k: vision_ints[:, i] for i, k in enumerate(VISION_INTS)}
    width = patch_dim(config)
    lm = params["model"]["language_model"]
    table = lm["embed_tokens"]["embedding"]
    x = table[col["token_ids"]] if tp is None else vocab_embed(table, col["token_ids"], config.vocab_size, tp)
    vision = col["vision"][:, None] > 0
    feats, deep = _encode(config, params, vi, vision_floats[:, :width], vision_floats[:, width:], attn_fn, tp)
    x = jnp.where(vision, feats.astype(x.dtype), x)

    deepstack = jnp.where(vision[None], jnp.stack(deep).astype(x.dtype), 0) if deep else None
    ids = AttnIds(col["segment"], col["position"], jnp.zeros_like(col["segment"]))
    h = text_forward(config.text, lm, x, llm_ints[:, len(LLM_INTS):], ids, attn_fn, deepstack=deepstack,
                     remat=config.remat, chunk=config.linear_chunk, tp=tp)
    kernel = table.T if config.tied else params["lm_head"]["kernel"]
    return head_loss_sum(h, kernel, col["target"], llm_floats[:, 0], loss_chunk, tp, config.vocab_size)
