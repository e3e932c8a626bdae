"""A batch prepared for the solvers: input checks (errors name the sample and the limit) and the
per-sample cost terms every strategy reads."""

from __future__ import annotations

from typing import Any

import numpy as np

from dhp_jax.checks import positive_int
from dhp_jax.data.sample import Sample, sample_etas, sample_lengths
from dhp_jax.planner.contract.plan import PlanningError
from dhp_jax.planner.cost.memory import max_tokens_per_rank, min_degree
from dhp_jax.planner.cost.model import CostModel
from dhp_jax.planner.cost.pricing import sample_terms
from dhp_jax.planner.solvers.microbatch import sort_orders


class Problem:
    """A batch prepared for the solvers: lengths, etas, per-sample cost terms, limits."""

    def __init__(self, lengths: np.ndarray, etas: np.ndarray, num_ranks: int, cost: CostModel):
        self.lengths, self.etas, self.num_ranks, self.cost = lengths, etas, num_ranks, cost
        self.attn, self.lin, self.tok = sample_terms(cost, lengths, etas)
        self.work = self.attn + self.lin
        self.dmin = min_degree(cost, lengths)
        self.cap = max_tokens_per_rank(cost)
        self._orders: tuple[np.ndarray, np.ndarray] | None = None
        # the attention kind the "dhp" search prices its groups at: "ring", or "best" (each group at
        # its fastest kind, `pricing.best_times`); `solve_dhp` sets it from its attention mode
        self.kind = "ring"
        # what the searches share, whatever kind they price at: each micro-batch count's candidate
        # splits, and each micro-batch's packing at each granularity (keyed by its sample ids)
        self.split_cache: dict[int, list] = {}
        self.pack_cache: dict[tuple[bytes, float], np.ndarray] = {}
        self.packers: dict[bytes, Any] = {}
        self.alone_cache: dict[tuple[str, bytes], np.ndarray] = {}  # `dhp.alone_times` per kind and degrees

    def orders(self) -> tuple[np.ndarray, np.ndarray]:
        """The samples longest first and heaviest first, ties by position (computed once: every
        micro-batch count's candidate splits cut these orders)."""
        if self._orders is None:
            self._orders = sort_orders(self.work, self.tok)
        return self._orders


def prepare(samples_or_lengths: Any, num_ranks: int, cost: CostModel, etas: Any = None,
            ranks_per_node: int | None = None) -> Problem:
    """Check the input (errors name the sample and the limit) and precompute cost terms."""
    num_ranks = positive_int(num_ranks, "num_ranks", PlanningError)
    if not isinstance(cost, CostModel):
        raise TypeError(f"cost must be a CostModel, got {type(cost).__name__}")
    if ranks_per_node is not None:
        positive_int(ranks_per_node, "ranks_per_node", PlanningError)
        if int(ranks_per_node) != cost.ranks_per_node:
            cost = cost.replace(ranks_per_node=int(ranks_per_node))
    items = samples_or_lengths if isinstance(samples_or_lengths, np.ndarray) else list(samples_or_lengths)
    if len(items) == 0:
        raise PlanningError("empty batch: there are no samples to plan")
    has_samples = not isinstance(items, np.ndarray) and any(isinstance(x, Sample) for x in items)
    lengths = sample_lengths(items) if has_samples else _plain_lengths(items)
    if etas is None:
        etas_arr = sample_etas(items) if has_samples else np.zeros(len(items))
    else:
        etas_arr = np.asarray(etas, dtype=np.float64).reshape(-1)
        if etas_arr.size != lengths.size:
            raise PlanningError(f"etas has {etas_arr.size} entries for a batch of {lengths.size} samples")
        bad = np.flatnonzero(~np.isfinite(etas_arr) | (etas_arr < 0) | (etas_arr > 1))
        if bad.size:
            raise PlanningError(f"sample {int(bad[0])}: eta must be in [0, 1], got {etas_arr[bad[0]]}")
    prob = Problem(lengths, etas_arr, num_ranks, cost)
    over = np.flatnonzero(prob.dmin > num_ranks)
    if over.size:
        k = int(over[np.argmax(lengths[over])])
        raise PlanningError(
            f"sample {k} has {int(lengths[k])} tokens but all {num_ranks} ranks hold at most "
            f"{int(num_ranks * prob.cap)} tokens ({prob.cap:.0f} per rank at "
            f"{cost.mem_per_token / 1024:.0f} KiB/token, budget {cost.memory_budget / 2**30:.2f} GiB)")
    return prob


def _plain_lengths(items: Any) -> np.ndarray:
    """Vectorised check of integer lengths (the per-item path names the first bad sample)."""
    try:
        arr = np.asarray(items)
    except (TypeError, ValueError):
        arr = None
    if arr is None or arr.ndim != 1 or arr.dtype.kind not in "iu":
        return sample_lengths(items)  # slow path: floats, objects, mixed -> per-item errors
    bad = np.flatnonzero(arr < 0)
    if bad.size:
        raise ValueError(f"sample {int(bad[0])}: length must be >= 0, got {int(arr[bad[0]])}")
    return arr.astype(np.int64)
