"""Ulysses (all-to-all) and hybrid Ulysses x ring attention, for the body of a `shard_map`.

A Ulysses or hybrid group of degree d = u r runs on a 2-D view of its devices, `(cp: r, sp: u)`,
row-major in the group's rank order, so the u ranks of one Ulysses sub-group are consecutive (one
node) and the stream shard of rank i is the same zigzag shard the ring uses: same packed layout,
same ids, same loss. Inside attention, per device:

    q[S_l, H, D], k, v[S_l, KVH, D]                 sequence shard (S_l = S / d tokens)
      -- all_to_all over sp (split heads, concat sequence) -->
    q[u S_l, H/u, D], k, v[u S_l, KVH'/u, D]        head shard of the sub-group's u S_l tokens
      -- r == 1: the ring's tiled kernel on one device (`ring.local_attention`);
         r > 1:  ring attention over cp (the r sub-groups pass their head-sharded K/V) -->
    o[u S_l, H/u, D]  -- all_to_all back -->  o[S_l, H, D]

The token ids (segment, position, span: int32[S_l] each) are all-gathered over sp; the mask reads
ids, never order, so the gathered stream needs no reordering.

Heads, what is supported:
- query heads H divisible by u: each rank gets H/u query heads. K/V heads are repeated
  (repeat-interleave, as GQA reads them) up to KVH' = lcm(KVH, u) heads before the all-to-all, so
  the KV heads every rank's query heads read arrive with them; with KVH >= u and u | KVH nothing is
  repeated. KVH < u (e.g. 2 KV heads on 4 Ulysses ranks) is supported at the cost of moving
  KVH'/KVH copies.
- H not divisible by u: zero heads pad q, k, v to the next multiple of u and are dropped after the
  all-to-all back (exact; the padded heads cost compute). The planner never asks for this for the
  decoder (`dhp_jax.planner.contract.kinds.check_attention` refuses it); it serves an encoder whose head
  count differs from the decoder's (the vision encoder) inside a group the decoder's heads allow.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from dhp_jax.model.attention import AttnIds, repeat_kv
from dhp_jax.planner.contract.kinds import head_plan
from dhp_jax.sharding.mesh import CP_AXIS, SP_AXIS
from dhp_jax.sharding.ring import local_attention, ring_attention
from dhp_jax.sharding.tiles import DEFAULT_TILE


def _pad_heads(x: jax.Array, heads: int) -> jax.Array:
    return x if x.shape[1] == heads else jnp.pad(x, ((0, 0), (0, heads - x.shape[1]), (0, 0)))


def ulysses_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_ids: AttnIds, k_ids: AttnIds, *,
                      ulysses: int, ring: int, cp_axis: str = CP_AXIS, sp_axis: str = SP_AXIS,
                      tile: int = DEFAULT_TILE) -> jax.Array:
    """Attention of the local queries over the whole group's keys; returns o[S_l, H, D].

    Must run inside `shard_map` over a mesh with `sp_axis` of size `ulysses` and `cp_axis` of size
    `ring` (the model's attention signature once those are bound).
    """
    s_l, h, d = q.shape
    kvh = k.shape[1]
    assert k.shape == v.shape == (s_l, kvh, d) and q_ids.segment.shape == (s_l,), (q.shape, k.shape)
    hq, hkv = head_plan(h, kvh, ulysses)
    if hq == h:
        k, v = repeat_kv(k, hkv // kvh), repeat_kv(v, hkv // kvh)
    else:                                       # pad: every query head gets its own K/V head
        k, v = (_pad_heads(repeat_kv(x, h // kvh), hq) for x in (k, v))
        q = _pad_heads(q, hq)
    to_heads = functools.partial(lax.all_to_all, axis_name=sp_axis, split_axis=1, concat_axis=0, tiled=True)
    qh, kh, vh = to_heads(q), to_heads(k), to_heads(v)        # [u S_l, H'/u, D]
    gather = lambda ids: AttnIds(*(lax.all_gather(x, sp_axis, tiled=True) for x in ids))
    qi = gather(q_ids)
    ki = qi if k_ids is q_ids else gather(k_ids)
    # the head-sharded stream is the u ranks' local streams one after another: 2u zigzag chunks
    if ring == 1:
        oh = local_attention(qh, kh, vh, qi, ki, tile=tile, chunks=2 * ulysses)
    else:
        oh = ring_attention(qh, kh, vh, qi, ki, axis_name=cp_axis, degree=ring, tile=tile, chunks=2 * ulysses)
    o = lax.all_to_all(oh, sp_axis, split_axis=0, concat_axis=1, tiled=True)  # o[S_l, H', D]
    return o[:, :h]
