"""Turn solved micro-batches (rank tuples + sample ids) into a `Plan` with its estimates filled in."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from dhp_jax.data.layout import bucket_lengths
from dhp_jax.planner.cost import CostModel
from dhp_jax.planner.packing import bin_sums
from dhp_jax.planner.placement import spans_nodes
from dhp_jax.planner.plan import Group, MicroBatch, Plan, PlanValidationError


def attention_for(degree: int, cost: CostModel, attention: str) -> str:
    """"auto" (FlexSP's groups): all-to-all where the head count allows it, ring otherwise."""
    if attention == "auto":
        return "ulysses" if cost.ulysses_ok(degree) else "ring"
    return attention


def padded_tokens(tokens: Any, degree: Any, cost: CostModel) -> np.ndarray:
    """The stream lengths the executors run (the one bucket rule, `dhp_jax.data.layout.bucket_lengths`,
    on the cost model's ladder; the executors' default ladder when the model prices no padding)."""
    if cost.bucket_min:
        return np.asarray(cost.padded_length(np.asarray(tokens, float), degree)).astype(np.int64)
    return bucket_lengths(np.asarray(tokens, float), degree).astype(np.int64)


def group_time(samples: Sequence[int], ranks: Sequence[int], attn: np.ndarray, lin: np.ndarray,
               tok: np.ndarray, cost: CostModel, attention: str = "ring") -> float:
    idx = np.asarray(samples, dtype=np.int64)
    d = len(ranks)
    return float(cost.group_times(attn[idx].sum(), lin[idx].sum(), tok[idx].sum(), d,
                                  spans_nodes(ranks, cost.ranks_per_node), attention_for(d, cost, attention)))


def build_plan(micro_batches: Sequence[Sequence[tuple[Sequence[int], Sequence[int]]]], lengths: np.ndarray,
               etas: np.ndarray, cost: CostModel, num_ranks: int, solver: dict[str, Any],
               attention: str = "ring") -> Plan:
    """`micro_batches`: per micro-batch a list of (ranks, samples). Groups keep the given order."""
    attn, lin, tok = cost.terms(lengths, etas)
    flat = [(m, tuple(int(r) for r in ranks), tuple(sorted(int(s) for s in samples)))
            for m, groups in enumerate(micro_batches) for ranks, samples in groups if len(samples)]
    A, B, S = bin_sums([g[2] for g in flat], attn, lin, tok)
    d = np.fromiter((len(g[1]) for g in flat), dtype=np.int64, count=len(flat))
    rpn = cost.ranks_per_node
    inter = np.fromiter((spans_nodes(g[1], rpn) for g in flat), dtype=bool, count=len(flat))
    if attention == "auto":
        uly = (cost.num_heads % d) == 0
        times = np.where(uly, cost.group_times(A, B, S, d, inter, "ulysses"), cost.group_times(A, B, S, d, inter))
    else:
        times = cost.group_times(A, B, S, d, inter, attention)
    # the padded stream is what a rank holds; the bucket rule clamps padding to the budget, so a
    # group is infeasible exactly when its real tokens are
    mems = cost.padded_length(S, d) * cost.mem_per_token / d
    over = np.flatnonzero(S * cost.mem_per_token / d > cost.memory_budget * (1 + 1e-9))
    if over.size:
        m, ranks, samples = flat[int(over[0])]
        raise PlanValidationError(f"micro-batch {m} group on ranks {list(ranks)}: needs "
                                  f"{mems[over[0]] / 2**30:.2f} GiB per rank for samples {list(samples)}, "
                                  f"budget is {cost.memory_budget / 2**30:.2f} GiB")
    per_mb: list[list[Group]] = [[] for _ in micro_batches]
    padded = padded_tokens(S, d, cost)
    for (m, ranks, samples), t, mem, n, pn in zip(flat, times.tolist(), mems.tolist(), S.tolist(), padded.tolist()):
        per_mb[m].append(Group(ranks=ranks, degree=len(ranks), samples=samples, est_time_s=t, est_memory_bytes=mem,
                               tokens=int(round(n)), padded_tokens=int(pn)))
    mbs = []
    total = 0.0
    for gs in per_mb:
        if not gs:
            continue
        gs.sort(key=lambda g: g.ranks[0])
        # max over groups; on shared cores (compute_lanes) also their core-seconds over the lanes
        makespan = cost.makespan([g.est_time_s for g in gs], [g.degree for g in gs])
        total += makespan
        mbs.append(MicroBatch(tuple(gs), makespan))
    if attention != "ring":
        solver = {**solver, "attention": attention}
    return Plan(num_ranks=num_ranks, micro_batches=tuple(mbs), ranks_per_node=cost.ranks_per_node,
                est_step_time_s=total + cost.allreduce_time(num_ranks), solver=solver)
