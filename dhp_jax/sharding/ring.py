"""Ring attention for any CP degree, written for the body of a `shard_map` over one mesh axis.

Each device holds `q[S_l, H, D]`, `k, v[S_l, KVH, D]` and the ids of its S_l = S/degree tokens
(two zigzag chunks). The key block (K/V, their ids and per-tile summaries, in tiles:
`dhp_jax.sharding.tiles.Block`) travels around the ring with `ppermute` (device i sends to
i+1 mod degree); every step folds one block into a tiled online softmax (`tiles.fold`), skipping
the (query tile, key tile) pairs with no allowed pair (other samples, the causal future, padding).

Memory: a custom VJP. The forward pass keeps only the output and the log-sum-exp of each local
query (besides its inputs); the backward pass runs the ring again: K/V travel as in the forward
pass, their dK/dV accumulators travel with them (one hop behind), score tiles are recomputed, and
after `degree` hops each accumulator is back on the device that owns its block. Temporaries are
one score tile per (query tile, key tile) pair, so attention memory is linear in S_l.

Overlap: inside each ring step the `ppermute` of the block for step k+1 is issued before step k's
compute and does not depend on it (tests/test_ring.py reads this off the jaxpr). The dK/dV
accumulators of a block can only leave once that block's compute is done.

Masks come from ids (`dhp_jax.model.attention.attention_mask`), so order inside the stream does
not matter. `fused=True` (degree 1 only) hands the whole block to `jax.nn.dot_product_attention`
with the cuDNN implementation, in bf16, where the platform has it; the tiled path is the default
and the reference.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from dhp_jax.model.attention import AttnIds, attention_mask
from dhp_jax.sharding import tiles
from dhp_jax.sharding.tiles import DEFAULT_TILE, TileSpec


def _shift(x, axis_name: str, degree: int):
    return lax.ppermute(x, axis_name, [(i, (i + 1) % degree) for i in range(degree)])


def _shift_block(blk: tiles.Block, axis_name: str, degree: int) -> tiles.Block:
    """Send a key block to the next device as two arrays (float K/V, int ids + summaries): one
    collective per dtype rather than one per field."""
    n, t = blk.ids.segment.shape
    meta = jnp.concatenate([jnp.stack(blk.ids, axis=-1).reshape(n, 3 * t), blk.summary], axis=1)
    kv, meta = _shift((jnp.stack([blk.k, blk.v]), meta), axis_name, degree)
    ids = meta[:, :3 * t].reshape(n, t, 3)
    return tiles.Block(kv[0], kv[1], AttnIds(ids[..., 0], ids[..., 1], ids[..., 2]), meta[:, 3 * t:])


def _shift_pair(a: jax.Array, b: jax.Array, axis_name: str, degree: int) -> tuple[jax.Array, jax.Array]:
    ab = _shift(jnp.stack([a, b]), axis_name, degree)
    return ab[0], ab[1]


def _prepare(q, k, v, q_ids, k_ids, tile, chunks):
    spec = TileSpec.make(q.shape[0], tile, chunks)
    return spec, tiles.make_queries(q, q_ids, spec, k.shape[1]), tiles.make_block(k, v, k_ids, spec)


def _forward(q, k, v, q_ids, k_ids, axis_name, degree, tile, chunks):
    """(out[S_l, H, D], lse tiles) of the ring."""
    spec, qs, blk = _prepare(q, k, v, q_ids, k_ids, tile, chunks)
    state = tiles.init_state(qs)
    if degree > 1:
        def step(carry, _):
            state, blk = carry
            nxt = _shift_block(blk, axis_name, degree)    # issued first; the fold does not need it
            return (tiles.fold(state, qs, blk), nxt), None

        (state, blk), _ = lax.scan(step, (state, blk), None, length=degree - 1)
    return tiles.finish(tiles.fold(state, qs, blk), spec)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _ring(q, k, v, q_ids, k_ids, axis_name, degree, tile, chunks):
    return _forward(q, k, v, q_ids, k_ids, axis_name, degree, tile, chunks)[0]


def _ring_fwd(q, k, v, q_ids, k_ids, axis_name, degree, tile, chunks):
    out, lse = _forward(q, k, v, q_ids, k_ids, axis_name, degree, tile, chunks)
    return out, (q, k, v, q_ids, k_ids, out, lse)


def _ring_bwd(axis_name, degree, tile, chunks, res, dout):
    q, k, v, q_ids, k_ids, out, lse = res
    spec, qs, blk = _prepare(q, k, v, q_ids, k_ids, tile, chunks)
    kvh = k.shape[1]
    do = tiles.heads_first(dout, spec, kvh)                                # do[n, KVH, G*t, D]
    delta = jnp.sum(do * tiles.heads_first(out, spec, kvh), axis=-1)       # delta[n, KVH, G*t]
    zero = jnp.zeros_like(blk.k)
    dq, acc = jnp.zeros_like(qs.q), (zero, zero)
    if degree > 1:
        def step(carry, _):
            dq, blk, acc = carry
            nxt = _shift_block(blk, axis_name, degree)    # K/V for the next step, issued first
            dq_b, dk_b, dv_b = tiles.backward(qs, do, lse, delta, blk)
            acc = _shift_pair(acc[0] + dk_b, acc[1] + dv_b, axis_name, degree)
            return (dq + dq_b, nxt, acc), None

        (dq, blk, acc), _ = lax.scan(step, (dq, blk, acc), None, length=degree - 1)
    dq_b, dk_b, dv_b = tiles.backward(qs, do, lse, delta, blk)
    dk, dv = acc[0] + dk_b, acc[1] + dv_b
    if degree > 1:                                       # home: the next device owns this block
        dk, dv = _shift_pair(dk, dv, axis_name, degree)
    dq = tiles.tokens_first(dq + dq_b, spec) * (1.0 / math.sqrt(q.shape[-1]))    # queries were pre-scaled
    return dq, tiles.tokens_first(dk, spec), tiles.tokens_first(dv, spec), None, None


_ring.defvjp(_ring_fwd, _ring_bwd)


def ring_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_ids: AttnIds, k_ids: AttnIds, *,
                   axis_name: str, degree: int, tile: int = DEFAULT_TILE, chunks: int = 2,
                   fused: bool = False) -> jax.Array:
    """Attention of the local queries over the whole ring's keys; returns o[S_l, H, D].

    Must run inside `shard_map` with `axis_name` of size `degree`; has the signature of the
    model's attention function once the keywords are bound. `tile` is the largest tile (tokens);
    `chunks` the contiguous chunks of the local block (2 for the zigzag layout).
    """
    s_l, h, d = q.shape
    assert k.shape[0] == s_l and q_ids.segment.shape == (s_l,), (q.shape, k.shape, q_ids.segment.shape)
    if fused:
        if degree != 1:
            raise ValueError(f"the fused attention kernel runs degree-1 groups only, got degree {degree}")
        return fused_attention(q, k, v, q_ids, k_ids)
    # The kernel runs in fp32 whatever the compute dtype (softmax statistics, scores and the dK/dV
    # accumulators stay fp32); the casts sit outside the custom VJP, so autodiff casts the grads back.
    f32 = jnp.float32
    out = _ring(q.astype(f32), k.astype(f32), v.astype(f32), AttnIds(*q_ids), AttnIds(*k_ids),
                axis_name, degree, tile, chunks)
    return out.astype(q.dtype)


def local_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_ids: AttnIds, k_ids: AttnIds, *,
                    tile: int = DEFAULT_TILE, chunks: int = 1) -> jax.Array:
    """Tiled attention of one device's queries over its own keys, with the ring's custom VJP
    (memory linear in tokens, empty tile pairs skipped); no collective, usable outside shard_map
    (e.g. the local attention of an all-to-all layout). `chunks`: contiguous chunks of the block."""
    return ring_attention(q, k, v, q_ids, k_ids, axis_name="", degree=1, tile=tile, chunks=chunks)


def fused_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_ids: AttnIds, k_ids: AttnIds) -> jax.Array:
    """One block through `jax.nn.dot_product_attention(implementation="cudnn")` in bf16.

    The mask comes from the same ids; rows with no allowed key give 0 like the tiled path.
    """
    mask = attention_mask(q_ids, k_ids)
    group = q.shape[1] // k.shape[1]
    kk, vv = (jnp.repeat(x, group, axis=1) if group > 1 else x for x in (k, v))
    out = jax.nn.dot_product_attention(q[None].astype(jnp.bfloat16), kk[None].astype(jnp.bfloat16),
                                       vv[None].astype(jnp.bfloat16), mask=mask[None, None],
                                       implementation="cudnn")[0]
    return jnp.where(jnp.any(mask, axis=1)[:, None, None], out.astype(q.dtype), 0.0)


def ring_attention_fn(axis_name: str, degree: int, *, tile: int = DEFAULT_TILE, fused: bool = False):
    """The model-facing attention function for a ring of `degree` devices on `axis_name`."""
    return functools.partial(ring_attention, axis_name=axis_name, degree=degree, tile=tile, fused=fused)
