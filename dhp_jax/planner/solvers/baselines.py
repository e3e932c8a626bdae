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

from dhp_jax.planner.contract.kinds import resolve
from dhp_jax.planner.contract.plan import PlanningError
from dhp_jax.planner.cost.memory import max_tokens_per_rank
from dhp_jax.planner.cost.model import CostModel
from dhp_jax.planner.cost.pricing import step_time
from dhp_jax.planner.solvers.build import build_plan


def runs_on(attention: str, degree: int, cost: CostModel) -> bool:
    """Whether the kind named `attention` runs on `degree` ranks under the model's query heads (the
    contract's `resolve`: its Ulysses ranks must divide the head count)."""
    try:
        resolve(attention, degree, cost.num_heads)
    except ValueError:
        return False
    return True


def static_groups(lengths: np.ndarray, num_ranks: int, cost: CostModel, degree: int, attention: str
                  ) -> list[list[tuple[tuple[int, ...], list[int]]]]:
    """Micro-batches of (ranks, samples) for one static degree; PlanningError when infeasible."""
    if not runs_on(attention, degree, cost):
        raise PlanningError(f"static-{attention}:{degree}: the head count {cost.num_heads} is not divisible by {degree}")
    if degree < 1 or degree > num_ranks:
        raise PlanningError(f"static degree {degree} must be in 1..{num_ranks}")
    got = static_assignment(lengths, num_ranks, cost, degree)
    if got is None:
        cap = degree * max_tokens_per_rank(cost)
        k = int(np.flatnonzero(np.asarray(lengths) > cap)[0])
        raise PlanningError(f"static degree {degree}: sample {k} of {int(lengths[k])} tokens exceeds the "
                            f"{int(cap)} tokens {degree} ranks can hold")
    return static_micro_batches(*got, degree, num_ranks)


def static_assignment(lengths: np.ndarray, num_ranks: int, cost: CostModel, degree: int
                      ) -> tuple[np.ndarray, np.ndarray] | None:
    """(micro-batch, replica) of every sample for one static degree (int64[K] each), or None when a
    sample exceeds what `degree` ranks hold (`static_assignments`)."""
    ds, chunks = static_assignments(lengths, num_ranks, cost, [degree])
    if not ds:
        return None
    return chunks[0], np.arange(chunks.shape[1], dtype=np.int64) % (num_ranks // degree)


def static_assignments(lengths: np.ndarray, num_ranks: int, cost: CostModel, degrees: list[int]
                       ) -> tuple[list[int], np.ndarray]:
    """The micro-batch of every sample for each static degree of `degrees` (each dividing N) that
    holds every sample: (those degrees, int64[D, K]).

    Replica g of the P = N // d takes samples g, g + P, g + 2P, ... in order, each in the current
    micro-batch while that stays within the group's tokens, else in the next (next fit).
    Vectorised over the replicas of every degree at once: one step per micro-batch, each finding
    every replica's next cut with one `searchsorted` on the replicas' running token sums laid end
    to end (each replica's shifted above the one before)."""
    L = np.asarray(lengths).astype(np.int64)
    K, mpt = L.size, max_tokens_per_rank(cost)
    longest = int(L.max()) if K else 0
    ds = [int(d) for d in degrees if not longest > d * mpt]
    if not ds:
        return [], np.zeros((0, K), dtype=np.int64)
    P = np.asarray([num_ranks // d for d in ds], dtype=np.int64)
    J = -(-K // P)                                   # samples per replica, at most
    rows = np.repeat(np.arange(len(ds)), P)          # replica rows of all degrees, degree by degree
    row_len = J[rows]
    row_start = np.concatenate([[0], np.cumsum(row_len)[:-1]])
    g = np.arange(rows.size) - np.repeat(np.cumsum(P) - P, P)  # replica index within its degree
    n = (K - g + P[rows] - 1) // P[rows]                       # samples of each replica
    i = np.arange(K)
    pos = (row_start[np.cumsum(P) - P][:, None] + (i[None, :] % P[:, None]) * J[:, None]
           + i[None, :] // P[:, None])                         # flat slot of sample i for each degree
    vals = np.zeros(int(row_len.sum()), dtype=np.int64)
    vals[pos] = L[None, :]
    cs = np.cumsum(vals)
    cs -= np.repeat(cs[row_start] - vals[row_start], row_len)  # running sums within each row
    # integer tokens: `used + length > cap` is `running sum > base + floor(cap)`
    capi = np.floor(np.asarray(ds, dtype=np.float64) * mpt).astype(np.int64)[rows]
    span = int(L.sum()) + int(capi.max()) + 1        # a row's sums never reach the next row's shift
    r_all = np.arange(rows.size, dtype=np.int64)
    flat = cs + np.repeat(r_all * span, row_len)
    marks = np.zeros(vals.size + 1, dtype=np.int64)
    start = np.zeros(rows.size, dtype=np.int64)
    base = np.zeros(rows.size, dtype=np.int64)
    r = r_all[n > 0]
    while r.size:
        marks[row_start[r] + start[r]] = 1           # a micro-batch starts here
        cut = np.searchsorted(flat, r * span + base[r] + capi[r], side="right") - row_start[r]
        end = np.minimum(cut, n[r])
        base[r] = cs[row_start[r] + end - 1]
        start[r] = end
        r = r[end < n[r]]
    mc = np.cumsum(marks[:-1])
    chunk = mc - np.repeat(mc[row_start] - marks[row_start], row_len) - 1
    return ds, chunk[pos]


def static_micro_batches(chunk: np.ndarray, replica: np.ndarray, degree: int, num_ranks: int
                         ) -> list[list[tuple[tuple[int, ...], list[int]]]]:
    """The micro-batches of a `static_assignment`: per micro-batch, (ranks g d .. g d + d - 1,
    samples in batch order) of every replica g that has samples in it, replicas in order."""
    P = num_ranks // degree
    M = int(chunk.max()) + 1 if chunk.size else 0
    gid = chunk * P + replica
    order = np.argsort(gid, kind="stable")        # by (micro-batch, replica), samples in batch order
    keys, first = np.unique(gid[order], return_index=True)
    bounds = first.tolist()[1:] + [order.size]
    mbs: list[list[tuple[tuple[int, ...], list[int]]]] = [[] for _ in range(M)]
    for key, a, b in zip(keys.tolist(), first.tolist(), bounds):
        m, g = divmod(key, P)
        mbs[m].append((tuple(range(g * degree, (g + 1) * degree)), order[a:b].tolist()))
    return mbs


def static_degrees(num_ranks: int, cost: CostModel, attention: str) -> list[int]:
    return [d for d in range(1, num_ranks + 1) if num_ranks % d == 0 and runs_on(attention, d, cost)]


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
