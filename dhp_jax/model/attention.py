"""Attention masks from token ids, and plain (dense, one-device) attention.

Every attention call of the model receives `q[S_q, H, D]`, `k, v[S_k, KVH, D]` and, for each side,
`AttnIds(segment, position, span)` int32 vectors. The mask is computed from ids only, never from
the order of tokens in the stream, so a permuted (zigzag) or sharded stream gives the same result:

    allowed(q, k) = seg_q == seg_k  and  seg_q > 0
                    and (pos_k <= pos_q  or  (span_q == span_k and span_q > 0))

segment 0 is padding (attends nowhere, is attended by nothing); span > 0 marks a bidirectional
span (a vision segment in the decoder, a frame in the vision encoder); everything else is causal.
The ring attention of `dhp_jax.sharding` uses the same `attention_mask`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class AttnIds(NamedTuple):
    """Per-token ids that define the mask: segment (0 = pad), position, bidirectional span (0 = none)."""

    segment: jax.Array
    position: jax.Array
    span: jax.Array


def attention_mask(q_ids: AttnIds, k_ids: AttnIds) -> jax.Array:
    """bool[S_q, S_k]: which keys each query may attend to."""
    same = (q_ids.segment[:, None] == k_ids.segment[None, :]) & (q_ids.segment[:, None] > 0)
    causal = k_ids.position[None, :] <= q_ids.position[:, None]
    bidir = (q_ids.span[:, None] == k_ids.span[None, :]) & (q_ids.span[:, None] > 0)
    return same & (causal | bidir)


def repeat_kv(x: jax.Array, group: int) -> jax.Array:
    """[S, KVH, D] -> [S, KVH*group, D]; query head h reads kv head h // group."""
    return jnp.repeat(x, group, axis=1) if group > 1 else x


def dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_ids: AttnIds, k_ids: AttnIds) -> jax.Array:
    """Softmax attention over the whole stream at once; rows with no allowed key return zeros."""
    group = q.shape[1] // k.shape[1]
    k, v = repeat_kv(k, group), repeat_kv(v, group)
    scale = 1.0 / jnp.sqrt(jnp.float32(q.shape[-1]))
    s = jnp.einsum("qhd,khd->hqk", q, k, preferred_element_type=jnp.float32) * scale  # s[H, S_q, S_k] fp32
    mask = attention_mask(q_ids, k_ids)[None]
    m = jax.lax.stop_gradient(jnp.max(jnp.where(mask, s, -1e30), axis=-1, keepdims=True))
    p = jnp.exp(jnp.where(mask, s - m, -jnp.inf))
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(denom > 0, denom, 1.0)
    return jnp.einsum("hqk,khd->qhd", p.astype(v.dtype), v, preferred_element_type=jnp.float32).astype(q.dtype)
