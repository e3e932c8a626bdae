"""The JAX engine's attention builders, one per attention kind (`dhp_jax.planner.contract.kinds`).

A builder takes a group's `GroupAttention` and returns the model-facing attention function for
the body of the group's `shard_map`: the tiled ring over `cp` for "ring" (or the executor's own
function of (axis name, degree)), the all-to-all over `sp` times a ring over `cp` of
`dhp_jax.sharding.ulysses` for "ulysses" and "hybrid:<u>x<r>". The group's mesh has the kind's
`mesh_shape` (`RankLayout.submesh`).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from dhp_jax.planner.contract.kinds import HYBRID_KIND, RING_KIND, ULYSSES_KIND, GroupAttention, running_kind
from dhp_jax.sharding.mesh import CP_AXIS, SP_AXIS
from dhp_jax.sharding.ring import ring_attention_fn
from dhp_jax.sharding.tiles import DEFAULT_TILE
from dhp_jax.sharding.ulysses import ulysses_attention

ENGINE = "jax"


def _ring(attention: GroupAttention, tile: int = DEFAULT_TILE,
          custom: Callable[[str, int], Callable[..., Any]] | None = None):
    if custom is not None:
        return custom(CP_AXIS, attention.degree)
    return ring_attention_fn(CP_AXIS, attention.ring, tile=tile)


def _all_to_all(attention: GroupAttention, tile: int = DEFAULT_TILE, custom: Any = None):
    return functools.partial(ulysses_attention, ulysses=attention.ulysses, ring=attention.ring, cp_axis=CP_AXIS,
                             sp_axis=SP_AXIS, tile=tile)


RING_KIND.register(ENGINE, _ring)
ULYSSES_KIND.register(ENGINE, _all_to_all)
HYBRID_KIND.register(ENGINE, _all_to_all)


def attention_fn(attention: GroupAttention, tile: int = DEFAULT_TILE,
                 custom: Callable[[str, int], Callable[..., Any]] | None = None):
    """The attention function of a group (its kind's JAX builder). `custom(axis, degree)`, if
    given, replaces the tiled ring of ring groups."""
    return attention.kind.builder(ENGINE)(attention, tile=tile, custom=custom)


def group_attention_fn(ulysses: int, ring: int, tile: int = DEFAULT_TILE):
    """The attention of a group shaped (Ulysses u) x (ring r), built by the kind that runs that shape."""
    kind = running_kind(ulysses, ring)
    return attention_fn(GroupAttention(kind.text(ulysses, ring), ulysses, ring, kind), tile=tile)
