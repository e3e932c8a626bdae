"""The static plans as candidates of the "dhp" strategy: DHP is never slower than the best static plan.

A static plan (`baselines`: N / d groups of d consecutive ranks, every sequence dealt to a group
and packed into micro-batches by next fit) is a valid DHP plan: groups of one degree are one point
of DHP's search space. The search does not always reach it (its packing balances work, its degrees
come from an exact allocation per packing, its placement is node-aware), so `solve_dhp` hands its
finished plan to `best_static` with the static plans its options allow, and keeps a static plan
when that is faster under the objective DHP minimises: the sum of the micro-batch makespans as
`build_plan` prices them (every group on its attention kind, inter-node links where its ranks span
nodes of `ranks_per_node`, shared compute lanes) plus what new programs cost (`ProgramCache`).
DHP's own plan wins ties. The DHP paper (arXiv 2602.21788, evaluation) compares against static
baselines hand-tuned over every degree; here that tuning is one of the planner's own candidates.

The candidates are cheap to rule out: each allowed degree is grouped by a vectorised next fit
(`baselines.static_assignments`) and the groups of all degrees are priced together
(`static_prices`); only a candidate priced below DHP's plan is built and priced again exactly as
the plan would be.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dhp_jax.planner.cost.pricing import group_times, makespans, sorted_unique
from dhp_jax.planner.solvers.baselines import static_assignments, static_degrees, static_micro_batches
from dhp_jax.planner.solvers.problem import Problem

__all__ = ["best_static", "static_prices"]


_SIZES: dict[tuple[int, int, int, bool], list[int]] = {}


def _kind_sizes(degree: int, cost: Any) -> list[int]:
    """The Ulysses sizes u > 1 of the kinds `pricing.best_kinds` may give a group of `degree` ranks
    (u divides the degree and the head count, u <= ranks_per_node); with a menu of programs, whose
    kinds are fixed per program, every divisor (a bound)."""
    key = (degree, cost.num_heads, cost.ranks_per_node, bool(cost.geometry.menu_kinds))
    if key not in _SIZES:
        us = [u for u in range(2, degree + 1) if degree % u == 0]
        _SIZES[key] = us if key[3] else [u for u in us if cost.num_heads % u == 0 and u <= cost.ranks_per_node]
    return _SIZES[key]


def _node_local(g: np.ndarray, d: int, u: int, rpn: int) -> np.ndarray:
    """Whether every Ulysses sub-group (u consecutive ranks) of static group g (ranks g d ..
    g d + d - 1) sits inside one node (`pricing.node_local`, vectorised over g)."""
    starts = (g * d)[:, None] + np.arange(0, d, u)[None, :]
    return np.all(starts // rpn == (starts + u - 1) // rpn, axis=1)


def static_prices(prob: Problem, degrees: list[int], attention: str
                  ) -> dict[int, tuple[dict[str, float], np.ndarray, np.ndarray]]:
    """For each static degree whose groups hold every sequence: its summed micro-batch makespans
    per attention mode ("ring" in "ring" mode; in "best" mode "best", each group on the fastest
    kind `pricing.best_kinds` allows it, "ulysses" where the head count allows Ulysses over d
    and the per-group choice may not give it to every group, and "ring" where kinds are fixed per
    program, so that "best" need not be the faster), and the (micro-batch, replica)
    of every sample (`baselines.static_assignments`). The groups of all degrees are priced
    together, with the functions `build_plan` prices with; with a menu of programs (kinds fixed per
    program) the "best" figure is a lower bound. Compile prices are not included."""
    N, cost, rpn = prob.num_ranks, prob.cost, prob.cost.ranks_per_node
    ds, chunks = static_assignments(prob.lengths, N, cost, degrees)
    if not ds:
        return {}
    D, K = chunks.shape
    dv = np.asarray(ds, dtype=np.int64)
    P = N // dv
    replica = np.arange(K)[None, :] % P[:, None]
    M = int(chunks.max()) + 1
    # one key per (degree, micro-batch, replica); a group's samples are summed in batch order, as
    # `bin_sums` sums them
    key = ((np.arange(D)[:, None] * M + chunks) * N + replica).ravel()
    size = D * M * N
    live = np.flatnonzero(np.bincount(key, minlength=size))
    # the three sums in one bincount: attention work, linear work and tokens at key, key + size, ...
    sums = np.bincount((key[None, :] + np.arange(0, 3 * size, size)[:, None]).ravel(),
                       np.tile(np.stack([prob.attn, prob.lin, prob.tok]), (1, D)).ravel(), minlength=3 * size)
    A, B, S = (sums[j * size + live] for j in range(3))
    mb, g = live // N, live % N       # mb: degree * M + micro-batch
    a = mb // M
    d = dv[a]
    inter = (g * d) // rpn != (g * d + d - 1) // rpn  # group g holds ranks g d .. g d + d - 1
    ring = group_times(cost, A, B, S, d, inter, "ring")
    # in "best" mode where kinds are fixed per program (`StreamGeometry.fixed_kinds`) a group's
    # kind can be slower than the ring on it: the all-ring plan is then a candidate of its own
    times = {"ring": ring} if attention == "ring" or cost.geometry.fixed_kinds else {}
    if attention == "best":
        lo = np.searchsorted(a, np.arange(D + 1)).tolist()  # the groups of degree k: lo[k]:lo[k + 1]
        idx, us, over = [], [], []
        for k, x in enumerate(ds):
            spans = bool(inter[lo[k]:lo[k + 1]].any()) and not cost.geometry.menu_kinds
            for u in _kind_sizes(x, cost):
                i = np.arange(lo[k], lo[k + 1])
                if spans and not (x % rpn == 0 and rpn % u == 0):  # (whole nodes in u-sized pieces)
                    i = i[_node_local(g[i], x, u, rpn)]  # Ulysses sub-groups over nodes may not run it
                idx.append(i)
                us.append(np.full(i.size, u))
            if x > 1 and cost.ulysses_ok(x) and (cost.geometry.menu_kinds or x > rpn or spans):
                over.append(k)  # all on Ulysses: a kind the per-group choice does not give these groups
        best = ring.copy()
        if idx:
            i, u = np.concatenate(idx), np.concatenate(us)
            # Ulysses over u times a ring over d / u (u = d: Ulysses), as `group_times` prices that
            # kind, every (group, u) at once; the smallest time wins, as in `best_kinds`
            np.minimum.at(best, i, group_times(cost, A[i], B[i], S[i], d[i], inter[i], "hybrid", u))
        # a group over nodes may run Ulysses over all its ranks where the heads allow (`best_kinds`)
        span = np.flatnonzero(inter & (d > 1) & (cost.num_heads % np.maximum(d, 1) == 0))
        if span.size:
            np.minimum.at(best, span, group_times(cost, A[span], B[span], S[span], d[span], True, "ulysses"))
        times["best"] = best
        if over:
            m = np.concatenate([np.arange(lo[k], lo[k + 1]) for k in over])
            t = np.full(ring.size, np.inf)
            t[m] = group_times(cost, A[m], B[m], S[m], d[m], inter[m], "ulysses")
            times["ulysses"] = t
    sums = {mode: makespans(cost, t, d, mb, D * M).reshape(D, M).sum(axis=1) for mode, t in times.items()}
    return {x: ({mode: float(v[k]) for mode, v in sums.items() if v[k] < np.inf}, chunks[k], replica[k])
            for k, x in enumerate(ds)}


def best_static(prob: Problem, allowed: np.ndarray, attention: str, num_micro_batches: int | None, packing: bool,
                dhp_price: float, dhp_exact: bool, exact_price: Any, compile_free: bool
                ) -> tuple[float, str, list, str, float] | None:
    """The static plan that beats DHP's, if one does: (price, name, micro-batches, attention mode,
    the price of DHP's own plan).

    Candidates: every degree d dividing N that `allowed` holds; with `num_micro_batches` only the
    degrees whose plan has that count; without `packing` only those whose groups hold one sequence
    each. Each is priced with the groups' kinds as DHP's mode gives them ("static-ring:<d>" in
    "ring" mode, "static-best:<d>" -- each group on its fastest kind -- in "best" mode), and in
    "best" mode, where the head count allows Ulysses over d, also all on Ulysses
    ("static-ulysses:<d>", the baseline itself: Ulysses over nodes is a kind the per-group choice
    leaves out), and where kinds are fixed per program (`StreamGeometry.fixed_kinds`: a program's
    kind, chosen for a group filled to its bucket, may price a fuller or emptier group above the
    ring) all on the ring ("static-ring:<d>", that baseline itself).

    `dhp_price`: the price of DHP's plan, or (`dhp_exact` False) a figure at or above it, then
    priced by `exact_price(None, None)` once a candidate comes in below it. `exact_price(mbs,
    mode)` prices a plan as DHP's search does, compile prices included; `static_prices` figures are
    that price unless programs have a price (`compile_free` False) or a menu fixes the kinds, and
    are then only a bound: such candidates are priced again. None when no candidate is strictly
    faster than DHP's plan (DHP's wins ties)."""
    N, cost = prob.num_ranks, prob.cost
    ok = set(allowed.tolist())
    degrees = [d for d in static_degrees(N, cost, "ring") if d in ok]
    cands = []
    for d, (prices, chunk, replica) in static_prices(prob, degrees, attention).items():
        if num_micro_batches is not None and int(chunk.max()) + 1 != num_micro_batches:
            continue
        if not packing and sorted_unique(chunk * (N // d) + replica).size != chunk.size:
            continue  # some group holds two sequences: not a plan without packing
        cands += [(t, d, mode, chunk, replica) for mode, t in prices.items() if t < dhp_price * (1 + 1e-9)]
    if not cands:
        return None
    exact = compile_free and not cost.geometry.fixed_kinds
    own = limit = dhp_price if dhp_exact else float(exact_price(None, None))
    best = None
    for t, d, mode, chunk, replica in sorted(cands, key=lambda c: c[:3]):
        if t >= limit * (1 - 1e-12 if exact else 1 + 1e-9):
            break
        mbs = static_micro_batches(chunk, replica, d, N)
        price = t if exact else float(exact_price(mbs, mode))
        if price < limit * (1 - 1e-12):
            name = {"ring": "static-ring", "ulysses": "static-ulysses", "best": "static-best"}[mode]
            limit, best = price, (price, f"{name}:{d}", mbs, mode, own)
    return best
