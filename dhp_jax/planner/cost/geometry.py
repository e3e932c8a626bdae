"""The executor's stream geometry as the planner sees it: padding ladder, pad-skipping chunk, menu.

A `CostModel` carries the geometry its executor runs (`bucket_min`, `bucket_growth`,
`linear_chunk`, `bucket_menu`, `menu_kinds`, `padded_attention`); this module is where those
fields mean something: `padded_length` is the one bucket rule (`dhp_jax.geometry.layout.bucket_lengths`
with the cost's ladder, clamped to its memory budget), `check_geometry` the one check of them.
Pricing (`dhp_jax.planner.cost.pricing`) and memory accounting (`dhp_jax.planner.cost.memory`) read the
padded length from here.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dhp_jax.geometry.layout import bucket_lengths
from dhp_jax.planner.contract.kinds import check_attention

__all__ = ["check_geometry", "padded_length"]


def padded_length(cost: Any, tokens: Any, degree: Any) -> np.ndarray:
    """The executor's padded stream length for `tokens` on `degree` ranks (the one bucket rule,
    `dhp_jax.geometry.layout.bucket_lengths`, with the cost's ladder); `tokens` when unpadded."""
    if not cost.bucket_min:
        return np.asarray(tokens, dtype=np.float64)
    return bucket_lengths(tokens, degree, cost.bucket_min, cost.bucket_growth,
                          cost.memory_budget / cost.mem_per_token, cost.bucket_menu)


def check_geometry(cost: Any) -> None:
    """A ValueError naming the first geometry field of `cost` that its executor cannot run."""
    if isinstance(cost.bucket_min, bool) or not isinstance(cost.bucket_min, (int, np.integer)) \
            or cost.bucket_min < 0:
        raise ValueError(f"CostModel.bucket_min must be an integer >= 0 (0: no padding), got {cost.bucket_min!r}")
    for deg, bs in cost.bucket_menu:
        if deg < 1 or list(bs) != sorted(bs) or any(b < 1 or b % (2 * deg) for b in bs):
            raise ValueError(f"CostModel.bucket_menu: degree {deg} needs ascending buckets that are multiples "
                             f"of 2*degree, got {list(bs)}")
    on_menu = {(int(deg), int(b)) for deg, bs in cost.bucket_menu for b in bs}
    for deg, b, kind in cost.menu_kinds:
        if (int(deg), int(b)) not in on_menu:
            raise ValueError(f"CostModel.menu_kinds: ({deg}, {b}) is not a program of bucket_menu")
        check_attention(kind, int(deg), cost.num_heads)
    lc = cost.linear_chunk
    if isinstance(lc, bool) or not isinstance(lc, (int, np.integer)) or lc < 0:
        raise ValueError(f"CostModel.linear_chunk must be an integer >= 0 (0: pad tokens computed), got {lc!r}")
    if cost.bucket_min and not cost.bucket_growth > 1.0:
        raise ValueError(f"CostModel.bucket_growth must be > 1 when bucket_min is set, got {cost.bucket_growth}")
