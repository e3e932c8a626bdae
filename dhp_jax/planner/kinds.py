"""Attention kinds of a CP group: names, their (Ulysses x ring) shape, and which ones a head count allows.

A group of degree d runs one of
- "ring": K/V blocks travel around all d ranks (any d);
- "ulysses": an all-to-all turns the sequence shard into a head shard over all d ranks
  (needs the query-head count divisible by d);
- "hybrid:<u>x<r>": Ulysses over u consecutive ranks (inside a node) times a ring over the r
  Ulysses sub-groups, u r = d, u >= 2, r >= 2 (needs the query-head count divisible by u).
Every kind is the pair (u, r): ring is (1, d), Ulysses (d, 1). Pure Python, no jax.
"""

from __future__ import annotations

import math
import re

RING = "ring"
ULYSSES = "ulysses"
_HYBRID = re.compile(r"hybrid:(\d+)x(\d+)")


def attention_name(u: int, r: int) -> str:
    """The canonical name of Ulysses over u ranks times a ring over r."""
    if u < 1 or r < 1:
        raise ValueError(f"attention shape must be positive, got {u}x{r}")
    return RING if u == 1 else ULYSSES if r == 1 else f"hybrid:{u}x{r}"


def attention_shape(kind: str, degree: int | None = None) -> tuple[int, int]:
    """(u, r) of an attention kind on a group of `degree` ranks; ValueError for a bad name or shape.
    Without `degree` only a hybrid, whose name carries its shape, can answer."""
    if kind in (RING, ULYSSES):
        if degree is None:
            raise ValueError(f"attention {kind!r}: the shape needs the group's degree")
        return (1, int(degree)) if kind == RING else (int(degree), 1)
    m = _HYBRID.fullmatch(str(kind))
    if m is None:
        raise ValueError(f"unknown attention kind {kind!r}; known: 'ring', 'ulysses', 'hybrid:<u>x<r>'")
    u, r = int(m.group(1)), int(m.group(2))
    if u < 2 or r < 2:
        raise ValueError(f"attention {kind!r}: a hybrid needs u >= 2 and r >= 2 (write "
                         f"{attention_name(max(u, 1), max(r, 1))!r})")
    if degree is not None and u * r != degree:
        raise ValueError(f"attention {kind!r}: {u} x {r} = {u * r} ranks, but the group has degree {degree}")
    return u, r


def check_attention(kind: str, degree: int, num_heads: int | None) -> tuple[int, int]:
    """`attention_shape`, and the query-head count must split over the Ulysses ranks."""
    u, r = attention_shape(kind, degree)
    if num_heads is not None and u > 1 and int(num_heads) % u:
        raise ValueError(f"attention {kind!r} on degree {degree}: the {num_heads} query heads do not "
                         f"split over {u} Ulysses ranks (the head count must be divisible by {u})")
    return u, r


def attention_kinds(degree: int, num_heads: int | None, max_ulysses: int | None = None) -> list[str]:
    """Every kind a group of `degree` ranks may run: ring first, then Ulysses sizes u dividing both
    the degree and the head count (u <= `max_ulysses`, e.g. the ranks of one node), largest last."""
    kinds = [RING]
    if num_heads is None:
        return kinds
    for u in range(2, int(degree) + 1):
        if degree % u == 0 and int(num_heads) % u == 0 and (max_ulysses is None or u <= max_ulysses):
            kinds.append(attention_name(u, degree // u))
    return kinds


def head_plan(num_heads: int, num_kv_heads: int, ulysses: int) -> tuple[int, int]:
    """(query heads, KV heads) a Ulysses all-to-all over `ulysses` ranks moves, for both executors.

    Query heads divisible by u: the KV heads are repeated (as GQA reads them) up to
    lcm(KVH, u), so each rank receives the KV heads its H/u query heads read. Otherwise (an encoder
    whose heads the decoder's Ulysses size does not split) q, k and v are padded with zero heads to
    the next multiple of u, every query head with its own KV head; the padded heads are dropped after
    the all-to-all back, so the result is exact.
    """
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    if num_heads % ulysses == 0:
        return num_heads, math.lcm(num_kv_heads, ulysses)
    padded = -(-num_heads // ulysses) * ulysses
    return padded, padded
