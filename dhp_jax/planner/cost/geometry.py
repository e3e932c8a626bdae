"""The executor's stream geometry as the planner sees it: padding ladder, pad-skipping chunk, menu.

`StreamGeometry` holds what the executor runs besides the model and the machine: the padding
ladder (`bucket_min`, `bucket_growth`), the pad-skipping chunk (`linear_chunk`) and a fitted menu of
programs (`bucket_menu`, `menu_kinds`). A `CostModel` holds one as its `geometry` field. This module
is where those fields mean something: `padded_length` is the one bucket rule
(`dhp_jax.geometry.layout.bucket_lengths` with the cost's ladder, clamped to its memory budget),
`check_geometry` the one check of them. Pricing (`dhp_jax.planner.cost.pricing`) and memory
accounting (`dhp_jax.planner.cost.memory`) read the padded length from here.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Mapping

import numpy as np

from dhp_jax.geometry.layout import bucket_lengths
from dhp_jax.planner.contract.kinds import check_attention

__all__ = ["StreamGeometry", "check_geometry", "padded_length"]


@dataclasses.dataclass(frozen=True)
class StreamGeometry:
    """The stream geometry the executor runs (defaults: no padding, no pad skipping, no menu).

    bucket_min / bucket_growth: the executor's padding ladder (`bucket_min` 0: streams are not padded).
    linear_chunk: the executor's pad-skipping chunk, tokens (0: pad tokens go through the linear
        layers; see `dhp_jax.planner.cost.model`).
    bucket_menu: ((degree, (bucket, ...)), ...): fitted programs (`dhp_jax.planner.programs.menu.BucketMenu`)
        that replace the ladder for their degrees; the planner then uses only these degrees.
    menu_kinds: ((degree, bucket, kind), ...): the one attention kind each menu program runs
        (`BucketMenu.kinds`); the per-group kind choice (`pricing.best_kinds`) gives a group of that
        degree and bucket this kind, so that the menu's budget bounds the programs that run.
    kind_rule: how groups of a padded stream (`bucket_min` > 0) get their attention kind outside
        `menu_kinds`: "program" (default) gives every (degree, bucket) program one kind, fixed
        without data by `pricing.program_kind`, so that kinds do not multiply the programs;
        "group" lets each group take its own fastest kind. Unpadded streams always choose per group.
    """

    bucket_min: int = 0
    bucket_growth: float = 2.0
    linear_chunk: int = 0
    bucket_menu: tuple = ()
    menu_kinds: tuple = ()
    kind_rule: str = "program"

    FIELDS: ClassVar[tuple[str, ...]] = ("bucket_min", "bucket_growth", "linear_chunk", "bucket_menu", "menu_kinds",
                                         "kind_rule")
    KIND_RULES: ClassVar[tuple[str, ...]] = ("program", "group")

    def __post_init__(self) -> None:
        check_geometry(self)

    @property
    def fixed_kinds(self) -> bool:
        """Whether some groups' attention kinds are fixed per program (a menu's `menu_kinds`, or the
        padded ladder under `kind_rule` "program") rather than chosen per group."""
        return bool(self.menu_kinds) or (bool(self.bucket_min) and self.kind_rule == "program")

    def replace(self, **changes: Any) -> "StreamGeometry":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.FIELDS}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "StreamGeometry":
        """From `to_dict`'s keys (JSON lists for the tuples); a ValueError names an unknown key."""
        unknown = set(d) - set(cls.FIELDS)
        if unknown:
            raise ValueError(f"unknown stream geometry field(s) {sorted(unknown)}; fields: {list(cls.FIELDS)}")
        kw = dict(d)
        if "bucket_growth" in kw and isinstance(kw["bucket_growth"], int) and not isinstance(kw["bucket_growth"], bool):
            kw["bucket_growth"] = float(kw["bucket_growth"])
        if "bucket_menu" in kw:
            kw["bucket_menu"] = tuple((int(deg), tuple(int(b) for b in bs)) for deg, bs in kw["bucket_menu"])
        if "menu_kinds" in kw:
            kw["menu_kinds"] = tuple((int(deg), int(b), str(k)) for deg, b, k in kw["menu_kinds"])
        return cls(**kw)


def padded_length(cost: Any, tokens: Any, degree: Any) -> np.ndarray:
    """The executor's padded stream length for `tokens` on `degree` ranks (the one bucket rule,
    `dhp_jax.geometry.layout.bucket_lengths`, with the cost's ladder); `tokens` when unpadded."""
    g = cost.geometry
    if not g.bucket_min:
        return np.asarray(tokens, dtype=np.float64)
    return bucket_lengths(tokens, degree, g.bucket_min, g.bucket_growth,
                          cost.memory_budget / cost.mem_per_token, g.bucket_menu)


def check_geometry(g: StreamGeometry, num_heads: int | None = None) -> None:
    """A ValueError naming the first field of `g` that its executor cannot run (each menu kind a
    known kind, and with `num_heads` one that the head count allows)."""
    if isinstance(g.bucket_min, bool) or not isinstance(g.bucket_min, (int, np.integer)) or g.bucket_min < 0:
        raise ValueError(f"StreamGeometry.bucket_min must be an integer >= 0 (0: no padding), got {g.bucket_min!r}")
    for deg, bs in g.bucket_menu:
        if deg < 1 or list(bs) != sorted(bs) or any(b < 1 or b % (2 * deg) for b in bs):
            raise ValueError(f"StreamGeometry.bucket_menu: degree {deg} needs ascending buckets that are multiples "
                             f"of 2*degree, got {list(bs)}")
    on_menu = {(int(deg), int(b)) for deg, bs in g.bucket_menu for b in bs}
    for deg, b, kind in g.menu_kinds:
        if (int(deg), int(b)) not in on_menu:
            raise ValueError(f"StreamGeometry.menu_kinds: ({deg}, {b}) is not a program of bucket_menu")
        check_attention(kind, int(deg), num_heads)
    if g.kind_rule not in StreamGeometry.KIND_RULES:
        raise ValueError(f"StreamGeometry.kind_rule must be one of {list(StreamGeometry.KIND_RULES)}, "
                         f"got {g.kind_rule!r}")
    lc = g.linear_chunk
    if isinstance(lc, bool) or not isinstance(lc, (int, np.integer)) or lc < 0:
        raise ValueError(f"StreamGeometry.linear_chunk must be an integer >= 0 (0: pad tokens computed), got {lc!r}")
    if g.bucket_min and not g.bucket_growth > 1.0:
        raise ValueError(f"StreamGeometry.bucket_growth must be > 1 when bucket_min is set, got {g.bucket_growth}")
