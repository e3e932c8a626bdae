"""The `Plan` contract: micro-batches of CP groups `(ranks, degree, samples, attention)`, as versioned JSON.

Shared by the planner, the JAX sharding compiler, the torch backend, the simulator and the
experiments. `validate()` checks every invariant (docs/DESIGN.md, section 5) and names what is wrong.
Schema `dhp.plan/v2`: each group also carries its attention kind ("ring", "ulysses" or
"hybrid:<u>x<r>") and its real and padded token counts; `dhp.plan/v1` files load as ring groups
with no token figures.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any, Mapping, Sequence

from dhp_jax.planner.contract.errors import PlanningError, PlanValidationError
from dhp_jax.planner.contract.kinds import ATTENTION_KINDS, attention_split, resolve

SCHEMA = "dhp.plan/v2"
SCHEMA_V1 = "dhp.plan/v1"
__all__ = ["ATTENTION_KINDS", "Group", "MicroBatch", "Plan", "PlanValidationError", "PlanningError", "SCHEMA",
           "SCHEMA_V1", "attention_split", "spans_nodes"]


@dataclasses.dataclass(frozen=True)
class Group:
    """One CP group: `degree` ranks running `samples` (indices into the global batch) together,
    with attention of kind `attention` ("ring", "ulysses" or "hybrid:<u>x<r>"). `tokens` is the
    group's real stream length and `padded_tokens` the length the executor runs after bucket
    padding (`dhp_jax.geometry.layout.bucket_length`); 0 where unknown (v1 plans, hand-built groups)."""

    ranks: tuple[int, ...]
    degree: int
    samples: tuple[int, ...]
    attention: str = "ring"
    est_time_s: float = 0.0
    est_memory_bytes: float = 0.0
    tokens: int = 0
    padded_tokens: int = 0

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"ranks": list(self.ranks), "degree": self.degree, "samples": list(self.samples),
                             "attention": self.attention}
        if self.tokens:
            d["tokens"] = self.tokens
        if self.padded_tokens:
            d["padded_tokens"] = self.padded_tokens
        d["est_time_s"] = self.est_time_s
        if self.est_memory_bytes:
            d["est_memory_bytes"] = self.est_memory_bytes
        return d


def spans_nodes(ranks: Sequence[int], ranks_per_node: int) -> bool:
    """Whether a group on these ranks spans nodes of `ranks_per_node` (its links are inter-node)."""
    return len({r // ranks_per_node for r in ranks}) > 1


@dataclasses.dataclass(frozen=True)
class MicroBatch:
    groups: tuple[Group, ...]
    est_makespan_s: float = 0.0

    @property
    def samples(self) -> list[int]:
        return [s for g in self.groups for s in g.samples]


@dataclasses.dataclass(frozen=True)
class Plan:
    num_ranks: int
    micro_batches: tuple[MicroBatch, ...]
    ranks_per_node: int | None = None
    est_step_time_s: float = 0.0
    solver: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "micro_batches", tuple(self.micro_batches))
        if self.ranks_per_node is None:
            object.__setattr__(self, "ranks_per_node", self.num_ranks)

    # ------------------------------------------------------------------ views
    @property
    def groups(self) -> list[Group]:
        return [g for mb in self.micro_batches for g in mb.groups]

    @property
    def num_samples(self) -> int:
        return sum(len(g.samples) for g in self.groups)

    @property
    def degrees(self) -> list[list[int]]:
        return [[g.degree for g in mb.groups] for mb in self.micro_batches]

    @property
    def strategy(self) -> str:
        return str(self.solver.get("strategy", "?"))

    def decisions(self) -> dict[str, Any]:
        """What the plan decides, and nothing else: the rank count and, per micro-batch, each
        group's ranks, degree, samples, attention kind and `padded_tokens` (the stream length, hence
        the program, that the executors run; left out where it is 0: v1 plans and hand-built groups,
        whose executors pick the length). Estimates, real token counts (they follow from the samples)
        and solver metadata (timings, flags) are left out, so processes that planned the same batch
        the same way get equal decisions."""
        return {"num_ranks": self.num_ranks,
                "micro_batches": [[_group_decisions(g) for g in mb.groups] for mb in self.micro_batches]}

    def digest(self) -> str:
        """Short hash of `decisions()`: equal on every process that derived the same plan, down to
        the programs it runs (two processes whose bucket rules differ get different digests)."""
        return hashlib.sha256(json.dumps(self.decisions(), sort_keys=True).encode()).hexdigest()[:16]

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "num_ranks": self.num_ranks,
            "ranks_per_node": self.ranks_per_node,
            "micro_batches": [
                {"groups": [g.to_dict() for g in mb.groups], "est_makespan_s": mb.est_makespan_s}
                for mb in self.micro_batches
            ],
            "est_step_time_s": self.est_step_time_s,
            "solver": dict(self.solver),
        }

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=False)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], num_samples: int | None = None) -> "Plan":
        plan = _parse(d)
        plan.validate(num_samples=num_samples)
        return plan

    @classmethod
    def from_json(cls, text_or_dict: str | bytes | Mapping[str, Any], num_samples: int | None = None) -> "Plan":
        """Parse and validate a plan from a JSON string or an already parsed dict."""
        if isinstance(text_or_dict, (str, bytes)):
            try:
                d = json.loads(text_or_dict)
            except json.JSONDecodeError as e:
                raise PlanValidationError(f"plan JSON does not parse: {e}") from None
        else:
            d = text_or_dict
        return cls.from_dict(d, num_samples=num_samples)

    # ------------------------------------------------------------------ checks
    def validate(self, num_samples: int | None = None, cost: Any = None, num_devices: int | None = None,
                 num_heads: int | None = None) -> "Plan":
        """Check the invariants; raise `PlanValidationError` naming the offending group/sample.

        - every sample in exactly one group of exactly one micro-batch (and, with `num_samples`,
          the samples are exactly 0..num_samples-1);
        - the groups of a micro-batch use disjoint ranks within 0..num_ranks-1;
        - degree == len(ranks) >= 1;
        - the attention kind is known and its factors multiply to the degree; with `num_heads` (or
          a `cost` that knows `num_heads`) its Ulysses part divides the head count;
        - padded_tokens, where given, holds the tokens and splits into 2*degree zigzag chunks;
        - with `num_devices`: num_ranks does not exceed the devices available.
        Returns self so calls chain. Whether each group fits its per-rank memory is the cost
        model's question (`dhp_jax.planner.cost.plan_check.check_plan`), asked where plans are made.
        """
        if not isinstance(self.num_ranks, int) or self.num_ranks < 1:
            raise PlanValidationError(f"num_ranks must be a positive integer, got {self.num_ranks!r}")
        if self.ranks_per_node is not None and (not isinstance(self.ranks_per_node, int) or self.ranks_per_node < 1):
            raise PlanValidationError(f"ranks_per_node must be a positive integer, got {self.ranks_per_node!r}")
        if num_devices is not None and self.num_ranks > num_devices:
            raise PlanValidationError(
                f"plan needs {self.num_ranks} ranks but only {num_devices} devices are available")
        if not self.micro_batches:
            raise PlanValidationError("plan has no micro-batches")
        if num_heads is None and cost is not None and getattr(cost, "num_heads", None):
            num_heads = int(cost.num_heads)
        seen: dict[int, str] = {}
        for m, mb in enumerate(self.micro_batches):
            if not mb.groups:
                raise PlanValidationError(f"micro-batch {m} has no groups")
            used: dict[int, int] = {}
            for gi, g in enumerate(mb.groups):
                where = f"micro-batch {m} group {gi} (ranks {list(g.ranks)})"
                if g.degree != len(g.ranks) or g.degree < 1:
                    raise PlanValidationError(f"{where}: degree {g.degree} != number of ranks {len(g.ranks)}")
                if len(set(g.ranks)) != len(g.ranks):
                    raise PlanValidationError(f"{where}: a rank appears twice")
                _check_attention(g, where, num_heads)
                for r in g.ranks:
                    if not isinstance(r, int) or not 0 <= r < self.num_ranks:
                        raise PlanValidationError(f"{where}: rank {r!r} outside 0..{self.num_ranks - 1}")
                    if r in used:
                        raise PlanValidationError(f"{where}: rank {r} is also used by group {used[r]}")
                    used[r] = gi
                if not g.samples:
                    raise PlanValidationError(f"{where}: group has no samples")
                for s in g.samples:
                    if not isinstance(s, int) or s < 0:
                        raise PlanValidationError(f"{where}: sample id {s!r} is not a non-negative integer")
                    if num_samples is not None and s >= num_samples:
                        raise PlanValidationError(
                            f"{where}: sample {s} does not exist (batch has {num_samples} samples)")
                    if s in seen:
                        raise PlanValidationError(f"{where}: sample {s} is also in {seen[s]}")
                    seen[s] = where
        if num_samples is not None and len(seen) != num_samples:
            missing = sorted(set(range(num_samples)) - set(seen))
            raise PlanValidationError(
                f"samples missing from every group: {missing[:10]}{' ...' if len(missing) > 10 else ''}")
        return self


def _group_decisions(g: Group) -> dict[str, Any]:
    d: dict[str, Any] = {"ranks": list(g.ranks), "degree": g.degree, "samples": list(g.samples),
                         "attention": g.attention}
    if g.padded_tokens:  # absent rather than 0, so a plan without the figure hashes as before
        d["padded_tokens"] = g.padded_tokens
    return d


def _check_attention(g: Group, where: str, num_heads: int | None) -> None:
    try:
        u = resolve(g.attention, g.degree).ulysses
    except PlanValidationError as e:
        raise PlanValidationError(f"{where}: {e}") from None
    if num_heads is not None and num_heads % u:
        raise PlanValidationError(f"{where}: attention {g.attention!r} splits {num_heads} heads over {u} ranks; "
                                  f"Ulysses needs the head count divisible by its degree")
    if g.padded_tokens and (g.padded_tokens < g.tokens or g.padded_tokens % (2 * g.degree)):
        raise PlanValidationError(f"{where}: padded_tokens {g.padded_tokens} must hold tokens {g.tokens} and be "
                                  f"a multiple of 2*degree = {2 * g.degree}")


def _req(d: Mapping[str, Any], key: str, where: str) -> Any:
    if not isinstance(d, Mapping):
        raise PlanValidationError(f"{where}: expected an object, got {type(d).__name__}")
    if key not in d:
        raise PlanValidationError(f"{where}: missing field {key!r}")
    return d[key]


def _int_list(x: Any, where: str) -> tuple[int, ...]:
    if not isinstance(x, (list, tuple)) or not all(isinstance(v, int) and not isinstance(v, bool) for v in x):
        raise PlanValidationError(f"{where}: expected a list of integers, got {x!r}")
    return tuple(x)


def _parse(d: Mapping[str, Any]) -> Plan:
    schema = _req(d, "schema", "plan")
    if schema not in (SCHEMA, SCHEMA_V1):
        raise PlanValidationError(f"plan schema is {schema!r}, expected {SCHEMA!r} (or {SCHEMA_V1!r})")
    v1 = schema == SCHEMA_V1
    mbs = []
    for m, mbd in enumerate(_req(d, "micro_batches", "plan")):
        groups = []
        for gi, gd in enumerate(_req(mbd, "groups", f"micro-batch {m}")):
            where = f"micro-batch {m} group {gi}"
            degree = _req(gd, "degree", where)
            if not isinstance(degree, int) or isinstance(degree, bool):
                raise PlanValidationError(f"{where}: degree must be an integer, got {degree!r}")
            attention = "ring" if v1 else _req(gd, "attention", where)   # v1 plans ran every group as ring
            if not isinstance(attention, str):
                raise PlanValidationError(f"{where}: attention must be a string, got {attention!r}")
            counts = [0, 0] if v1 else [gd.get(k, 0) for k in ("tokens", "padded_tokens")]
            if not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in counts):
                raise PlanValidationError(f"{where}: tokens / padded_tokens must be integers >= 0, got {counts}")
            groups.append(Group(ranks=_int_list(_req(gd, "ranks", where), f"{where} ranks"), degree=degree,
                                samples=_int_list(_req(gd, "samples", where), f"{where} samples"),
                                attention=attention, est_time_s=float(gd.get("est_time_s", 0.0)),
                                est_memory_bytes=float(gd.get("est_memory_bytes", 0.0)),
                                tokens=counts[0], padded_tokens=counts[1]))
        mbs.append(MicroBatch(tuple(groups), float(mbd.get("est_makespan_s", 0.0))))
    num_ranks = _req(d, "num_ranks", "plan")
    rpn = d.get("ranks_per_node", num_ranks)
    return Plan(num_ranks=num_ranks, micro_batches=tuple(mbs), ranks_per_node=rpn,
                est_step_time_s=float(d.get("est_step_time_s", 0.0)), solver=dict(d.get("solver", {})))
