"""Static baselines in the same API: one CP degree for every sequence, as Megatron CP / DeepSpeed-Ulysses.

"static-ring:<d>" / "static-ulysses:<d>": the N ranks form N // d groups of d consecutive ranks (the
data-parallel replicas); sample i goes to replica i mod (N // d), as a distributed sampler deals a
global batch; each replica runs its share in order, in micro-batches filled up to its memory
(next fit), which is the fewest micro-batches the memory allows. ":best" tries every degree that
divides N (and, for Ulysses, the head count) and keeps the least estimated step time, as the paper
hand-tuned its baselines.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dhp_jax.planner.contract.plan import PlanningError
from dhp_jax.planner.cost.memory import max_tokens_per_rank
from dhp_jax.planner.cost.model import CostModel
from dhp_jax.planner.cost.pricing import step_time
from dhp_jax.planner.solvers.build import build_plan


def static_groups(lengths: np.ndarray, num_ranks: int, cost: CostModel, degree: int, attention: str
                  ) -> list[list[tuple[tuple[int, ...], list[int]]]]:
    """Micro-batches of (ranks, samples) for one static degree; PlanningError when infeasible."""
    if attention == "ulysses" and not cost.ulysses_ok(degree):
        raise PlanningError(f"static-ulysses:{degree}: the head count {cost.num_heads} is not divisible by {degree}")
    if degree < 1 or degree > num_ranks:
        raise PlanningError(f"static degree {degree} must be in 1..{num_ranks}")
    cap = degree * max_tokens_per_rank(cost)
    too_long = np.flatnonzero(lengths > cap)
    if too_long.size:
        k = int(too_long[0])
        raise PlanningError(f"static degree {degree}: sample {k} of {int(lengths[k])} tokens exceeds the "
                            f"{int(cap)} tokens {degree} ranks can hold")
    P = num_ranks // degree
    chunks: list[list[list[int]]] = []
    for g in range(P):
        mine = list(range(g, len(lengths), P))
        cs: list[list[int]] = []
        used = 0.0
        for k in mine:
            if not cs or used + lengths[k] > cap:
                cs.append([])
                used = 0.0
            cs[-1].append(k)
            used += float(lengths[k])
        chunks.append(cs)
    M = max(len(c) for c in chunks)
    return [[(tuple(range(g * degree, (g + 1) * degree)), chunks[g][m]) for g in range(P) if m < len(chunks[g])]
            for m in range(M)]


def static_degrees(num_ranks: int, cost: CostModel, attention: str) -> list[int]:
    ds = [d for d in range(1, num_ranks + 1) if num_ranks % d == 0]
    if attention == "ulysses":
        ds = [d for d in ds if cost.ulysses_ok(d)]
    return ds


def solve_static(prob: Any, attention: str, arg: str, strategy: str) -> tuple[list, dict[str, Any]]:
    """"static-<kind>:<d>" groups, or for ":best" those of the degree with the least step time."""
    N, cost = prob.num_ranks, prob.cost
    if arg == "best":
        cands = static_degrees(N, cost, attention)
        best = None
        errors = []
        for d in cands:
            try:
                mbs = static_groups(prob.lengths, N, cost, d, attention)
            except PlanningError as e:
                errors.append(str(e))
                continue
            t = step_time(build_plan(mbs, prob.lengths, prob.etas, cost, N, {"attention": attention}, attention),
                          prob.lengths, cost, prob.etas)
            if best is None or t < best[0]:
                best = (t, d, mbs)
        if best is None:
            raise PlanningError(f"{strategy}: no degree among {cands} fits this batch ({errors[-1] if errors else ''})")
        return best[2], {"degree": best[1], "tried": cands}
    try:
        d = int(arg)
    except ValueError:
        raise PlanningError(f"unknown strategy {strategy!r}: the degree must be an integer or 'best'") from None
    return static_groups(prob.lengths, N, cost, d, attention), {"degree": d}
