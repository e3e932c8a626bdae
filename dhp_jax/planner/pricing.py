"""Plan pricing: the time of every group of a plan, each micro-batch's makespan and the step time.

The one place a plan is priced under a `CostModel`: `build_plan` fills a plan's estimates with it,
the strategy comparison and the simulator (`dhp_jax.sim.step_time`, `sim.evaluate`) time plans
with it. A group is priced under its own attention kind (`Group.attention`), with inter-node links
when its ranks span nodes of `ranks_per_node`. A step is the sum of the micro-batch makespans (the
cost model says how concurrent groups combine, shared CPU lanes included) plus one gradient
all-reduce.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from dhp_jax.planner.cost import CostModel
from dhp_jax.planner.kinds import attention_kinds
from dhp_jax.planner.packing import bin_sums
from dhp_jax.planner.placement import spans_nodes
from dhp_jax.planner.plan import attention_split

__all__ = ["attention_for", "best_kinds", "group_kind_times", "kind_times", "plan_group_times", "plan_makespans", "price_groups", "spans_nodes",
           "step_time"]


def attention_for(degree: int, cost: CostModel, attention: str) -> str:
    """The kind a group of `degree` ranks records for a strategy's mode: "auto" (FlexSP's groups) is
    all-to-all where the head count allows it, ring otherwise; a single rank has no sequence
    exchange at all, so a degree-1 group is always "ring" (both kinds price it the same)."""
    if degree == 1:
        return "ring"
    if attention == "auto":
        return "ulysses" if cost.ulysses_ok(degree) else "ring"
    return attention


def kind_times(cost: CostModel, A: Any, B: Any, S: Any, degree: Any, inter_node: Any,
               kinds: Sequence[str]) -> np.ndarray:
    """`cost.group_times` of each group under its own attention kind (vectorised per kind)."""
    A, B, S, d, inter = np.broadcast_arrays(*(np.asarray(x) for x in (A, B, S, degree, inter_node)))
    kinds = np.asarray(list(kinds), dtype=object)
    out = np.zeros(d.shape, dtype=np.float64)
    for kind in dict.fromkeys(kinds.tolist()):
        m = kinds == kind
        out[m] = cost.group_times(A[m], B[m], S[m], d[m], inter[m], kind)
    return out


def node_local(ranks: Sequence[int], ulysses: int, ranks_per_node: int) -> bool:
    """Whether every Ulysses sub-group (u consecutive ranks of the group) sits inside one node."""
    return all(len({r // ranks_per_node for r in ranks[i:i + ulysses]}) == 1
               for i in range(0, len(ranks), ulysses))


def best_kinds(cost: CostModel, groups: Sequence[tuple[Sequence[int], Sequence[int]]],
               terms: tuple[np.ndarray, np.ndarray, np.ndarray]) -> list[str]:
    """The fastest attention kind of each group (ranks, sample ids) under the cost model: ring, or
    Ulysses over u ranks times a ring over d/u (`kinds.attention_kinds`: u divides the degree and
    the head count, u <= ranks_per_node) where each Ulysses sub-group sits inside one node. Ties
    keep the ring; a free choice never prices a group above its ring time.

    With `cost.menu_kinds` (a menu of programs, each with its one kind) a group whose degree and
    padded length are a menu program runs that program's kind, wherever its Ulysses sub-groups sit
    inside nodes (else the ring, a program off the menu); only groups off the menu choose."""
    A, B, S = bin_sums([samples for _, samples in groups], *terms)
    d = np.fromiter((len(ranks) for ranks, _ in groups), dtype=np.int64, count=len(groups))
    rpn = cost.ranks_per_node
    inter = np.fromiter((spans_nodes(ranks, rpn) for ranks, _ in groups), dtype=bool, count=len(groups))
    kinds = ["ring"] * len(groups)
    times = cost.group_times(A, B, S, d, inter, "ring")
    free = np.ones(len(groups), dtype=bool)
    if cost.menu_kinds and len(groups):
        fixed = {(deg, b): k for deg, b, k in cost.menu_kinds}
        padded = np.broadcast_to(cost.padded_length(S, d), d.shape)
        for i, (deg, p) in enumerate(zip(d.tolist(), padded.tolist())):
            kind = fixed.get((deg, int(p)))
            if kind is None:
                continue
            free[i] = False
            u = attention_split(kind, deg)[0]
            if u > 1 and (not inter[i] or node_local(groups[i][0], u, rpn)):
                kinds[i] = kind
    for deg in sorted(set(d.tolist()) - {1}):
        idx = np.flatnonzero((d == deg) & free)
        if not idx.size:
            continue
        for kind in attention_kinds(deg, cost.num_heads, rpn)[1:]:
            u = attention_split(kind, deg)[0]
            # a group inside one node has node-local sub-groups; only spanning groups need a look
            ok = idx[[not inter[i] or node_local(groups[i][0], u, rpn) for i in idx.tolist()]]
            if not ok.size:
                continue
            t = cost.group_times(A[ok], B[ok], S[ok], deg, inter[ok], kind)
            better = t < times[ok]
            for i in ok[better].tolist():
                kinds[i] = kind
            times[ok[better]] = t[better]
    return kinds


def group_kind_times(cost: CostModel, plan: Any, lengths: Sequence[int] | np.ndarray,
                     etas: Sequence[float] | np.ndarray | None = None) -> list[dict[str, float]]:
    """Each group of `plan` (plan order): its seconds under every attention kind it can run on its
    ranks (the kinds `best_kinds` considers: ring, and each Ulysses size whose sub-groups sit inside
    nodes), {kind: s}."""
    attn, lin, tok = cost.terms(np.asarray(lengths), etas)
    groups = list(plan.groups)
    A, B, S = bin_sums([list(g.samples) for g in groups], attn, lin, tok)
    rpn = cost.ranks_per_node
    out = []
    for i, g in enumerate(groups):
        inter = spans_nodes(g.ranks, rpn)
        kinds = [k for k in attention_kinds(g.degree, cost.num_heads, rpn)
                 if k == "ring" or not inter or node_local(g.ranks, attention_split(k, g.degree)[0], rpn)]
        out.append({k: float(cost.group_times(A[i], B[i], S[i], g.degree, inter, k)) for k in kinds})
    return out


def price_groups(cost: CostModel, groups: Sequence[tuple[Sequence[int], Sequence[int]]],
                 terms: tuple[np.ndarray, np.ndarray, np.ndarray], kinds: Sequence[str], ranks_per_node: int
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(time, tokens S, degree) of each group given as (ranks, sample ids) with its attention kind,
    from the per-sample `terms` (attention work, linear work, tokens: `CostModel.terms`)."""
    A, B, S = bin_sums([samples for _, samples in groups], *terms)
    d = np.fromiter((len(ranks) for ranks, _ in groups), dtype=np.int64, count=len(groups))
    inter = np.fromiter((spans_nodes(ranks, ranks_per_node) for ranks, _ in groups), dtype=bool, count=len(groups))
    return kind_times(cost, A, B, S, d, inter, kinds), S, d


def plan_group_times(plan: Any, lengths: Sequence[int] | np.ndarray, cost: CostModel,
                     etas: Sequence[float] | np.ndarray | None = None
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Time of every group of `plan` (vectorised): (seconds, degree, micro-batch index), one entry
    per group in plan order. Raises ValueError naming the group if it names a missing sample."""
    lengths = np.asarray(lengths)
    attn, lin, tok = cost.terms(lengths, etas)
    groups = [(m, g) for m, mb in enumerate(plan.micro_batches) for g in mb.groups]
    n = len(groups)
    if not n:
        raise ValueError("plan has no groups")
    sizes = np.fromiter((len(g.samples) for _, g in groups), dtype=np.int64, count=n)
    idx = np.fromiter((s for _, g in groups for s in g.samples), dtype=np.int64, count=int(sizes.sum()))
    if idx.size and (idx.min() < 0 or idx.max() >= lengths.size):
        bad = int(np.flatnonzero((idx < 0) | (idx >= lengths.size))[0])
        gi = int(np.searchsorted(np.cumsum(sizes), bad, side="right"))
        m, g = groups[gi]
        raise ValueError(f"micro-batch {m} group with ranks {list(g.ranks)}: sample {int(idx[bad])} is outside "
                         f"the batch of {lengths.size} samples")
    t, _, d = price_groups(cost, [(g.ranks, g.samples) for _, g in groups], (attn, lin, tok),
                           [g.attention for _, g in groups], plan.ranks_per_node or plan.num_ranks)
    mb = np.fromiter((m for m, _ in groups), dtype=np.int64, count=n)
    return t, d, mb


def plan_makespans(plan: Any, lengths: Sequence[int] | np.ndarray, cost: CostModel,
                   etas: Sequence[float] | np.ndarray | None = None) -> np.ndarray:
    """Makespan of each micro-batch of `plan` (lanes-aware on shared cores: `CostModel.makespans`)."""
    t, d, mb = plan_group_times(plan, lengths, cost, etas)
    return cost.makespans(t, d, mb, len(plan.micro_batches))


def step_time(plan: Any, lengths: Sequence[int] | np.ndarray, cost: CostModel,
              etas: Sequence[float] | np.ndarray | None = None) -> float:
    """Seconds of one training step of `plan`: its micro-batch makespans plus the gradient
    all-reduce over all ranks (groups of a micro-batch run concurrently; with
    `cost.compute_lanes` they also share those cores)."""
    return float(plan_makespans(plan, lengths, cost, etas).sum() + cost.allreduce_time(plan.num_ranks))
