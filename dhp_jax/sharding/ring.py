"""Ring attention for any CP degree, written for the body of a `shard_map` over one mesh axis.

Each device holds `q[S_l, H, D]`, `k, v[S_l, KVH, D]` and the ids of its S_l = S/degree tokens
(two zigzag chunks). K/V and their ids travel around the ring with `ppermute` (device i sends to
i+1 mod degree) for degree-1 steps; every step folds one K/V block into an online softmax
(running max m[H, S_l], denominator l[H, S_l], numerator o[H, S_l, D], all fp32 whatever the
compute dtype of q, k, v). Masks come from ids
(`dhp_jax.model.attention.attention_mask`), so order inside the stream does not matter. A block
with no allowed (query, key) pair is skipped with `lax.cond` (other samples, future chunks).
Gradients come from autodiff: the transpose of `ppermute` is the reverse ring.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from dhp_jax.model.attention import AttnIds, attention_mask, repeat_kv

_NEG = -1e30


def _fold_block(acc, q, k, v, q_ids: AttnIds, k_ids: AttnIds):
    """Fold one K/V block into the online-softmax state (m, l, o)."""
    m, l, o = acc
    mask = attention_mask(q_ids, k_ids)                                   # mask[S_q, S_k]

    def compute(_):
        group = q.shape[1] // k.shape[1]
        kk, vv = repeat_kv(k, group), repeat_kv(v, group)
        s = jnp.einsum("qhd,khd->hqk", q, kk, preferred_element_type=jnp.float32) / jnp.sqrt(jnp.float32(q.shape[-1]))
        # The running max only stabilises exp(); the result does not depend on it.
        m_new = lax.stop_gradient(jnp.maximum(m, jnp.max(jnp.where(mask[None], s, _NEG), axis=-1)))
        p = jnp.exp(jnp.where(mask[None], s - m_new[..., None], -jnp.inf))  # p[H, S_q, S_k]
        corr = jnp.exp(m - m_new)
        return (m_new, l * corr + jnp.sum(p, axis=-1),
                o * corr[..., None] + jnp.einsum("hqk,khd->hqd", p.astype(vv.dtype), vv,
                                                 preferred_element_type=jnp.float32))

    return lax.cond(jnp.any(mask), compute, lambda _: (m, l, o), None)


def ring_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_ids: AttnIds, k_ids: AttnIds, *,
                   axis_name: str, degree: int) -> jax.Array:
    """Attention of the local queries over the whole ring's keys; returns o[S_l, H, D].

    Must run inside `shard_map` with `axis_name` of size `degree`; has the signature of the
    model's attention function once `axis_name` and `degree` are bound.
    """
    s_l, h, d = q.shape
    assert k.shape[0] == s_l and q_ids.segment.shape == (s_l,), (q.shape, k.shape, q_ids.segment.shape)
    acc = (jnp.full((h, s_l), _NEG, jnp.float32), jnp.zeros((h, s_l), jnp.float32),
           jnp.zeros((h, s_l, d), jnp.float32))
    acc = _fold_block(acc, q, k, v, q_ids, k_ids)
    if degree > 1:
        perm = [(i, (i + 1) % degree) for i in range(degree)]

        def step(carry, _):
            acc, kv = carry
            kv = lax.ppermute(kv, axis_name, perm)
            kb, vb, ids = kv
            return (_fold_block(acc, q, kb, vb, q_ids, AttnIds(*ids)), kv), None

        (acc, _), _ = lax.scan(step, (acc, (k, v, tuple(k_ids))), None, length=degree - 1)
    _, l, o = acc
    out = o / jnp.where(l > 0, l, 1.0)[..., None]                         # rows with no key -> 0
    return jnp.transpose(out, (1, 0, 2)).astype(q.dtype)


def ring_attention_fn(axis_name: str, degree: int):
    """The model-facing attention function for a ring of `degree` devices on `axis_name`."""
    return functools.partial(ring_attention, axis_name=axis_name, degree=degree)
