"""The "milp" planner: an exact reference over any degrees, for small instances.

One micro-batch as a mixed-integer programme (HiGHS through scipy.optimize.milp):
slot g takes degree d (y[g,d] binary, at most one), sequence k goes to one slot (x[k,g] binary),
a used slot holds at most d * (tokens per rank), the degrees sum to at most N, and T >= the time
of every slot. Given its degree a slot's time is linear in x:
    T >= sum_k x_kg (A_k + B_k) / d + b1 + e_g            (big-M, active when y[g,d] = 1)
    e_g >= sum_k x_kg (c_d S_k (d-1)/d - A_k / d) + lat_d (d-1),   e_g >= 0
Sequence k may only use slots g <= k and used slots come first (symmetry breaking).

What it leaves out of `pricing.group_times`, so its makespan can differ from the plan's estimate:
- the link class: a slot is priced inter-node exactly when d > ranks_per_node (placement comes after);
- the shared-lanes scaling of `compute_lanes` (compute, b1 and latency over min(d, lanes) cores, and the
  machine-wide cap of `pricing.makespans`);
- padding to the executor's buckets (`bucket_min`);
- `comm_overlap=False`: the -A_k/d overlap term is always there.
The plan is priced exactly afterwards by `build_plan`. Its only limit is wall-clock (`time_limit_s`);
the result records whether optimality was proven. The "flexsp" baseline lives in flexsp.py.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from scipy import sparse
from scipy.optimize import Bounds, LinearConstraint, milp

from dhp_jax.planner.contract.plan import PlanningError
from dhp_jax.planner.cost.memory import max_tokens_per_rank, min_degree
from dhp_jax.planner.cost.pricing import attention_for, comm_per_token, group_times, sent_tokens
from dhp_jax.planner.solvers import microbatch
from dhp_jax.planner.solvers.allocate import allowed_degrees
from dhp_jax.planner.solvers.placement import place

MAX_MILP_SEQUENCES = 64  # per micro-batch; beyond this "milp" refuses (it is a reference solver)
MAX_MILP_RANKS = 64
MIP_REL_GAP = 1e-6  # "optimal" means proven within this relative gap


def _milp_microbatch(A: np.ndarray, B: np.ndarray, S: np.ndarray, num_ranks: int, cost: Any, ds: np.ndarray,
                     attention: str, time_limit_s: float | None, node_limit: int | None = None
                     ) -> tuple[list[list[int]], list[int], float, bool] | None:
    """Slots (item positions), their degrees, makespan and proven-optimal flag; None if no solution."""
    K = len(A)
    order = np.lexsort((np.arange(K), -(A + B)))  # heaviest first, for the symmetry breaking
    A, B, S = A[order], B[order], S[order]
    dmin = min_degree(cost, S)
    G = min(K, num_ranks)
    D = len(ds)
    ny, nx = G * D, K * G
    ie, iT = ny + nx, ny + nx + G
    nvar = iT + 1
    cap = max_tokens_per_rank(cost)
    rows, cols, vals, lo, hi = [], [], [], [], []
    r = 0

    def add(entries: list[tuple[int, float]], lb: float, ub: float) -> None:
        nonlocal r
        for c, v in entries:
            rows.append(r); cols.append(c); vals.append(v)
        lo.append(lb); hi.append(ub)
        r += 1

    Y = lambda g, j: g * D + j  # noqa: E731
    X = lambda k, g: ny + k * G + g  # noqa: E731
    for k in range(K):
        add([(X(k, g), 1.0) for g in range(min(k + 1, G))], 1.0, 1.0)
    for g in range(G):
        add([(Y(g, j), 1.0) for j in range(D)], 0.0, 1.0)
        if g:
            add([(Y(g, j), 1.0) for j in range(D)] + [(Y(g - 1, j), -1.0) for j in range(D)], -np.inf, 0.0)
    add([(Y(g, j), float(ds[j])) for g in range(G) for j in range(D)], -np.inf, float(num_ranks))
    for g in range(G):
        for k in range(g, K):
            add([(X(k, g), 1.0)] + [(Y(g, j), -1.0) for j in range(D)], -np.inf, 0.0)
        add([(X(k, g), float(S[k])) for k in range(g, K)] + [(Y(g, j), -float(ds[j]) * cap) for j in range(D)],
            -np.inf, 0.0)
    excess_max = 0.0
    ex_rows = []
    for j, d in enumerate(ds.tolist()):
        inter = d > cost.ranks_per_node
        kind = attention_for(d, cost, attention)
        c = float(comm_per_token(cost, inter, kind))
        lat = (cost.lat_inter if inter else cost.lat_intra) * (d - 1)
        coef = c * sent_tokens(S, d, kind) - (A / d if kind == "ring" else 0.0)
        m2 = float(np.maximum(coef, 0).sum()) + lat
        excess_max = max(excess_max, m2)
        ex_rows.append((j, d, coef, lat, m2))
    for g in range(G):
        for j, d, coef, lat, m2 in ex_rows:
            ks = range(g, K)
            # e_g >= coef.x + lat when y[g,d]:  coef.x - e_g + m2 y <= m2 - lat
            add([(X(k, g), float(coef[k])) for k in ks] + [(ie + g, -1.0), (Y(g, j), m2)], -np.inf, m2 - lat)
            lin = (A + B) / d
            m1 = float(lin.sum()) + cost.b1 + excess_max
            # T >= lin.x + b1 + e_g when y[g,d]:  lin.x + e_g - T + m1 y <= m1 - b1
            add([(X(k, g), float(lin[k])) for k in ks] + [(ie + g, 1.0), (iT, -1.0), (Y(g, j), m1)],
                -np.inf, m1 - cost.b1)
    Amat = sparse.csr_array((vals, (rows, cols)), shape=(r, nvar))
    lb = np.zeros(nvar)
    ub = np.ones(nvar)
    for g in range(G):
        for j in range(D):
            if ds[j] < (dmin[g:].min() if g < K else 1):
                ub[Y(g, j)] = 0.0
        for k in range(K):
            if k < g:
                ub[X(k, g)] = 0.0
    ub[ie:ie + G] = excess_max
    ub[iT] = np.inf
    # valid lower bounds on T tighten the weak big-M relaxation: sum_g d_g (T - b1) >= total work
    # on at most N ranks, and no sequence runs faster than alone at its best allowed degree
    alone = max(float(np.min(group_times(cost, A[k], B[k], S[k], ds[ds >= dmin[k]],
                                              attention="ring" if attention == "ring" else "ulysses")))
                for k in range(K)) if attention != "auto" else 0.0
    lb[iT] = max(float((A + B).sum()) / num_ranks + cost.b1, alone)
    integrality = np.zeros(nvar)
    integrality[:ny + nx] = 1
    cobj = np.zeros(nvar)
    cobj[iT] = 1.0
    opts = {"disp": False, "mip_rel_gap": MIP_REL_GAP}
    if time_limit_s is not None:
        opts["time_limit"] = float(time_limit_s)
    if node_limit is not None:        # a work limit: the same answer on any machine, at any load
        opts["node_limit"] = int(node_limit)
    res = milp(cobj, constraints=LinearConstraint(Amat, lo, hi), integrality=integrality,
               bounds=Bounds(lb, ub), options=opts)
    if res.x is None:
        return "infeasible" if res.status == 2 else None
    x = res.x
    slots, degs = [], []
    for g in range(G):
        js = [j for j in range(D) if x[Y(g, j)] > 0.5]
        if not js:
            continue
        items = [int(order[k]) for k in range(K) if x[X(k, g)] > 0.5]
        if items:
            slots.append(items)
            degs.append(int(ds[js[0]]))
    return slots, degs, float(x[iT]), res.status == 0


def solve_milp(prob: Any, num_micro_batches: int | None, degrees: Any, node_aware: bool,
               time_limit_s: float | None, node_limit: int | None = None) -> tuple[list, dict[str, Any]]:
    """Any-degree exact MILP per micro-batch (the memory-minimal count unless one is given), within
    `time_limit_s` seconds and `node_limit` branch-and-bound nodes per micro-batch (None: none)."""
    N, cost = prob.num_ranks, prob.cost
    if N > MAX_MILP_RANKS:
        raise PlanningError(f"milp is an exact reference for small instances: {N} ranks > {MAX_MILP_RANKS}")
    ds = allowed_degrees(N, degrees)
    M = microbatch.min_micro_batches(prob.tok, N, prob.cap) if num_micro_batches is None else int(num_micro_batches)
    while True:
        parts = microbatch.split(prob.work, M)
        if max(len(p) for p in parts) > MAX_MILP_SEQUENCES:
            raise PlanningError(f"milp is an exact reference for small instances: a micro-batch of "
                                f"{max(len(p) for p in parts)} sequences > {MAX_MILP_SEQUENCES}")
        mbs, optimal, spans = [], True, []
        for idx in parts:
            sol = _milp_microbatch(prob.attn[idx], prob.lin[idx], prob.tok[idx], N, cost, ds, "ring", time_limit_s,
                                   node_limit)
            if sol is None:
                raise PlanningError(f"milp found no plan for a micro-batch of {len(idx)} sequences"
                                    f" within {time_limit_s} s and {node_limit} nodes")
            if sol == "infeasible":
                break
            slots, degs, mk, opt = sol
            optimal &= opt
            ranks = place(degs, N, cost.ranks_per_node, node_aware)
            mbs.append([(rk, [int(idx[k]) for k in items]) for rk, items in zip(ranks, slots)])
            spans.append(mk)
        if len(mbs) == len(parts):
            break
        if num_micro_batches is not None or M >= len(prob.lengths):
            raise PlanningError(f"milp: no plan with {M} micro-batches fits {N} ranks")
        M += 1
    return mbs, {"optimal": bool(optimal), "mip_rel_gap": MIP_REL_GAP, "num_micro_batches": len(parts),
                 "milp_makespans_s": spans}
