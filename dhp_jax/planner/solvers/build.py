"""Turn solved micro-batches (rank tuples + sample ids) into a `Plan` with its estimates filled in.

Each group records its own attention kind, its tokens and its padded stream length (the one bucket
rule, `dhp_jax.geometry.layout.bucket_lengths`, on the cost model's ladder; the executors' default ladder
when the cost model prices no padding). Times come from `planner.cost.pricing`, the one place plans are priced.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from dhp_jax.geometry.layout import bucket_lengths
from dhp_jax.planner.contract.plan import Group, MicroBatch, Plan, PlanValidationError
from dhp_jax.planner.cost.geometry import padded_length
from dhp_jax.planner.cost.memory import over_budget
from dhp_jax.planner.cost.model import CostModel
from dhp_jax.planner.cost.pricing import (allreduce_time, attention_for, best_kinds, kind_times, makespan, price_groups,
    sample_terms)

__all__ = ["attention_for", "build_plan", "kind_times", "padded_tokens"]  # (pricing names kept importable here)


def padded_tokens(tokens: Any, degree: Any, cost: CostModel) -> np.ndarray:
    """The stream lengths an executor runs for `tokens` on `degree` ranks (int64, vectorised): the one
    bucket rule on the cost model's ladder (memory clamp and menu included, `geometry.padded_length`);
    the executors' default ladder when the model prices no padding."""
    if cost.geometry.bucket_min:
        return np.asarray(padded_length(cost, np.asarray(tokens, float), degree)).astype(np.int64)
    return bucket_lengths(np.asarray(tokens, float), degree).astype(np.int64)


def build_plan(micro_batches: Sequence[Sequence[tuple[Sequence[int], Sequence[int]]]], lengths: np.ndarray,
               etas: np.ndarray, cost: CostModel, num_ranks: int, solver: dict[str, Any],
               attention: str = "ring") -> Plan:
    """`micro_batches`: per micro-batch a list of (ranks, samples). Groups keep the given order."""
    attn, lin, tok = sample_terms(cost, lengths, etas)
    flat = [(m, tuple(int(r) for r in ranks), tuple(sorted(int(s) for s in samples)))
            for m, groups in enumerate(micro_batches) for ranks, samples in groups if len(samples)]
    if attention == "best":         # each group on its fastest kind (dhp's per-group choice)
        kinds = best_kinds(cost, [(g[1], g[2]) for g in flat], (attn, lin, tok))
    else:
        kinds = [attention_for(len(g[1]), cost, attention) for g in flat]
    times, S, d = price_groups(cost, [(g[1], g[2]) for g in flat], (attn, lin, tok), kinds, cost.ranks_per_node)
    # the padded stream is what a rank holds; the bucket rule clamps padding to the budget, so a
    # group is infeasible exactly when its real tokens are
    mems = padded_length(cost, S, d) * cost.mem_per_token / d
    over = np.flatnonzero(over_budget(cost, S, d))
    if over.size:
        m, ranks, samples = flat[int(over[0])]
        raise PlanValidationError(f"micro-batch {m} group on ranks {list(ranks)}: needs "
                                  f"{mems[over[0]] / 2**30:.2f} GiB per rank for samples {list(samples)}, "
                                  f"budget is {cost.memory_budget / 2**30:.2f} GiB")
    per_mb: list[list[Group]] = [[] for _ in micro_batches]
    padded = padded_tokens(S, d, cost)
    for (m, ranks, samples), kind, n, t, mem, pn in zip(flat, kinds, S.tolist(), times.tolist(), mems.tolist(),
                                                         padded.tolist()):
        per_mb[m].append(Group(ranks=ranks, degree=len(ranks), samples=samples, attention=kind, est_time_s=t,
                               est_memory_bytes=mem, tokens=int(round(n)), padded_tokens=int(pn)))
    mbs = []
    total = 0.0
    for gs in per_mb:
        if not gs:
            continue
        gs.sort(key=lambda g: g.ranks[0])
        # max over groups; on shared cores (compute_lanes) also their core-seconds over the lanes
        span = makespan(cost, [g.est_time_s for g in gs], [g.degree for g in gs])
        total += span
        mbs.append(MicroBatch(tuple(gs), span))
    return Plan(num_ranks=num_ranks, micro_batches=tuple(mbs), ranks_per_node=cost.ranks_per_node,
                est_step_time_s=total + allreduce_time(cost, num_ranks), solver=solver)
