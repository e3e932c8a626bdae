"""Simulate training steps: plan each global batch with a strategy, time the plan on a cluster.

Times come from the planner's cost model (a preset, i.e. *simulated*, never measured): each group's
time for its samples at its degree, inter-node when its ranks span nodes; a micro-batch lasts as long
as its slowest group; a step is the sum of micro-batch makespans plus one gradient all-reduce over all
ranks. `evaluate` also reports where rank-time goes (busy vs idle), which `step_time` does not.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Mapping, Sequence

import numpy as np

from dhp_jax.planner.build import kind_times
from dhp_jax.sim.cluster import Cluster


@dataclasses.dataclass(frozen=True)
class StepBreakdown:
    """One simulated step of one plan."""

    makespans_s: tuple[float, ...]  # per micro-batch
    allreduce_s: float
    busy_rank_s: float  # sum over groups of degree x group time
    num_ranks: int

    @property
    def step_s(self) -> float:
        return float(sum(self.makespans_s)) + self.allreduce_s

    @property
    def utilisation(self) -> float:
        """Share of rank-time spent inside a group's work (the rest: waiting for the slowest group
        and the all-reduce)."""
        return self.busy_rank_s / (self.num_ranks * self.step_s) if self.step_s > 0 else 0.0


def spans_nodes(ranks: Sequence[int], ranks_per_node: int) -> bool:
    first = ranks[0] // ranks_per_node
    return any(r // ranks_per_node != first for r in ranks)


def group_times(plan: Any, lengths: Sequence[int], cost: Any, etas: Sequence[float] | None = None
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Time of every group of `plan` (vectorised): (seconds, degree, micro-batch index), one entry
    per group in plan order. Each group is priced under its own attention kind (`Group.attention`)."""
    lengths = np.asarray(lengths)
    attn, lin, tok = cost.terms(lengths, etas)
    groups = [(m, g) for m, mb in enumerate(plan.micro_batches) for g in mb.groups]
    n = len(groups)
    sizes = np.fromiter((len(g.samples) for _, g in groups), dtype=np.int64, count=n)
    idx = np.fromiter((s for _, g in groups for s in g.samples), dtype=np.int64, count=int(sizes.sum()))
    if idx.size and (idx.min() < 0 or idx.max() >= lengths.size):
        bad = int(np.flatnonzero((idx < 0) | (idx >= lengths.size))[0])
        gi = int(np.searchsorted(np.cumsum(sizes), bad, side="right"))
        m, g = groups[gi]
        raise ValueError(f"micro-batch {m} group with ranks {list(g.ranks)}: sample {int(idx[bad])} is outside "
                         f"the batch of {lengths.size} samples")
    gid = np.repeat(np.arange(n), sizes)
    A = np.bincount(gid, attn[idx], minlength=n)
    B = np.bincount(gid, lin[idx], minlength=n)
    S = np.bincount(gid, tok[idx], minlength=n)
    d = np.fromiter((g.degree for _, g in groups), dtype=np.int64, count=n)
    rpn = plan.ranks_per_node or plan.num_ranks
    inter = np.fromiter((spans_nodes(g.ranks, rpn) for _, g in groups), dtype=bool, count=n)
    t = kind_times(cost, A, B, S, d, inter, [g.attention for _, g in groups])
    mb = np.fromiter((m for m, _ in groups), dtype=np.int64, count=n)
    return t, d, mb


def evaluate(plan: Any, lengths: Sequence[int], cost: Any, etas: Sequence[float] | None = None) -> StepBreakdown:
    """Time one plan; raises ValueError naming the group if it references a missing sample."""
    t, d, mb = group_times(plan, lengths, cost, etas)
    # the cost model owns how groups of one micro-batch combine (shared CPU lanes included)
    makespans = cost.makespans(t, d, mb, len(plan.micro_batches))
    return StepBreakdown(tuple(makespans.tolist()), float(cost.allreduce_time(plan.num_ranks)),
                         float(np.dot(d, t)), plan.num_ranks)


@dataclasses.dataclass
class SimRun:
    """Per-step records of one (cluster, dataset, strategy) simulation."""

    cluster: Cluster
    dataset: str
    strategy: str
    batch: int
    step_s: np.ndarray
    tokens: np.ndarray
    utilisation: np.ndarray
    solve_ms: np.ndarray  # the planner's own solve time (measured on this machine)
    plan_wall_ms: np.ndarray  # wall time of plan_batch on this machine
    num_micro_batches: np.ndarray
    degrees: list[list[list[int]]]  # per step, per micro-batch

    @property
    def mean_step_s(self) -> float:
        return float(self.step_s.mean())

    @property
    def tokens_per_s(self) -> float:
        return float(self.tokens.sum() / self.step_s.sum())

    @property
    def tokens_per_s_per_rank(self) -> float:
        return self.tokens_per_s / self.cluster.num_ranks

    def summary(self) -> dict[str, Any]:
        return {"strategy": self.strategy, "dataset": self.dataset, "ranks": self.cluster.num_ranks,
                "batch": self.batch, "steps": int(self.step_s.size), "mean_step_s": self.mean_step_s,
                "tokens_per_s": self.tokens_per_s, "tokens_per_s_per_rank": self.tokens_per_s_per_rank,
                "utilisation": float(self.utilisation.mean()),
                "micro_batches_mean": float(self.num_micro_batches.mean()),
                "solve_ms_median": float(np.median(self.solve_ms)),
                "plan_wall_ms_median": float(np.median(self.plan_wall_ms))}


def make_batches(dataset: str, batch: int, steps: int, seed: int, vision: str) -> list[list[Any]]:
    """`steps` global batches of `batch` samples; batch i is drawn with seed `seed * 1_000_003 + i` so
    that every strategy sees the very same data."""
    from dhp_jax.data import make_dataset

    return [make_dataset(dataset, batch, seed * 1_000_003 + i, vision=vision) for i in range(steps)]


def simulate(cluster: Cluster, dataset: str | Sequence[Sequence[Any]], strategy: str = "dhp", *,
             batch: int = 512, steps: int = 10, seed: int = 0,
             plan_options: Mapping[str, Any] | None = None, cost: Any = None) -> SimRun:
    """Plan `steps` batches of `dataset` with `strategy` on `cluster` and time every plan.

    `dataset` is a dataset name (or manifest path) for `make_dataset`, or already drawn batches
    (lists of `Sample`s), which lets several strategies share one draw.
    """
    from dhp_jax.data import sample_etas, sample_lengths
    from dhp_jax.planner import plan_batch

    cost = cost if cost is not None else cluster.cost_model()
    if isinstance(dataset, str):
        name, batches = dataset, make_batches(dataset, batch, steps, seed, cluster.vision)
    else:
        name, batches = "<batches>", [list(b) for b in dataset]
    n = len(batches)
    rec: dict[str, list[Any]] = {k: [] for k in ("step", "tok", "util", "solve", "wall", "mbs", "deg")}
    for samples in batches:
        lengths, etas = sample_lengths(samples), sample_etas(samples)
        t0 = time.perf_counter()
        plan = plan_batch(samples, cluster.num_ranks, cost, strategy,
                          ranks_per_node=cluster.ranks_per_node, **dict(plan_options or {}))
        rec["wall"].append((time.perf_counter() - t0) * 1e3)
        br = evaluate(plan, lengths, cost, etas)
        rec["step"].append(br.step_s)
        rec["tok"].append(int(np.sum(lengths)))
        rec["util"].append(br.utilisation)
        rec["solve"].append(float(plan.solver.get("solve_ms", np.nan)))
        rec["mbs"].append(len(plan.micro_batches))
        rec["deg"].append(plan.degrees)
    return SimRun(cluster=cluster, dataset=name, strategy=strategy, batch=len(batches[0]) if n else batch,
                  step_s=np.asarray(rec["step"]), tokens=np.asarray(rec["tok"]),
                  utilisation=np.asarray(rec["util"]), solve_ms=np.asarray(rec["solve"]),
                  plan_wall_ms=np.asarray(rec["wall"]), num_micro_batches=np.asarray(rec["mbs"]),
                  degrees=rec["deg"])
