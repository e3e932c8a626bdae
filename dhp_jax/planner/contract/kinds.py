"""Attention kinds: how a CP group's ranks share its attention, as objects.

A group of degree d runs one kind (the `Group.attention` field of `dhp_jax.planner.contract.plan`,
whose text is the kind's serialised form):
- `RING_KIND`, "ring": K/V blocks travel around all d ranks (any d);
- `ULYSSES_KIND`, "ulysses": an all-to-all turns the sequence shard into a head shard over all d
  ranks (needs the query-head count divisible by d);
- `HYBRID_KIND`, "hybrid:<u>x<r>": Ulysses over u consecutive ranks (inside a node) times a ring
  over the r Ulysses sub-groups, u r = d (needs the query-head count divisible by u).

Every kind names a shape (u, r), Ulysses over u ranks times a ring over r: ring is (1, d), Ulysses
(d, 1). `resolve(text, degree)` parses a group's field into a `GroupAttention`: its shape, its
traffic and its mesh shape, and the kind that runs that shape (a shape has one running kind:
"ulysses" on one rank runs as the ring). Each engine registers one builder per kind
(`AttentionKind.register`: the JAX engine in `dhp_jax.sharding.attention`, the torch engine in
`npu_backend.attention`) and runs a group with `group_attention.kind.builder(engine)`: adding a
kind is one `AttentionKind` in `KINDS` and one builder per engine. Pure Python.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

from dhp_jax.planner.contract.errors import PlanValidationError

RING = "ring"
ULYSSES = "ulysses"


class AttentionKind:
    """One kind of group attention. A subclass says which texts are its own (`parse`), which shapes
    it runs (`runs`, one kind per shape over `KINDS`), how its text reads for a shape (`text`) and
    the axes of a group's mesh (`mesh_shape`); engines add their builders (`register`)."""

    name: str = ""
    pattern: str = ""       # the text as the error messages show it

    def __init__(self) -> None:
        self._builders: dict[str, Callable[..., Any]] = {}

    def parse(self, text: str, degree: int) -> tuple[int, int] | None:
        """(u, r) of `text` on `degree` ranks, None when `text` is not this kind's;
        `PlanValidationError` when it is but the shape does not fit the degree."""
        raise NotImplementedError

    def runs(self, u: int, r: int) -> bool:
        """Whether this kind runs Ulysses over u ranks times a ring over r."""
        raise NotImplementedError

    def text(self, u: int, r: int) -> str:
        """The serialised name of shape (u, r) (which this kind `runs`)."""
        raise NotImplementedError

    def mesh_shape(self, u: int, r: int) -> tuple[int, ...]:
        """The group's mesh in ranks: (r,) for one ring axis, (r, u) for a ring over Ulysses sub-groups."""
        return (r, u)

    def register(self, engine: str, builder: Callable[..., Any]) -> None:
        """The attention builder of `engine` for this kind (each engine's module registers its own)."""
        self._builders[engine] = builder

    def builder(self, engine: str) -> Callable[..., Any]:
        try:
            return self._builders[engine]
        except KeyError:
            raise LookupError(f"attention kind {self.name!r} has no builder for the {engine} engine "
                              f"(registered: {sorted(self._builders) or 'none'})") from None

    def __repr__(self) -> str:
        return f"<attention kind {self.name}>"


class _Ring(AttentionKind):
    name = pattern = RING

    def parse(self, text: str, degree: int) -> tuple[int, int] | None:
        return (1, degree) if text == RING else None

    def runs(self, u: int, r: int) -> bool:
        return u == 1

    def text(self, u: int, r: int) -> str:
        return RING

    def mesh_shape(self, u: int, r: int) -> tuple[int, ...]:
        return (r,)


class _Ulysses(AttentionKind):
    name = pattern = ULYSSES

    def parse(self, text: str, degree: int) -> tuple[int, int] | None:
        return (degree, 1) if text == ULYSSES else None

    def runs(self, u: int, r: int) -> bool:
        return u > 1 and r == 1

    def text(self, u: int, r: int) -> str:
        return ULYSSES


class _Hybrid(AttentionKind):
    name, pattern = "hybrid", "hybrid:<u>x<r>"

    def parse(self, text: str, degree: int) -> tuple[int, int] | None:
        if not text.startswith("hybrid:"):
            return None
        u, x, r = text[len("hybrid:"):].partition("x")
        if not (x and u.isdigit() and r.isdigit() and int(u) >= 1 and int(r) >= 1):
            return None
        if int(u) * int(r) != degree:
            raise PlanValidationError(f"attention {text!r}: {u} x {r} != degree {degree}")
        return int(u), int(r)

    def runs(self, u: int, r: int) -> bool:
        return u > 1 and r > 1

    def text(self, u: int, r: int) -> str:
        return f"hybrid:{u}x{r}"


RING_KIND, ULYSSES_KIND, HYBRID_KIND = _Ring(), _Ulysses(), _Hybrid()
KINDS: tuple[AttentionKind, ...] = (RING_KIND, ULYSSES_KIND, HYBRID_KIND)
ATTENTION_KINDS = tuple(k.pattern for k in KINDS)


@dataclasses.dataclass(frozen=True)
class GroupAttention:
    """A group's attention resolved on its degree: the text it was given, Ulysses over `ulysses`
    ranks times a ring over `ring`, and `kind`, the kind that runs that shape."""

    text: str
    ulysses: int
    ring: int
    kind: AttentionKind

    @property
    def degree(self) -> int:
        return self.ulysses * self.ring

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return self.kind.mesh_shape(self.ulysses, self.ring)

    def traffic(self, tokens: float) -> tuple[float, float, int]:
        """What one rank moves for a stream of `tokens`: (ring tokens S/u (r-1)/r, all-to-all tokens
        (S/d) (u-1)/u, messages (u-1) + (r-1)): a ring moves 1/u of the K/V heads around r ranks,
        the all-to-all swaps a rank's S/d rows for 1/u of the heads."""
        u, r = self.ulysses, self.ring
        return tokens / u * (r - 1) / r, tokens / (u * r) * (u - 1) / u, (u - 1) + (r - 1)

    def check_heads(self, num_heads: int | None) -> "GroupAttention":
        """Self; ValueError unless `num_heads` query heads split over the Ulysses ranks."""
        if num_heads is not None and int(num_heads) % self.ulysses:
            raise ValueError(f"attention {self.text!r} on degree {self.degree}: the {num_heads} query heads do not "
                             f"split over {self.ulysses} Ulysses ranks (the head count must be divisible by "
                             f"{self.ulysses})")
        return self


def running_kind(u: int, r: int) -> AttentionKind:
    """The kind that runs Ulysses over u ranks times a ring over r."""
    if u < 1 or r < 1:
        raise ValueError(f"attention shape must be positive, got {u}x{r}")
    (kind,) = [k for k in KINDS if k.runs(u, r)]
    return kind


def resolve(text: Any, degree: int, num_heads: int | None = None) -> GroupAttention:
    """`text` (a group's `attention` field) on `degree` ranks; `PlanValidationError` for an unknown
    kind or factors that do not multiply to the degree, ValueError (with `num_heads`) unless the
    query heads split over its Ulysses ranks."""
    if isinstance(text, str):
        for kind in KINDS:
            shape = kind.parse(text, degree)
            if shape is not None:
                return GroupAttention(text, *shape, running_kind(*shape)).check_heads(num_heads)
    raise PlanValidationError(f"attention kind {text!r} is not one of {', '.join(ATTENTION_KINDS)}")


def attention_split(kind: str, degree: int) -> tuple[int, int]:
    """(u, r) of an attention kind on `degree` ranks: Ulysses (all-to-all) over u ranks times a ring
    over r, u * r == degree. "ring" is (1, degree), "ulysses" (degree, 1), "hybrid:<u>x<r>" (u, r).
    Raises `PlanValidationError` for an unknown kind or factors that do not multiply to `degree`."""
    g = resolve(kind, degree)
    return g.ulysses, g.ring


def attention_name(u: int, r: int) -> str:
    """The canonical name of Ulysses over u ranks times a ring over r."""
    return running_kind(u, r).text(u, r)


def check_attention(kind: str, degree: int, num_heads: int | None) -> tuple[int, int]:
    """(u, r) of `kind` on `degree` ranks; ValueError unless the query heads split over the u ranks."""
    g = resolve(kind, degree, num_heads)
    return g.ulysses, g.ring


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
