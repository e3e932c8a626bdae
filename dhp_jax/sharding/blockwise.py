"""Local attention in tiles with a hand-written backward: memory O(block^2) per head, not O(S_q S_k).

`blockwise_attention(q, k, v, q_ids, k_ids, block)` gives the same result as
`dhp_jax.model.attention.dense_attention` on one device. Queries and keys both go `block` tokens
at a time: for each query tile the forward folds every key block into an online softmax (the same
`fold_block` as the ring) and keeps only the output and the row log-sum-exp; the backward
recomputes each tile's probabilities from them (the flash-attention recurrence), so neither pass
holds more than one [H, block, block] score tile and its [block, block] mask. A tile with no
allowed (query, key) pair is skipped. The Ulysses group attention runs it on the whole
head-sharded stream with block = the local length S_l, where plain autodiff would keep a score
tile per block: per-device memory then stays flat in the degree.
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


def _id_blocks(ids: AttnIds, block: int) -> AttnIds:
    return AttnIds(*(_blocks(x, block) for x in ids))


def _forward_tile(q, kb, vb, q_ids: AttnIds, kb_ids: AttnIds):
    """One query tile over every key block: (o[S_t, H, D], lse[H, S_t])."""
    s_t, h, d = q.shape
    acc = (jnp.full((h, s_t), NEG, jnp.float32), jnp.zeros((h, s_t), jnp.float32),
           jnp.zeros((h, s_t, d), jnp.float32))

    def step(acc, kv):
        k, v, ids = kv
        return fold_block(acc, q, k, v, q_ids, AttnIds(*ids)), None

    (m, l, o), _ = lax.scan(step, acc, (kb, vb, tuple(kb_ids)))
    empty = l == 0                                                      # rows with no key -> 0
    out = o / jnp.where(empty, 1.0, l)[..., None]                      # out[H, S_t, D]
    lse = jnp.where(empty, 0.0, m + jnp.log(jnp.where(empty, 1.0, l)))
    return jnp.transpose(out, (1, 0, 2)), lse


def _forward(q, k, v, q_ids: AttnIds, k_ids: AttnIds, block: int):
    """(o[S_q, H, D], lse[S_q / block, H, block]): query tiles one after another."""
    kb, vb, kb_ids = _blocks(k, block), _blocks(v, block), _id_blocks(k_ids, block)
    tile = lambda x: _forward_tile(x[0], kb, vb, AttnIds(*x[1]), kb_ids)
    out, lse = lax.map(tile, (_blocks(q, block), tuple(_id_blocks(q_ids, block))))
    return out.reshape(q.shape), lse


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
    fold = lambda x: x.reshape(x.shape[0], -1, group, x.shape[-1]).sum(axis=2)   # GQA: sum a KV head's readers
    kb, vb, kb_ids = _blocks(k, block), _blocks(v, block), _id_blocks(k_ids, block)

    def q_tile(dkv, xs):
        qt, dot, ot, lt, ids = xs
        qt_ids = AttnIds(*ids)
        delta = jnp.einsum("qhd,qhd->hq", dot, ot)                     # delta[H, S_t]

        def k_block(dq, kv):
            kk, vv, kids = kv
            mask = attention_mask(qt_ids, AttnIds(*kids))               # mask[S_t, block]

            def compute(dq):
                kr, vr = repeat_kv(kk, group), repeat_kv(vv, group)
                s = jnp.einsum("qhd,khd->hqk", qt, kr) * scale
                p = jnp.where(mask[None], jnp.exp(s - lt[..., None]), 0.0)  # p[H, S_t, block]
                dv = jnp.einsum("hqk,qhd->khd", p, dot)
                ds = p * (jnp.einsum("qhd,khd->hqk", dot, vr) - delta[..., None])
                dk = jnp.einsum("hqk,qhd->khd", ds, qt) * scale
                return dq + jnp.einsum("hqk,khd->qhd", ds, kr) * scale, (fold(dk), fold(dv))

            zeros = (jnp.zeros_like(kk), jnp.zeros_like(vv))
            return lax.cond(jnp.any(mask), compute, lambda dq: (dq, zeros), dq)

        dq, (dk, dv) = lax.scan(k_block, jnp.zeros_like(qt), (kb, vb, tuple(kb_ids)))
        return (dkv[0] + dk, dkv[1] + dv), dq

    xs = (_blocks(q, block), _blocks(dout, block), _blocks(out, block), lse, tuple(_id_blocks(q_ids, block)))
    (dk, dv), dq = lax.scan(q_tile, (jnp.zeros_like(kb), jnp.zeros_like(vb)), xs)
    int_zero = lambda ids: AttnIds(*(jnp.zeros(x.shape, jax.dtypes.float0) for x in ids))
    return dq.reshape(q.shape), dk.reshape(k.shape), dv.reshape(v.shape), int_zero(q_ids), int_zero(k_ids)


_attention.defvjp(_attention_fwd, _attention_bwd)


def blockwise_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_ids: AttnIds, k_ids: AttnIds,
                        block: int) -> jax.Array:
    """o[S_q, H, D] of q[S_q, H, D] over k, v[S_k, KVH, D] (H % KVH == 0), `block` keys at a time.

    `block` must divide S_q and S_k: queries and keys both go `block` at a time. Rows with no
    allowed key give zeros (and zero gradients).
    """
    if block < 1 or k.shape[0] % block or q.shape[0] % block:
        raise ValueError(f"block {block} does not divide the {q.shape[0]} queries and {k.shape[0]} keys")
    if q.shape[1] % k.shape[1] or v.shape != k.shape:
        raise ValueError(f"q{q.shape} and k{k.shape}, v{v.shape}: query heads must be a multiple of KV heads")
    return _attention(q, k, v, q_ids, k_ids, int(block))
