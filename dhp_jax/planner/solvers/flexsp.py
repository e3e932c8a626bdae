"""The "flexsp" baseline: FlexSP's planner (ASPLOS'25) rebuilt on this project's cost model.

What it does, after the paper and its published solver:
1. Micro-batches: the global batch sorted by length and cut into M consecutive runs of about equal
   tokens (`microbatch.by_length`), for M from the least count whose runs fit the ranks' memory
   upward while the step time improves, at most `FLEXSP_EXTRA_COUNTS` more; the best count wins.
2. Per micro-batch a MILP over power-of-two sequence-parallel groups: the sequences are bucketed by
   length (a bucket holds a run of the sorted lengths; each count is grown from 16 until the padded
   tokens are at most halfway between the real tokens and the ranks' capacity, FlexSP's rule);
   counts that cannot beat the best so far (total work / N + M b1 >= its step) are skipped;
   n[k, p] sequences of bucket k go to slot p of fixed degree d_p, m_p says whether slot p is used:
       minimise T  s.t.  sum_p n[k, p] = |bucket k|,  sum_k n[k, p] Lmax_k <= d_p cap m_p,
       sum_p d_p m_p <= N,  T >= sum_k n[k, p] t_k(d_p) + (b1 + lat (d_p - 1)) m_p   (+ e_p, ring)
   where t_k(d) is the bucket's mean per-sequence time on d ranks with Ulysses all-to-all
   (`pricing.group_times`, "ulysses": no overlap, traffic a2a (S/d)(d-1)/d). Degrees whose
   Ulysses the head count forbids run ring attention instead (priced as ring, with e_p for the
   overlap), so models with 28 heads stay feasible. Slots of one degree are ordered (m_p >= m_p+1).
3. HiGHS (highspy) solves it under a node limit, not a wall-clock limit, single-threaded, so every
   process gets the same plan. The best homogeneous plan (every slot one degree, longest first onto
   the least loaded slot with room) is passed to HiGHS as its starting solution and is the answer
   when HiGHS finds nothing better within the limit.
4. Bucket counts become real sequences (each bucket's sequences longest first, in slot order); each
   micro-batch is placed node-aware and the plan is priced exactly by `build_plan` ("auto"), which
   also judges the counts. The MILP's own makespan is an estimate: bucket means, the link class
   from the degree alone (d > ranks_per_node), a ring slot's latency outside the overlap, and none
   of `compute_lanes` or padding (see milp.py).

Where it still differs from the paper: HiGHS instead of SCIP and a node limit instead of 10 s; the
bucketing takes equal-count runs of the sorted lengths instead of FlexSP's dynamic programme; the
time of a slot uses the bucket's mean sequence (FlexSP: its longest), memory the longest (as FlexSP);
degree 1 is allowed and the ranks need not all be used (sum d_p m_p <= N, not = N); several counts
are compared (while the step improves) instead of taking the first feasible one; the micro-batches are solved one after another
in this process (FlexSP solves them in parallel processes, one step ahead).
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

import numpy as np

from dhp_jax.planner.contract.plan import PlanningError
from dhp_jax.planner.cost.memory import min_degree
from dhp_jax.planner.cost.pricing import attention_for, comm_per_token, group_times, sent_tokens
from dhp_jax.planner.solvers import microbatch
from dhp_jax.planner.solvers.allocate import allowed_degrees
from dhp_jax.planner.solvers.build import build_plan
from dhp_jax.planner.solvers.placement import place

FLEXSP_EXTRA_COUNTS = 4  # counts tried beyond the least feasible one (FlexSP's solver: 5 in all)
FLEXSP_NODE_LIMIT = 50  # HiGHS branch-and-bound nodes per micro-batch: the deterministic work limit
FLEXSP_BUCKETS = 16
MIP_REL_GAP = 1e-4


def buckets_of(lengths: np.ndarray, num_ranks: int, cap: float) -> list[np.ndarray]:
    """Positions grouped into runs of the length-sorted order (longest first); the count starts at
    FLEXSP_BUCKETS and grows until sum(bucket max * size) <= (tokens + N cap) / 2."""
    K = len(lengths)
    order = np.lexsort((np.arange(K), -lengths))
    limit = (float(lengths.sum()) + num_ranks * cap) / 2
    nb = min(K, FLEXSP_BUCKETS)
    while True:
        cuts = np.linspace(0, K, nb + 1).round().astype(np.int64)
        runs = [order[a:b] for a, b in zip(cuts[:-1], cuts[1:]) if b > a]
        padded = sum(float(lengths[r].max()) * len(r) for r in runs)
        if padded <= limit * (1 + 1e-12) or nb >= K:
            return runs
        nb = min(K, nb * 2)


def _slots(ds: np.ndarray, num_ranks: int, count: int) -> list[int]:
    """Degrees of the MILP's slots: N // d of each allowed degree, at most `count` (the sequences)."""
    return [int(d) for d in ds for _ in range(min(num_ranks // int(d), count))]


def _homogeneous(buckets: list[np.ndarray], L: np.ndarray, t_seq: np.ndarray, d: int, num_ranks: int,
                 cap: float) -> list[list[int]] | None:
    """Every slot of degree d: sequences longest first onto the least loaded slot with memory room.
    The bucket of each sequence, per used slot."""
    P = num_ranks // d
    load = np.zeros(P)
    room = np.full(P, d * cap)
    slots: list[list[int]] = [[] for _ in range(P)]
    for b, run in enumerate(buckets):
        for _ in range(len(run)):
            ok = np.flatnonzero(room >= L[b] * (1 - 1e-12))
            if ok.size == 0:
                return None
            p = int(ok[np.argmin(load[ok])])
            slots[p].append(b)
            load[p] += t_seq[b]
            room[p] -= L[b]
    return [g for g in slots if g]


_BANNER_LOCK = threading.Lock()
_banner_shown = False


def _highs() -> Any:
    """A silent `highspy.Highs`. HiGHS prints its banner on the C stdout the first time one is made
    in a process, which would break `--json` output; that first one is made with fd 1 on /dev/null."""
    # lazy: the MILP solver loads only when this strategy runs
    import highspy

    global _banner_shown
    with _BANNER_LOCK:
        if not _banner_shown:
            sys.stdout.flush()
            saved, null = os.dup(1), os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(null, 1)
                highspy.Highs()
            finally:
                os.dup2(saved, 1)
                os.close(saved)
                os.close(null)
            _banner_shown = True
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    return h


def solve_microbatch_milp(prob: Any, idx: np.ndarray, ds: np.ndarray, node_limit: int,
                          time_limit_s: float | None = None) -> tuple[list[list[int]], list[int], float, bool]:
    """Groups (global sample ids), degrees, MILP makespan and proven-optimal flag of one micro-batch."""
    import highspy

    cost, N, cap = prob.cost, prob.num_ranks, prob.cap
    buckets = buckets_of(prob.tok[idx], N, cap)
    Lmax = np.array([float(prob.tok[idx][r].max()) for r in buckets])
    size = np.array([len(r) for r in buckets], dtype=np.int64)
    A = np.array([float(prob.attn[idx][r].mean()) for r in buckets])
    B = np.array([float(prob.lin[idx][r].mean()) for r in buckets])
    S = np.array([float(prob.tok[idx][r].mean()) for r in buckets])
    dmin_b = min_degree(cost, Lmax)
    ds = ds[ds >= int(dmin_b.min())]
    kinds = {int(d): attention_for(int(d), cost, "auto") for d in ds}
    # per-sequence time on d ranks without the fixed terms; the fixed part b1 + lat (d-1) per slot
    t_seq, fixed, overlap = {}, {}, {}
    for d in ds.tolist():
        full = group_times(cost, A, B, S, d, attention=kinds[d])
        fixed[d] = float(group_times(cost, 0.0, 0.0, 0.0, d, attention=kinds[d]))
        ring_overlap = kinds[d] == "ring" and cost.comm_overlap
        if ring_overlap:  # T = (A+B)/d + fixed + max(0, comm - A/d): comm part goes to e_p
            t_seq[d] = (A + B) / d
            c = float(comm_per_token(cost, d > cost.ranks_per_node, "ring"))
            overlap[d] = c * sent_tokens(S, d, "ring") - A / d
        else:
            t_seq[d] = full - fixed[d]
    slots = _slots(ds, N, int(size.sum()))
    nK, P = len(buckets), len(slots)
    # variables: n[k, p] (nK*P), m[p] (P), e[p] (P), T
    iN = lambda k, p: k * P + p  # noqa: E731
    iM, iE, iT = nK * P, nK * P + P, nK * P + 2 * P
    nv = iT + 1
    lb, ub = np.zeros(nv), np.zeros(nv)
    integ = np.zeros(nv, dtype=np.int64)
    for k in range(nK):
        for p, d in enumerate(slots):
            ub[iN(k, p)] = float(size[k]) if d >= dmin_b[k] else 0.0
            integ[iN(k, p)] = 1
    ub[iM:iM + P] = 1.0
    integ[iM:iM + P] = 1
    ub[iE:iE + P] = [1e30 if d in overlap else 0.0 for d in slots]
    ub[iT] = 1e30
    work = float(prob.work[idx].sum())
    lb[iT] = work / N + cost.b1
    rows: list[tuple[list[int], list[float], float, float]] = []
    for k in range(nK):
        rows.append(([iN(k, p) for p in range(P)], [1.0] * P, float(size[k]), float(size[k])))
    for p, d in enumerate(slots):
        ks = list(range(nK))
        rows.append(([iN(k, p) for k in ks] + [iM + p], [float(Lmax[k]) for k in ks] + [-d * cap], -np.inf, 0.0))
        rows.append(([iN(k, p) for k in ks] + [iM + p], [1.0] * nK + [-1.0], 0.0, np.inf))
        # a slot holds sequences only if it is used (the capacity row above cannot say so for
        # sequences of length 0)
        rows.append(([iN(k, p) for k in ks] + [iM + p], [1.0] * nK + [-float(size.sum())], -np.inf, 0.0))
        rows.append(([iN(k, p) for k in ks] + [iM + p, iE + p, iT], [float(t_seq[d][k]) for k in ks]
                     + [fixed[d], 1.0, -1.0], -np.inf, 0.0))
        if d in overlap:  # e_p >= sum_k n c S (d-1)/d - A/d
            rows.append(([iN(k, p) for k in ks] + [iE + p], [float(overlap[d][k]) for k in ks] + [-1.0], -np.inf, 0.0))
        if p and slots[p - 1] == d:
            rows.append(([iM + p - 1, iM + p], [1.0, -1.0], 0.0, np.inf))
    rows.append(([iM + p for p in range(P)], [float(d) for d in slots], -np.inf, float(N)))
    # the starting solution: the best homogeneous plan, as a point of this MILP
    start = None
    for d in ds.tolist():
        g = _homogeneous(buckets, Lmax, t_seq[d], d, N, cap)
        if g is not None:
            x0 = _point(g, d, slots, nK, P, t_seq, fixed, overlap)
            if start is None or x0[iT] < start[iT]:
                start = x0
    h = _highs()
    h.setOptionValue("threads", 1)
    h.setOptionValue("random_seed", 0)
    h.setOptionValue("mip_max_nodes", int(node_limit))
    h.setOptionValue("mip_rel_gap", MIP_REL_GAP)
    h.setOptionValue("presolve", "off")  # measured: faster here, and as good, on these models
    if time_limit_s is not None:
        h.setOptionValue("time_limit", float(time_limit_s))
    inf = highspy.kHighsInf
    h.addVars(nv, lb, np.where(ub >= 1e30, inf, ub))
    h.changeColsIntegrality(nv, np.arange(nv, dtype=np.int32),
                            np.where(integ == 1, highspy.HighsVarType.kInteger, highspy.HighsVarType.kContinuous))
    h.changeColCost(iT, 1.0)
    for cols, vals, lo, hi in rows:
        h.addRow(-inf if lo == -np.inf else lo, inf if hi == np.inf else hi, len(cols),
                 np.asarray(cols, dtype=np.int32), np.asarray(vals, dtype=np.float64))
    if start is not None:
        sol = highspy.HighsSolution()
        sol.col_value = start.tolist()
        sol.value_valid = True
        h.setSolution(sol)
    h.run()
    status = h.getModelStatus()
    x = np.asarray(h.getSolution().col_value) if h.getInfo().primal_solution_status == 2 else None
    if x is None:
        if start is None:
            raise PlanningError(f"flexsp: no power-of-two plan found for a micro-batch of {len(idx)} sequences")
        x = start
    optimal = status == highspy.HighsModelStatus.kOptimal
    counts = np.rint(x[:iM]).astype(np.int64).reshape(nK, P)
    groups, degs = [], []
    pos = [0] * nK
    for p, d in enumerate(slots):
        members = []
        for k in range(nK):
            c = int(counts[k, p])
            members += [int(idx[j]) for j in buckets[k][pos[k]:pos[k] + c].tolist()]
            pos[k] += c
        if members:
            groups.append(members)
            degs.append(d)
    return groups, degs, float(x[iT]), bool(optimal)


def _point(groups: list[list[int]], d: int, slots: list[int], nK: int, P: int, t_seq: dict, fixed: dict,
           overlap: dict) -> np.ndarray:
    """A homogeneous plan (bucket indices per group of degree d) as a point of the MILP: its groups
    take the first slots of degree d; e_p and T as the constraints make them."""
    x = np.zeros(nK * P + 2 * P + 1)
    first = slots.index(d)
    T = 0.0
    for j, members in enumerate(groups):
        p = first + j
        x[nK * P + p] = 1.0
        for b in members:
            x[b * P + p] += 1.0
        e = max(0.0, float(sum(overlap[d][b] for b in members))) if d in overlap else 0.0
        x[nK * P + P + p] = e
        T = max(T, float(sum(t_seq[d][b] for b in members)) + fixed[d] + e)
    x[-1] = T
    return x


def alone_bounds(prob: Any, ds: np.ndarray) -> np.ndarray:
    """A lower bound on the time of any group holding each sequence (float64[K]): its least time
    alone on a degree of `ds` that holds it, on the ring or (where the head count allows) Ulysses,
    inside a node. A group's time grows with what it holds, and inter-node links are the slower."""
    cost = prob.cost
    d = ds[None, :].astype(np.float64)
    terms = (prob.attn[:, None], prob.lin[:, None], prob.tok[:, None])
    t = group_times(cost, *terms, d, False, "ring")
    uly = np.asarray([d > 1 and cost.ulysses_ok(int(d)) for d in ds.tolist()])
    if uly.any():
        t[:, uly] = np.minimum(t[:, uly], group_times(cost, *terms, d[:, uly], False, "ulysses"))
    return np.where(ds[None, :] >= prob.dmin[:, None], t, np.inf).min(axis=1)


def flexsp_counts(prob: Any, num_micro_batches: int | None) -> list[int]:
    """The micro-batch counts FlexSP's planner tries: `num_micro_batches`, else from the least count
    whose length-sorted runs fit the ranks, FLEXSP_EXTRA_COUNTS more."""
    N, K = prob.num_ranks, len(prob.lengths)
    if num_micro_batches is not None:
        return [int(num_micro_batches)]
    lo = microbatch.min_micro_batches(prob.tok, N, prob.cap)
    while lo < K and microbatch.by_length(prob.tok, prob.tok, lo, N, prob.cap) is None:
        lo += 1
    return list(range(lo, min(K, lo + FLEXSP_EXTRA_COUNTS) + 1))


def solve_flexsp(prob: Any, num_micro_batches: int | None, time_limit_s: float | None = None,
                 node_limit: int = FLEXSP_NODE_LIMIT) -> tuple[list, dict[str, Any]]:
    """FlexSP's plan (module docstring): the best of several length-sorted counts, one MILP each."""
    N, cost = prob.num_ranks, prob.cost
    ds = allowed_degrees(N, "pow2")
    too_big = np.flatnonzero(prob.dmin > ds.max())
    if too_big.size:
        k = int(too_big[0])
        raise PlanningError(f"flexsp: sample {k} ({int(prob.lengths[k])} tokens) needs {int(prob.dmin[k])} ranks, "
                            f"more than the largest power of two {int(ds.max())} <= {N}")
    counts = flexsp_counts(prob, num_micro_batches)
    best = None
    tried = []
    total_work = float(prob.work.sum())
    for M in counts:
        if best is not None and total_work / N + M * cost.b1 >= best[0]:
            break  # every micro-batch takes at least its work / N + b1: this count cannot win
        parts = microbatch.by_length(prob.tok, prob.tok, M, N, prob.cap)
        if parts is None:
            if num_micro_batches is not None:
                raise PlanningError(f"flexsp: {M} micro-batches cannot hold this batch on {N} ranks")
            continue
        mbs, optimal = [], True
        for idx in parts:
            groups, degs, _, opt = solve_microbatch_milp(prob, idx, ds, node_limit, time_limit_s)
            optimal &= opt
            mbs.append(list(zip(place(degs, N, cost.ranks_per_node, True), groups)))
        plan = build_plan(mbs, prob.lengths, prob.etas, cost, N, {}, "auto")
        total = sum(mb.est_makespan_s for mb in plan.micro_batches)
        tried.append(len(parts))
        if best is not None and total >= best[0] * (1 - 1e-12):
            break  # one more micro-batch did not help: more will not either (each adds b1)
        best = (total, mbs, optimal, len(parts))
    if best is None:
        raise PlanningError(f"flexsp found no power-of-two plan on {N} ranks")
    return best[1], {"optimal": bool(best[2]), "num_micro_batches": best[3], "counts_tried": tried,
                     "node_limit": int(node_limit), "est_makespan_sum_s": best[0]}
