"""Tiled (flash-style) attention over one query block and one key block, with log-sum-exp.

The local kernel under the ring (`dhp_jax.sharding.ring`) and usable on its own (the local
attention of an all-to-all layout): queries and keys are cut into tiles of `t` tokens, a
(query tile, key tile) pair is computed only when some query of the one may attend some key of
the other, and temporaries are one score tile `s[KVH, G, t, t]`, never `[S_q, S_k]`.

Tiling and skipping follow `dhp_jax.geometry.tiling` (one home for the rule, shared with the torch
ring and the benches): each zigzag chunk is cut into tiles, padded with segment-0 tokens to whole
tiles; the per-tile summaries are computed once per block and travel with it, and a pair is
computed only where `tile_pairs_allowed` says some pair may attend: the kernels loop over the
allowed pairs alone (`allowed_pairs`, a loop whose trip count is their number), so a block that no
query may attend costs nothing but its predicate. The code that computes a pair ticks `tile_pairs_fwd` / `tile_pairs_bwd` (`dhp_jax.model.executed`: nothing
unless counting), so the pairs that ran can be checked against a bench's NumPy count.

Layouts are head-major inside the kernel (`heads_first`): q[n, KVH, G*t, D], k, v[n, KVH, t, D],
so each product is one batched matmul over the KV heads. State of the online softmax for one
query block: m, l[n, KVH, G*t] (running max, denominator), o[n, KVH, G*t, D] (numerator);
`finish` gives out[S, H, D] and lse[n, KVH, G*t] (log-sum-exp, 0 on rows with no allowed key,
whose output is 0).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from dhp_jax.geometry.tiling import (DEFAULT_TILE, TileSpec, count_ring_tiles, from_tiles, summarize,
                                 tile_pairs_allowed, to_tiles)
from dhp_jax.model.attention import AttnIds, attention_mask
from dhp_jax.model.executed import tick

__all__ = ["DEFAULT_TILE", "TileSpec", "count_ring_tiles", "blockwise_attention", "fold", "finish", "backward"]
_NEG = -1e30


class Block(NamedTuple):
    """A key block in tiles, as it travels around a ring: k, v[n, KVH, t, D], ids[n, t], summary[n, 6]."""

    k: jax.Array
    v: jax.Array
    ids: AttnIds
    summary: jax.Array


class Queries(NamedTuple):
    """A query block in tiles, heads first and scaled: q[n, KVH, G*t, D] / sqrt(D) (row g*t + i: query
    head g of the KV head, token i)."""

    q: jax.Array
    ids: AttnIds
    summary: jax.Array


# Head-major tiles keep every product a plain batched matmul over KVH (XLA:CPU runs the
# token-major einsums about 100x slower at the CPU executor's optimisation level 0).
def heads_first(x: jax.Array, spec: TileSpec, kv_heads: int) -> jax.Array:
    """x[S, H, D] -> x[n, KVH, G*t, D]."""
    n, t = spec.num_tiles, spec.size
    x = to_tiles(x, spec, jnp)
    h, d = x.shape[2], x.shape[3]
    x = x.reshape(n, t, kv_heads, h // kv_heads, d).transpose(0, 2, 3, 1, 4)
    return x.reshape(n, kv_heads, h // kv_heads * t, d)


def tokens_first(x: jax.Array, spec: TileSpec) -> jax.Array:
    """Inverse of `heads_first`: x[n, KVH, G*t, ...] -> x[S, H, ...]."""
    n, kvh, gt = x.shape[:3]
    t = spec.size
    x = x.reshape((n, kvh, gt // t, t) + x.shape[3:])
    x = jnp.moveaxis(x, 3, 1)                                              # [n, t, KVH, G, ...]
    return from_tiles(x.reshape((n, t, kvh * (gt // t)) + x.shape[4:]), spec)


def tile_ids(ids: AttnIds, spec: TileSpec) -> tuple[AttnIds, jax.Array]:
    tiled = AttnIds(*(to_tiles(a, spec, jnp) for a in ids))
    return tiled, summarize(*tiled, xp=jnp)


def make_queries(q: jax.Array, ids: AttnIds, spec: TileSpec, kv_heads: int) -> Queries:
    """Query tiles, pre-multiplied by 1/sqrt(D) (one pass over q instead of one per score tile)."""
    return Queries(heads_first(q * (1.0 / math.sqrt(q.shape[-1])), spec, kv_heads), *tile_ids(ids, spec))


def make_block(k: jax.Array, v: jax.Array, ids: AttnIds, spec: TileSpec) -> Block:
    kvh = k.shape[1]
    return Block(heads_first(k, spec, kvh), heads_first(v, spec, kvh), *tile_ids(ids, spec))


def init_state(qs: Queries) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(m, l, o) of the online softmax: m, l[n, KVH, G*t], o[n, KVH, G*t, D]."""
    return (jnp.full(qs.q.shape[:3], _NEG, jnp.float32), jnp.zeros(qs.q.shape[:3], jnp.float32),
            jnp.zeros(qs.q.shape, jnp.float32))


def _masked(mask: jax.Array, s: jax.Array, value: jax.Array, fill: float) -> jax.Array:
    """where(mask, value, fill) for scores s[KVH, G*t, t] and a tile mask[t, t] (broadcast over G)."""
    h, gt, t = s.shape
    shape = (h, gt // mask.shape[0]) + mask.shape
    return jnp.where(mask, value.reshape(shape), fill).reshape(s.shape)


def allowed_pairs(allowed: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(count, index int32[a * b]) of the True entries of allowed[a, b], in row-major order (the
    first `count` of `index`, flat indices r * b + c; the rest 0): the pairs a kernel loop visits."""
    flat = allowed.reshape(-1)
    index = jnp.nonzero(flat, size=flat.shape[0], fill_value=0)[0].astype(jnp.int32)
    return jnp.sum(flat, dtype=jnp.int32), index


def _tile(tree, i: jax.Array):
    """Tile i of every [n, ...] array of `tree` (a dynamic index: no copy of the others)."""
    return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, i, keepdims=False), tree)


def _put(a: jax.Array, i: jax.Array, x: jax.Array) -> jax.Array:
    return lax.dynamic_update_index_in_dim(a, x, i, 0)


def fold(state, qs: Queries, blk: Block):
    """Fold one key block into the online-softmax state.

    The loop runs over the allowed (query tile, key tile) pairs only (`allowed_pairs`, row-major:
    each query tile folds its key tiles in increasing order, as a dense loop over all pairs that
    leaves the others untouched would), so its trip count is the pairs computed, not n_q * n_k: a
    block whose tiles share no segment with the queries costs one predicate, not n_q * n_k
    iterations (the encoder's window and frame attention over a long packed stream)."""
    allowed = tile_pairs_allowed(qs.summary, blk.summary, jnp)                  # allowed[nq, nk]
    nk = allowed.shape[1]
    count, index = allowed_pairs(allowed)

    def pair(c, st):
        i, j = index[c] // nk, index[c] % nk
        q, qid = _tile((qs.q, qs.ids), i)
        k, v, kid = _tile((blk.k, blk.v, blk.ids), j)
        tick("tile_pairs_fwd", q, k)
        m, l, o = _tile(st, i)
        mask = attention_mask(qid, kid)                                         # mask[t, t]
        s = jnp.einsum("hqd,hkd->hqk", q, k)
        m_new = jnp.maximum(m, jnp.max(_masked(mask, s, s, _NEG), axis=-1))
        p = jnp.exp(_masked(mask, s, s - m_new[..., None], -jnp.inf))          # p[KVH, G*t, t]
        corr = jnp.exp(m - m_new)
        new = (m_new, l * corr + jnp.sum(p, axis=-1), o * corr[..., None] + jnp.einsum("hqk,hkd->hqd", p, v))
        return tuple(_put(a, i, x) for a, x in zip(st, new))

    return lax.fori_loop(0, count, pair, tuple(state))


def finish(state, spec: TileSpec) -> tuple[jax.Array, jax.Array]:
    """(out[S, H, D], lse[n, KVH, G*t]) from the online-softmax state; empty rows give 0, 0."""
    m, l, o = state
    empty = l <= 0
    inv = jnp.where(empty, 0.0, 1.0 / jnp.where(empty, 1.0, l))
    lse = jnp.where(empty, 0.0, m + jnp.log(jnp.where(empty, 1.0, l)))
    return tokens_first(o * inv[..., None], spec), lse


def backward(qs: Queries, do: jax.Array, lse: jax.Array, delta: jax.Array, blk: Block):
    """Gradient contributions of one key block: (dq[n, KVH, G*t, D], dk, dv[n, KVH, t, D]); dq is
    the gradient of the scaled queries (multiply by 1/sqrt(D) for q's).

    do[n, KVH, G*t, D] is the output cotangent (`heads_first`), lse[n, KVH, G*t] from `finish`,
    delta[n, KVH, G*t] = sum_D(do * out). Scores are recomputed tile by tile.
    """
    allowed = tile_pairs_allowed(qs.summary, blk.summary, jnp)
    nq = allowed.shape[0]
    # the allowed pairs key tile by key tile, query tiles in increasing order within each: every
    # dk, dv tile and every dq tile sums its terms in the order of a dense loop over all pairs
    count, index = allowed_pairs(allowed.T)

    def pair(c, grads):
        j, i = index[c] // nq, index[c] % nq
        q, qid, do_i, lse_i, delta_i = _tile((qs.q, qs.ids, do, lse, delta), i)
        k, v, kid = _tile((blk.k, blk.v, blk.ids), j)
        tick("tile_pairs_bwd", q, k)
        dq, dk, dv = grads
        mask = attention_mask(qid, kid)
        s = jnp.einsum("hqd,hkd->hqk", q, k)
        p = jnp.exp(_masked(mask, s, s - lse_i[..., None], -jnp.inf))          # p[KVH, G*t, t]
        dp = jnp.einsum("hqd,hkd->hqk", do_i, v)
        ds = p * (dp - delta_i[..., None])         # d(score); dq picks up 1/sqrt(D) in the ring
        pt, dst = jnp.swapaxes(p, 1, 2), jnp.swapaxes(ds, 1, 2)
        return (_put(dq, i, _tile(dq, i) + jnp.einsum("hqk,hkd->hqd", ds, k)),
                _put(dk, j, _tile(dk, j) + jnp.einsum("hkq,hqd->hkd", dst, q)),
                _put(dv, j, _tile(dv, j) + jnp.einsum("hkq,hqd->hkd", pt, do_i)))

    zero = jnp.zeros_like(blk.k)
    return lax.fori_loop(0, count, pair, (jnp.zeros_like(qs.q), zero, zero))


def blockwise_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_ids: AttnIds, k_ids: AttnIds, *,
                        tile: int = DEFAULT_TILE, chunks: int = 1) -> tuple[jax.Array, jax.Array]:
    """Attention of q[S_q, H, D] over k, v[S_k, KVH, D] in tiles: (out[S_q, H, D], lse[S_q, H]).

    Forward only (no custom gradient): the building block of a layout's own attention; lse is
    the log-sum-exp of each query's allowed scores (0 where it has none), for merging blocks.
    """
    qspec, kspec = TileSpec.make(q.shape[0], tile, chunks), TileSpec.make(k.shape[0], tile, chunks)
    qs = make_queries(q, q_ids, qspec, k.shape[1])
    state = fold(init_state(qs), qs, make_block(k, v, k_ids, kspec))
    out, lse = finish(state, qspec)
    return out, tokens_first(lse, qspec)
