"""Step time of a plan under a cost model: sum of micro-batch makespans plus the gradient all-reduce.

Group times come from the cost model, each under the group's own attention kind; a group is priced with inter-node links when its ranks span
nodes of `plan.ranks_per_node`. Vectorised over all groups of the plan (one pass of NumPy).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from dhp_jax.planner.build import kind_times


def step_time(plan: Any, lengths: Sequence[int] | np.ndarray, cost: Any,
              etas: Sequence[float] | np.ndarray | None = None) -> float:
    """Seconds of one training step of `plan` (groups of a micro-batch run concurrently; with
    `cost.compute_lanes` they also share those cores: see `CostModel.makespans`)."""
    lengths = np.asarray(lengths)
    attn, lin, tok = cost.terms(lengths, etas)
    groups = [(m, g) for m, mb in enumerate(plan.micro_batches) for g in mb.groups]
    if not groups:
        raise ValueError("plan has no groups")
    sizes = np.fromiter((len(g.samples) for _, g in groups), dtype=np.int64, count=len(groups))
    idx = np.fromiter((s for _, g in groups for s in g.samples), dtype=np.int64, count=int(sizes.sum()))
    if idx.size and (idx.min() < 0 or idx.max() >= lengths.size):
        raise ValueError(f"plan names sample {int(idx.max())} but only {lengths.size} lengths were given")
    gid = np.repeat(np.arange(len(groups)), sizes)
    A = np.bincount(gid, attn[idx], minlength=len(groups))
    B = np.bincount(gid, lin[idx], minlength=len(groups))
    S = np.bincount(gid, tok[idx], minlength=len(groups))
    d = np.fromiter((g.degree for _, g in groups), dtype=np.int64, count=len(groups))
    rpn = plan.ranks_per_node or plan.num_ranks
    inter = np.fromiter((len({r // rpn for r in g.ranks}) > 1 for _, g in groups), dtype=bool, count=len(groups))
    t = kind_times(cost, A, B, S, d, inter, [g.attention for _, g in groups])   # each group by its own kind
    mb = np.fromiter((m for m, _ in groups), dtype=np.int64, count=len(groups))
    makespans = cost.makespans(t, d, mb, len(plan.micro_batches))  # lanes-aware on shared cores
    return float(makespans.sum() + cost.allreduce_time(plan.num_ranks))
