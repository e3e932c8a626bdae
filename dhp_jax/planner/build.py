"""Turn solved micro-batches (rank tuples + sample ids) into a `Plan` with its estimates filled in."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from dhp_jax.planner.cost import CostModel
from dhp_jax.planner.placement import spans_nodes
from dhp_jax.planner.plan import Group, MicroBatch, Plan


def attention_for(degree: int, cost: CostModel, attention: str) -> str:
    """"auto" (FlexSP's groups): all-to-all where the head count allows it, ring otherwise."""
    if attention == "auto":
        return "ulysses" if cost.ulysses_ok(degree) else "ring"
    return attention


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
    mbs = []
    total = 0.0
    for groups in micro_batches:
        gs = []
        for ranks, samples in groups:
            if len(samples) == 0:
                continue
            ranks = tuple(int(r) for r in ranks)
            samples = tuple(sorted(int(s) for s in samples))
            t = group_time(samples, ranks, attn, lin, tok, cost, attention)
            mem = cost.memory(lengths[list(samples)], len(ranks))
            gs.append(Group(ranks=ranks, degree=len(ranks), samples=samples, est_time_s=t, est_memory_bytes=mem))
        gs.sort(key=lambda g: g.ranks[0])
        makespan = max(g.est_time_s for g in gs)
        total += makespan
        mbs.append(MicroBatch(tuple(gs), makespan))
    if attention != "ring":
        solver = {**solver, "attention": attention}
    return Plan(num_ranks=num_ranks, micro_batches=tuple(mbs), ranks_per_node=cost.ranks_per_node,
                est_step_time_s=total + cost.allreduce_time(num_ranks), solver=solver)
