"""Exact degree allocation for a fixed packing: least makespan of atomic groups on N ranks.

Given K' atomic groups with summed cost terms (A_i, B_i, S_i) and minimal degrees dmin_i, choose a
degree d_i from the allowed set for each so that sum d_i <= N and max_i T_i(d_i) is least.

Instead of the paper's O(K' N^2) table DP this runs a parametric search on the makespan, in its
incremental form: every group starts at its least feasible degree; the bottleneck group is raised
to the next degree at which its time strictly drops below its current time; it stops when that raise
does not fit in N. Invariant: every degree below d_i has time >= the makespan at which group i was
last raised, so any plan with a smaller makespan needs more than N ranks; hence the result is
optimal (ties included) for any per-group times, monotone in d or not. Exactness is for this
per-group model (makespan = max_i T_i); on shared-core hosts (`CostModel.compute_lanes`) the
machine-wide lanes cap of `CostModel.makespans` is applied by the caller when comparing candidates. Each raise costs O(log K')
plus the scalar evaluations walked, O((K' + N) log K') overall.
"""

from __future__ import annotations

import functools
import heapq
from typing import Sequence

import numpy as np

from dhp_jax.data.layout import scalar_bucketer
from dhp_jax.planner.cost import CostModel


def allowed_degrees(num_ranks: int, degrees: str | Sequence[int] = "any", cost: CostModel | None = None,
                    attention: str = "ring") -> np.ndarray:
    """Sorted int64 array of degrees a group may take ("any", "pow2" or an explicit list)."""
    if isinstance(degrees, str):
        if degrees == "any":
            ds = np.arange(1, num_ranks + 1)
        elif degrees == "pow2":
            ds = 2 ** np.arange(0, int(np.log2(num_ranks)) + 1)
        else:
            raise ValueError(f"degrees must be 'any', 'pow2' or a list of integers, got {degrees!r}")
    else:
        ds = np.unique(np.asarray(list(degrees), dtype=np.int64))
        if ds.size == 0 or ds.min() < 1:
            raise ValueError(f"degrees must be positive integers, got {list(degrees)}")
    ds = ds[ds <= num_ranks]
    if attention == "ulysses" and cost is not None:
        ds = np.array([d for d in ds if cost.ulysses_ok(int(d))], dtype=np.int64)
    return ds.astype(np.int64)


class _ScalarTime:
    """Scalar T_i(d) without NumPy overhead (the search evaluates a few thousand of them)."""

    def __init__(self, cost: CostModel, attention: str):
        # shared lanes: the closed form below does not hold; price every evaluation with the
        # cost model itself so the search stays exact for it
        self.exact = None
        if cost.compute_lanes is not None:
            self.exact = (cost, attention)
        self.cost = cost  # padded buckets: the scalar bucket rule, then the closed form
        self.bucket = scalar_bucketer(cost.bucket_min, cost.bucket_growth, cost.max_tokens_per_rank,
                                      cost.bucket_menu) if cost.bucket_min else None
        self.overlap = attention == "ring" and cost.comm_overlap
        self.b1 = cost.b1
        self.rpn = cost.ranks_per_node
        self.c_intra = float(cost.comm_per_token(False, attention))
        self.c_inter = float(cost.comm_per_token(True, attention))
        self.l_intra, self.l_inter = cost.lat_intra, cost.lat_inter
        self.ring = attention == "ring"

    def __call__(self, A: float, B: float, S: float, d: int) -> float:
        if self.exact is not None:
            return float(self.exact[0].group_times(A, B, S, d, attention=self.exact[1]))
        c = self.cost
        if self.bucket is not None:
            P = self.bucket(S, d)  # = c.padded_length(S, d)
            if c.padded_attention:
                A = c.a1 * P * P
            B, S = B + c.a2 * (P - S), P
        sent = S * (d - 1) / d if self.ring else S / d * (d - 1) / d  # CostModel.sent_tokens
        if d > self.rpn:
            comm = self.c_inter * sent + self.l_inter * (d - 1)
        else:
            comm = self.c_intra * sent + self.l_intra * (d - 1)
        if self.overlap:
            comm = max(comm - A / d, 0.0)
        return (A + B) / d + self.b1 + comm


class _LazyFloats:
    """Read-only float view of an array, converting only the entries the search touches."""

    def __init__(self, arr: np.ndarray):
        self.arr = arr

    def __getitem__(self, i: int) -> float:
        return self.arr.item(i)


@functools.lru_cache(maxsize=64)
def _scalar_time(cost: CostModel, attention: str) -> _ScalarTime:
    return _ScalarTime(cost, attention)


_last: tuple = (None, None, None)  # (cost, attention, _ScalarTime) of the latest call, one reference


def scalar_time(cost: CostModel, attention: str = "ring") -> _ScalarTime:
    """A cached `_ScalarTime` (CostModel is frozen, hence hashable). The same model object as the
    latest call skips hashing it: a plan asks hundreds of times, and a model's hash walks all its
    fields. (The tuple is read and replaced whole, so planner threads never mix two entries.)"""
    global _last
    last = _last
    if last[0] is cost and last[1] == attention:
        return last[2]
    t = _scalar_time(cost, attention)
    _last = (cost, attention, t)
    return t


def allocate(A: Sequence[float], B: Sequence[float], S: Sequence[float], dmin: Sequence[int], num_ranks: int,
             cost: CostModel, allowed: np.ndarray | None = None, attention: str = "ring"
             ) -> tuple[np.ndarray, float] | None:
    """Optimal degrees (int64[K']) and makespan, or None when the groups cannot fit on `num_ranks`.

    Group times use `cost` with inter-node links exactly when d > ranks_per_node (placement keeps
    smaller groups inside a node where it can).
    """
    K = len(A)
    if K == 0:
        return np.zeros(0, dtype=np.int64), 0.0
    ds = np.arange(1, num_ranks + 1) if allowed is None else np.asarray(allowed, dtype=np.int64)
    ds_list = [int(x) for x in ds]
    if not ds_list:
        return None
    t = scalar_time(cost, attention)
    starts = np.searchsorted(ds, np.asarray(dmin, dtype=np.int64), side="left")
    if np.any(starts >= len(ds_list)):
        return None
    if int(ds[starts].sum()) > num_ranks:
        return None
    if K == 1:  # one group: the least degree among those reaching its least time, vectorised
        cand = ds[starts[0]:]
        cand = cand[cand <= num_ranks]
        times = cost.group_times(A[0], B[0], S[0], cand, attention=attention)
        j = int(np.argmin(times))
        return np.asarray([cand[j]], dtype=np.int64), float(times[j])
    if K >= _WARM_MIN_GROUPS:
        An, Bn, Sn = (np.asarray(x, dtype=np.float64) for x in (A, B, S))
        starts = _warm_start(starts, ds, num_ranks, cost, An, Bn, Sn, attention)
        t0 = cost.group_times(An, Bn, Sn, ds[starts], attention=attention).tolist()
        Af, Bf, Sf = _LazyFloats(An), _LazyFloats(Bn), _LazyFloats(Sn)  # few entries are ever read
    else:
        Af, Bf, Sf = (np.asarray(x, dtype=np.float64).tolist() for x in (A, B, S))
        t0 = [t(Af[i], Bf[i], Sf[i], ds_list[p]) for i, p in enumerate(starts.tolist())]
    pos = starts.tolist()
    deg = [ds_list[p] for p in pos]
    used = sum(deg)
    heap = [(-t0[i], i) for i in range(K)]
    heapq.heapify(heap)
    last = len(ds_list)
    while True:
        neg, i = heap[0]
        cur = -neg
        budget = num_ranks - used + deg[i]  # the most ranks group i could hold
        p = pos[i] + 1
        found = -1
        while p < last and ds_list[p] <= budget:
            if t(Af[i], Bf[i], Sf[i], ds_list[p]) < cur:
                found = p
                break
            p += 1
        if found < 0:
            break
        used += ds_list[found] - deg[i]
        pos[i], deg[i] = found, ds_list[found]
        heapq.heapreplace(heap, (-t(Af[i], Bf[i], Sf[i], deg[i]), i))
    return np.asarray(deg, dtype=np.int64), float(-heap[0][0])


_WARM_MIN_GROUPS = 24  # below this the scalar search is cheaper than the vectorised bisection
_WARM_ITERS = 14  # the bound only needs to be good, not tight: exactness never depends on it


def _warm_start(starts: np.ndarray, ds: np.ndarray, num_ranks: int, cost: CostModel,
                A: np.ndarray, B: np.ndarray, S: np.ndarray, attention: str) -> np.ndarray:
    """Raise the starting degrees without losing exactness.

    If T_ub is the makespan of some feasible degree vector, the optimum V <= T_ub. Since
    T_i(d) >= work_i / d + b1, every degree below work_i / (T_ub - b1) has a time above T_ub >= V,
    so the search may start there: the invariant of `allocate` (degrees below d_i are no better
    than the final makespan) holds. The feasible vector comes from a bisection on the
    communication-free time, whose degrees are the least with work_i / d + b1 <= T.
    """
    work = A + B
    b1 = cost.b1
    last = len(ds) - 1

    def degrees_for(T: float) -> np.ndarray:
        need = np.ceil(work / (T - b1) * (1 - 1e-12))
        return np.maximum(starts, np.searchsorted(ds, need, side="left"))

    hi = b1 + float(np.max(work / ds[starts])) * (1 + 1e-9) + 1e-300
    lo = b1 + float(work.sum()) / num_ranks
    if not hi > lo:
        return starts
    for _ in range(_WARM_ITERS):
        mid = 0.5 * (lo + hi)
        p = degrees_for(mid)
        if p.max() <= last and int(ds[p].sum()) <= num_ranks:
            hi = mid
        else:
            lo = mid
    p = degrees_for(hi)
    if p.max() > last or int(ds[p].sum()) > num_ranks:
        return starts
    t_ub = float(np.max(cost.group_times(A, B, S, ds[p], attention=attention)))
    if t_ub <= b1:
        return starts
    return degrees_for(t_ub)


def brute_force(A: Sequence[float], B: Sequence[float], S: Sequence[float], dmin: Sequence[int], num_ranks: int,
                cost: CostModel, allowed: np.ndarray | None = None, attention: str = "ring") -> float | None:
    """Reference: least makespan over every degree vector (small instances only, for tests)."""
    ds = list(range(1, num_ranks + 1)) if allowed is None else [int(x) for x in allowed]
    best = [None]

    def rec(i: int, left: int, worst: float) -> None:
        if best[0] is not None and worst >= best[0]:
            return
        if i == len(A):
            best[0] = worst
            return
        for d in ds:
            if d < dmin[i] or d > left:
                continue
            ti = float(cost.group_times(A[i], B[i], S[i], d, attention=attention))
            rec(i + 1, left - d, max(worst, ti))

    rec(0, num_ranks, 0.0)
    return best[0]
