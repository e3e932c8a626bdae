"""Which attention kinds a CP group may run, and the head split of a Ulysses all-to-all.

A group of degree d runs one of (the `Group.attention` field of `dhp_jax.planner.contract.plan`)
- "ring": K/V blocks travel around all d ranks (any d);
- "ulysses": an all-to-all turns the sequence shard into a head shard over all d ranks
  (needs the query-head count divisible by d);
- "hybrid:<u>x<r>": Ulysses over u consecutive ranks (inside a node) times a ring over the r
  Ulysses sub-groups, u r = d (needs the query-head count divisible by u).
Every kind is the pair (u, r) of `plan.attention_split`: ring is (1, d), Ulysses (d, 1). Pure Python.
"""

from __future__ import annotations

import math

from dhp_jax.planner.contract.plan import attention_split

RING = "ring"
ULYSSES = "ulysses"


def attention_name(u: int, r: int) -> str:
    """The canonical name of Ulysses over u ranks times a ring over r."""
    if u < 1 or r < 1:
        raise ValueError(f"attention shape must be positive, got {u}x{r}")
    return RING if u == 1 else ULYSSES if r == 1 else f"hybrid:{u}x{r}"


def check_attention(kind: str, degree: int, num_heads: int | None) -> tuple[int, int]:
    """(u, r) of `kind` on `degree` ranks; ValueError unless the query heads split over the u ranks."""
    u, r = attention_split(kind, degree)
    if num_heads is not None and u > 1 and int(num_heads) % u:
        raise ValueError(f"attention {kind!r} on degree {degree}: the {num_heads} query heads do not "
                         f"split over {u} Ulysses ranks (the head count must be divisible by {u})")
    return u, r


def attention_kinds(degree: int, num_heads: int | None, max_ulysses: int | None = None) -> list[str]:
    """Every kind a group of `degree` ranks may run: ring first, then each Ulysses size u > 1 dividing
    both the degree and the head count, with u <= `max_ulysses` (e.g. the ranks of one node)."""
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
