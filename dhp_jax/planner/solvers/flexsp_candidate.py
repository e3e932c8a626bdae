"""FlexSP's plan as a candidate of the "dhp" strategy: DHP is never slower than the "flexsp" baseline
where that candidate is priced.

FlexSP's plan (`flexsp.py`: length-sorted micro-batches, power-of-two groups from a MILP, placed
node-aware, all-to-all where the head count allows) is a valid DHP plan: groups of power-of-two
degrees are points of DHP's search space, and its kinds are kinds a DHP group may run. `solve_dhp`
hands its best plan so far (its search's, or a static plan's) to `best_flexsp`, which keeps FlexSP's
plan when that is faster under the objective DHP minimises (summed micro-batch makespans as
`build_plan` prices them plus new programs' compile prices), priced with FlexSP's own kinds and with
each group on its fastest kind (`pricing.best_kinds`), the lower of the two. The earlier plan wins
ties.

FlexSP's MILPs cost far more than DHP's search, so the candidate is solved only where that is cheap:
on at most `FLEXSP_CANDIDATE_MAX_RANKS` ranks, and only as far as it can still win (`solve_flexsp`'s
`limit`: counts and micro-batches whose work bounds reach the best price so far are not solved).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from dhp_jax.planner.contract.plan import PlanningError
from dhp_jax.planner.solvers.allocate import allowed_degrees
from dhp_jax.planner.solvers.problem import Problem

__all__ = ["FLEXSP_CANDIDATE_MAX_RANKS", "best_flexsp"]

# FlexSP's plan is a candidate up to this many ranks (its MILP has one slot per power-of-two group,
# 2N - 1 of them: at 16 ranks a few hundred integer variables per micro-batch)
FLEXSP_CANDIDATE_MAX_RANKS = 16


def best_flexsp(prob: Problem, allowed: np.ndarray, attention: str, num_micro_batches: int | None, packing: bool,
                node_aware: bool, limit: float, exact_price: Callable[[list, str], float]
                ) -> tuple[float, list, str] | None:
    """FlexSP's plan if it is strictly faster than `limit` (the price of DHP's best plan so far):
    (price, micro-batches, attention mode: "auto" for FlexSP's own kinds, "best" for each group's
    fastest), else None.

    Offered only in "best" mode (the "ring" ablation keeps every group on the ring), with node-aware
    placement (FlexSP places its groups so), on at most FLEXSP_CANDIDATE_MAX_RANKS ranks, and only
    where the options allow its plan: every power of two up to the ranks in `allowed`, the
    micro-batch count `num_micro_batches` when given, one sequence a group without `packing`. `exact_price(mbs,
    mode)` prices a plan as DHP's search does."""
    from dhp_jax.planner.solvers.flexsp import solve_flexsp  # lazy: the MILP solver loads only when used

    if attention != "best" or not node_aware or prob.num_ranks > FLEXSP_CANDIDATE_MAX_RANKS:
        return None
    ok = set(allowed.tolist())
    if not set(allowed_degrees(prob.num_ranks, "pow2").tolist()) <= ok:
        return None  # FlexSP's groups may take any power of two
    try:
        got = solve_flexsp(prob, num_micro_batches, limit=limit)
    except PlanningError:  # a sample longer than the largest power-of-two group holds, or the count
        return None
    if got is None:
        return None
    mbs = got[0]
    if not packing and any(len(samples) > 1 for mb in mbs for _, samples in mb):
        return None
    best = None
    for mode in ("auto", "best"):
        price = float(exact_price(mbs, mode))
        if price < limit * (1 - 1e-12) and (best is None or price < best[0]):
            best = (price, mbs, mode)
    return best
