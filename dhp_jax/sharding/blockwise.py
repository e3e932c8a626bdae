"""Local attention over key blocks with a hand-written backward: memory O(S_q * block), not O(S_q * S_k).

`blockwise_attention(q, k, v, q_ids, k_ids, block)` gives the same result as
`dhp_jax.model.attention.dense_attention` on one device. The forward folds one key block of
`block` tokens at a time into an online softmax (the same `fold_block` as the ring) and keeps only
the output and the row log-sum-exp; the backward recomputes each block's probabilities from them
(the flash-attention recurrence), so neither pass ever holds more than one [H, S_q, block] score
tile. A block with no allowed (query, key) pair is skipped. The Ulysses group attention runs it on
the whole (head-sharded) stream, where plain autodiff would store a score tile per block.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from dhp_jax.model.attention import AttnIds, attention_mask, repeat_kv
from dhp_jax.sharding.ring import _NEG as NEG, _fold_block as fold_block  # the ring's online-softmax step


def _blocks(x: jax.Array, block: int) -> jax.Array:
    """x[S, ...] -> [S / block, block, ...]."""
    return x.reshape(x.shape[0] // block, block, *x.shape[1:])


def _forward(q, k, v, q_ids: AttnIds, k_ids: AttnIds, block: int):
    s_q, h, d = q.shape
    acc = (jnp.full((h, s_q), NEG, jnp.float32), jnp.zeros((h, s_q), jnp.float32),
           jnp.zeros((h, s_q, d), jnp.float32))

    def step(acc, kv):
        kb, vb, ids = kv
        return fold_block(acc, q, kb, vb, q_ids, AttnIds(*ids)), None

    xs = (_blocks(k, block), _blocks(v, block), tuple(_blocks(x, block) for x in k_ids))
    (m, l, o), _ = lax.scan(step, acc, xs)
    empty = l == 0                                                      # rows with no key -> 0
    out = o / jnp.where(empty, 1.0, l)[..., None]                      # out[H, S_q, D]
    lse = jnp.where(empty, 0.0, m + jnp.log(jnp.where(empty, 1.0, l)))  # lse[H, S_q]
    return jnp.transpose(out, (1, 0, 2)), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _attention(q, k, v, q_ids, k_ids, block):
    return _forward(q, k, v, q_ids, k_ids, block)[0]


def _attention_fwd(q, k, v, q_ids, k_ids, block):
    out, lse = _forward(q, k, v, q_ids, k_ids, block)
    return out, (q, k, v, q_ids, k_ids, out, lse)


def _attention_bwd(block, res, dout):
    q, k, v, q_ids, k_ids, out, lse = res
    group = q.shape[1] // k.shape[1]
    scale = 1.0 / jnp.sqrt(jnp.float32(q.shape[-1]))
    delta = jnp.einsum("qhd,qhd->hq", dout, out)                        # delta[H, S_q]

    def step(dq, kv):
        kb, vb, ids = kv
        mask = attention_mask(q_ids, AttnIds(*ids))                     # mask[S_q, block]

        def compute(dq):
            kk, vv = repeat_kv(kb, group), repeat_kv(vb, group)
            s = jnp.einsum("qhd,khd->hqk", q, kk) * scale
            p = jnp.where(mask[None], jnp.exp(s - lse[..., None]), 0.0)  # p[H, S_q, block]
            dv = jnp.einsum("hqk,qhd->khd", p, dout)
            ds = p * (jnp.einsum("qhd,khd->hqk", dout, vv) - delta[..., None])
            dk = jnp.einsum("hqk,qhd->khd", ds, q) * scale
            fold = lambda x: x.reshape(x.shape[0], -1, group, x.shape[-1]).sum(axis=2)  # GQA heads
            return dq + jnp.einsum("hqk,khd->qhd", ds, kk) * scale, (fold(dk), fold(dv))

        zeros = (jnp.zeros_like(kb), jnp.zeros_like(vb))
        return lax.cond(jnp.any(mask), compute, lambda dq: (dq, zeros), dq)

    xs = (_blocks(k, block), _blocks(v, block), tuple(_blocks(x, block) for x in k_ids))
    dq, (dk, dv) = lax.scan(step, jnp.zeros_like(q), xs)
    int_zero = lambda ids: AttnIds(*(jnp.zeros(x.shape, jax.dtypes.float0) for x in ids))
    return dq, dk.reshape(k.shape), dv.reshape(v.shape), int_zero(q_ids), int_zero(k_ids)


_attention.defvjp(_attention_fwd, _attention_bwd)


def blockwise_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_ids: AttnIds, k_ids: AttnIds,
                        block: int) -> jax.Array:
    """o[S_q, H, D] of q[S_q, H, D] over k, v[S_k, KVH, D] (H % KVH == 0), `block` keys at a time.

    `block` must divide S_k. Rows with no allowed key give zeros (and zero gradients).
    """
    s_k = k.shape[0]
    if block < 1 or s_k % block:
        raise ValueError(f"key block {block} does not divide the {s_k} keys")
    if q.shape[1] % k.shape[1] or v.shape != k.shape:
        raise ValueError(f"q{q.shape} and k{k.shape}, v{v.shape}: query heads must be a multiple of KV heads")
    return _attention(q, k, v, q_ids, k_ids, int(block))
