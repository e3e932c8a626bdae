"""Tiled (flash-style) attention over one query block and one key block, with log-sum-exp.

The local kernel under the ring (`dhp_jax.sharding.ring`) and usable on its own (the local
attention of an all-to-all layout): queries and keys are cut into tiles of `t` tokens, a
(query tile, key tile) pair is computed only when some query of the one may attend some key of
the other, and temporaries are one score tile `s[KVH, G, t, t]`, never `[S_q, S_k]`.

Tiling (`TileSpec`): a block of S tokens made of `chunks` contiguous chunks (the two zigzag
chunks of a ring device) is cut chunk by chunk into n tiles of t = ceil(c / n) tokens each, where
c = S / chunks and n = ceil(c / tile); each chunk is padded with at most n - 1 padding tokens
(segment 0), so any length works and no tile straddles two chunks.

Skipping: every tile gets a summary from its ids, computed once (`summarize`, six int32 per
tile): its lowest and highest segment, the first position of its lowest segment, the last position
of its highest segment, and its lowest and highest bidirectional span, all over real tokens
(segment > 0). `tile_pairs_allowed` is true unless the summaries prove that no pair may attend
(the mask rule of `dhp_jax.model.attention`): disjoint segment ranges; or no span in common and
the key tile's first (segment, position) after the query tile's last (the causal future); or
either tile all padding. The same code runs on NumPy (`count_ring_tiles`, for benches) and in
the kernel, so the counts agree with what the kernel computes.

State of the online softmax for one query block, tiled: m[nq, KVH, G, t] (running max),
l[nq, KVH, G, t] (denominator), o[nq, t, KVH, G, D] (numerator); `finish` gives
out[S, H, D] and lse[nq, KVH, G, t] (log-sum-exp, 0 on rows with no allowed key, whose output is 0).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dhp_jax.model.attention import AttnIds, attention_mask

DEFAULT_TILE = 512
_NEG = -1e30
_BIG = 2 ** 30


@dataclasses.dataclass(frozen=True)
class TileSpec:
    """How a block of `length` tokens in `chunks` contiguous chunks is cut into tiles of `size`."""

    length: int
    chunks: int
    per_chunk: int       # tiles per chunk (n)
    size: int            # tokens per tile (t)

    @classmethod
    def make(cls, length: int, tile: int = DEFAULT_TILE, chunks: int = 1) -> "TileSpec":
        if tile < 1 or chunks < 1 or length < 1 or length % chunks:
            raise ValueError(f"cannot tile a block of {length} tokens in {chunks} chunks with tile {tile}")
        c = length // chunks
        n = -(-c // tile)
        return cls(length, chunks, n, -(-c // n))

    @property
    def num_tiles(self) -> int:
        return self.chunks * self.per_chunk

    @property
    def chunk(self) -> int:
        return self.length // self.chunks


def to_tiles(x: Any, spec: TileSpec, xp: Any = jnp) -> Any:
    """x[S, ...] -> x[num_tiles, t, ...], each chunk padded at its end with zeros (segment 0)."""
    c, pad = spec.chunk, spec.per_chunk * spec.size - spec.chunk
    x = x.reshape((spec.chunks, c) + x.shape[1:])
    if pad:
        x = xp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    return x.reshape((spec.num_tiles, spec.size) + x.shape[2:])


def from_tiles(x: jax.Array, spec: TileSpec) -> jax.Array:
    """Inverse of `to_tiles`: x[num_tiles, t, ...] -> x[S, ...] (the padding dropped)."""
    x = x.reshape((spec.chunks, spec.per_chunk * spec.size) + x.shape[2:])
    return x[:, :spec.chunk].reshape((spec.length,) + x.shape[2:])


def summarize(seg: Any, pos: Any, span: Any, xp: Any = jnp) -> Any:
    """int32[n, 6] per-tile summaries of tiled ids [n, t] (see the module docstring)."""
    real = seg > 0
    seg_lo = xp.min(xp.where(real, seg, _BIG), axis=1)
    seg_hi = xp.max(xp.where(real, seg, -1), axis=1)
    first = xp.min(xp.where(real & (seg == seg_lo[:, None]), pos, _BIG), axis=1)
    last = xp.max(xp.where(real & (seg == seg_hi[:, None]), pos, -1), axis=1)
    spanned = real & (span > 0)
    span_lo = xp.min(xp.where(spanned, span, _BIG), axis=1)
    span_hi = xp.max(xp.where(spanned, span, -1), axis=1)
    return xp.stack([seg_lo, seg_hi, first, last, span_lo, span_hi], axis=1).astype(xp.int32)


def tile_pairs_allowed(qs: Any, ks: Any, xp: Any = jnp) -> Any:
    """bool[nq, nk]: False only where no query of the q tile may attend any key of the k tile."""
    q = [qs[:, i, None] for i in range(6)]
    k = [ks[None, :, i] for i in range(6)]
    seg = (xp.maximum(q[0], k[0]) <= xp.minimum(q[1], k[1]))           # also false on empty tiles
    causal = (k[0] < q[1]) | ((k[0] == q[1]) & (k[2] <= q[3]))
    spans = xp.maximum(q[4], k[4]) <= xp.minimum(q[5], k[5])
    return seg & (causal | spans)


class Block(NamedTuple):
    """A key block in tiles, as it travels around a ring: k, v[n, t, KVH, D], ids[n, t], summary[n, 6]."""

    k: jax.Array
    v: jax.Array
    ids: AttnIds
    summary: jax.Array


class Queries(NamedTuple):
    """A query block in tiles: q[n, t, KVH, G, D], ids[n, t], summary[n, 6]."""

    q: jax.Array
    ids: AttnIds
    summary: jax.Array


def tile_ids(ids: AttnIds, spec: TileSpec) -> tuple[AttnIds, jax.Array]:
    tiled = AttnIds(*(to_tiles(a, spec) for a in ids))
    return tiled, summarize(*tiled)


def make_queries(q: jax.Array, ids: AttnIds, spec: TileSpec, kv_heads: int) -> Queries:
    s, h, d = q.shape
    qt = to_tiles(q, spec).reshape(spec.num_tiles, spec.size, kv_heads, h // kv_heads, d)
    return Queries(qt, *tile_ids(ids, spec))


def make_block(k: jax.Array, v: jax.Array, ids: AttnIds, spec: TileSpec) -> Block:
    return Block(to_tiles(k, spec), to_tiles(v, spec), *tile_ids(ids, spec))


def init_state(qs: Queries) -> tuple[jax.Array, jax.Array, jax.Array]:
    n, t, kvh, g, d = qs.q.shape
    return (jnp.full((n, kvh, g, t), _NEG, jnp.float32), jnp.zeros((n, kvh, g, t), jnp.float32),
            jnp.zeros((n, t, kvh, g, d), jnp.float32))


def _tile_ids(ids: AttnIds, i: Any) -> AttnIds:
    return AttnIds(*(a[i] for a in ids))


def fold(state, qs: Queries, blk: Block):
    """Fold one key block into the online-softmax state; returns (state, computed tile pairs)."""
    allowed = tile_pairs_allowed(qs.summary, blk.summary)                  # allowed[nq, nk]
    scale = 1.0 / math.sqrt(qs.q.shape[-1])

    def q_tile(_, xs):
        q, qid, ok_row, st = xs

        def k_tile(carry, ys):
            st, count = carry
            k, v, kid, ok = ys

            def compute(st):
                m, l, o = st
                mask = attention_mask(qid, kid)                          # mask[t, t]
                s = jnp.einsum("qhgd,khd->hgqk", q, k) * scale
                m_new = jnp.maximum(m, jnp.max(jnp.where(mask, s, _NEG), axis=-1))
                p = jnp.exp(jnp.where(mask, s - m_new[..., None], -jnp.inf))  # p[KVH, G, t, t]
                corr = jnp.exp(m - m_new)
                o = o * jnp.moveaxis(corr, -1, 0)[..., None] + jnp.einsum("hgqk,khd->qhgd", p, v)
                return m_new, l * corr + jnp.sum(p, axis=-1), o

            st = lax.cond(ok, compute, lambda st: st, st)
            return (st, count + ok.astype(jnp.int32)), None

        (st, count), _ = lax.scan(k_tile, (st, jnp.int32(0)), (blk.k, blk.v, blk.ids, ok_row))
        return None, (st, count)

    _, (state, counts) = lax.scan(q_tile, None, (qs.q, qs.ids, allowed, state))
    return state, jnp.sum(counts)


def finish(state, spec: TileSpec) -> tuple[jax.Array, jax.Array]:
    """(out[S, H, D], lse[nq, KVH, G, t]) from the online-softmax state; empty rows give 0, 0."""
    m, l, o = state
    empty = l <= 0
    inv = jnp.where(empty, 0.0, 1.0 / jnp.where(empty, 1.0, l))
    out = o * jnp.moveaxis(inv, -1, 1)[..., None]                           # [n, t, KVH, G, D]
    lse = jnp.where(empty, 0.0, m + jnp.log(jnp.where(empty, 1.0, l)))
    n, t, kvh, g, d = out.shape
    return from_tiles(out.reshape(n, t, kvh * g, d), spec), lse


def backward(qs: Queries, do: jax.Array, lse: jax.Array, delta: jax.Array, blk: Block):
    """Gradient contributions of one key block: (dq[nq, t, KVH, G, D], dk, dv[nk, t, KVH, D]).

    do[nq, t, KVH, G, D] is the output cotangent, lse[nq, KVH, G, t] from `finish`,
    delta[nq, KVH, G, t] = sum_D(do * out). Scores are recomputed tile by tile.
    """
    allowed = tile_pairs_allowed(qs.summary, blk.summary)
    scale = 1.0 / math.sqrt(qs.q.shape[-1])

    def k_tile(dq, xs):
        k, v, kid, ok_col = xs

        def q_tile(carry, ys):
            q, qid, do_i, lse_i, delta_i, ok = ys

            def compute(carry):
                dk, dv = carry
                mask = attention_mask(qid, kid)
                s = jnp.einsum("qhgd,khd->hgqk", q, k) * scale
                p = jnp.exp(jnp.where(mask, s - lse_i[..., None], -jnp.inf))   # p[KVH, G, t, t]
                dp = jnp.einsum("qhgd,khd->hgqk", do_i, v)
                ds = p * (dp - delta_i[..., None]) * scale
                return ((dk + jnp.einsum("hgqk,qhgd->khd", ds, q), dv + jnp.einsum("hgqk,qhgd->khd", p, do_i)),
                        jnp.einsum("hgqk,khd->qhgd", ds, k))

            return lax.cond(ok, compute, lambda c: (c, jnp.zeros_like(q)), carry)

        zero = jnp.zeros_like(k)
        (dk, dv), dq_add = lax.scan(q_tile, (zero, zero), (qs.q, qs.ids, do, lse, delta, ok_col))
        return dq + dq_add, (dk, dv)

    dq, (dk, dv) = lax.scan(k_tile, jnp.zeros_like(qs.q), (blk.k, blk.v, blk.ids, allowed.T))
    return dq, dk, dv


def blockwise_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_ids: AttnIds, k_ids: AttnIds, *,
                        tile: int = DEFAULT_TILE, chunks: int = 1) -> tuple[jax.Array, jax.Array]:
    """Attention of q[S_q, H, D] over k, v[S_k, KVH, D] in tiles: (out[S_q, H, D], lse[S_q, H]).

    Forward only (no custom gradient): the building block of a layout's own attention; lse is
    the log-sum-exp of each query's allowed scores (0 where it has none), for merging blocks.
    """
    qspec, kspec = TileSpec.make(q.shape[0], tile, chunks), TileSpec.make(k.shape[0], tile, chunks)
    qs = make_queries(q, q_ids, qspec, k.shape[1])
    state, _ = fold(init_state(qs), qs, make_block(k, v, k_ids, kspec))
    out, lse = finish(state, qspec)
    return out, from_tiles(jnp.moveaxis(lse, -1, 1).reshape(qspec.num_tiles, qspec.size, -1), qspec)


def count_ring_tiles(segment: np.ndarray, position: np.ndarray, span: np.ndarray, degree: int,
                     tile: int = DEFAULT_TILE, chunks: int = 2) -> tuple[int, int]:
    """(computed, total) tile pairs of a ring over a stream already in device order (NumPy).

    Device i holds `array[i*S/d:(i+1)*S/d]` in `chunks` chunks; over the ring every device meets
    every block. Uses the kernel's own `summarize` / `tile_pairs_allowed`.
    """
    ids = [np.asarray(a).reshape(degree, -1) for a in (segment, position, span)]
    spec = TileSpec.make(ids[0].shape[1], tile, chunks)
    sums = [summarize(*(to_tiles(a[i], spec, np) for a in ids), xp=np) for i in range(degree)]
    computed = sum(int(tile_pairs_allowed(qs, ks, np).sum()) for qs in sums for ks in sums)
    return computed, degree * degree * spec.num_tiles ** 2
