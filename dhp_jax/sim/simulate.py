"""Simulate training steps: plan each global batch with a strategy, time the plan on a cluster.

Times come from the planner's pricing of a plan (`dhp_jax.planner.cost.pricing`, a cost-model preset,
i.e. *simulated*, never measured): each group's time for its samples at its degree, inter-node when
its ranks span nodes; a micro-batch lasts as long as its slowest group; a step is the sum of
micro-batch makespans plus one gradient all-reduce over all ranks. `evaluate` also reports where rank-time goes (busy vs idle), which `step_time` does not.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import numpy as np

from dhp_jax.data import make_dataset, sample_lengths
from dhp_jax.planner.compare import compare_strategies
from dhp_jax.planner.cost.pricing import allreduce_time, makespans, plan_group_times
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


def evaluate(plan: Any, lengths: Sequence[int], cost: Any, etas: Sequence[float] | None = None) -> StepBreakdown:
    """Time one plan; raises ValueError naming the group if it references a missing sample."""
    t, d, mb = plan_group_times(plan, lengths, cost, etas)
    # the cost model owns how groups of one micro-batch combine (shared CPU lanes included)
    spans = makespans(cost, t, d, mb, len(plan.micro_batches))
    return StepBreakdown(tuple(spans.tolist()), float(allreduce_time(cost, plan.num_ranks)),
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
    def mean_step_time_s(self) -> float:
        """`mean_step_s` under the name `planner.compare.Comparison` compares runs by."""
        return self.mean_step_s

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
    return [make_dataset(dataset, batch, seed * 1_000_003 + i, vision=vision) for i in range(steps)]


def simulate(cluster: Cluster, dataset: str | Sequence[Sequence[Any]], strategy: str = "dhp", *,
             batch: int = 512, steps: int = 10, seed: int = 0,
             plan_options: Mapping[str, Any] | None = None, cost: Any = None) -> SimRun:
    """Plan `steps` batches of `dataset` with `strategy` on `cluster` and time every plan.

    `dataset` is a dataset name (or manifest path) for `make_dataset`, or already drawn batches
    (lists of `Sample`s), which lets several strategies share one draw.
    """
    cost = cost if cost is not None else cluster.cost_model()
    if isinstance(dataset, str):
        name, batches = dataset, make_batches(dataset, batch, steps, seed, cluster.vision)
    else:
        name, batches = "<batches>", [list(b) for b in dataset]
    n = len(batches)
    breakdowns: list[StepBreakdown] = []

    def price(plan: Any, lengths: np.ndarray, cost: Any, etas: np.ndarray) -> float:
        breakdowns.append(evaluate(plan, lengths, cost, etas))
        return breakdowns[-1].step_s

    run = compare_strategies(batches, cluster.num_ranks, cost, [strategy], plan_options={strategy: plan_options or {}},
                             errors="raise", price=price, ranks_per_node=cluster.ranks_per_node).runs[strategy]
    rec: dict[str, list[Any]] = {
        "step": run.step_time_s, "wall": run.plan_wall_ms, "util": [br.utilisation for br in breakdowns],
        "tok": [int(np.sum(sample_lengths(b))) for b in batches],
        "solve": [float(p.solver.get("solve_ms", np.nan)) for p in run.plans],
        "mbs": [len(p.micro_batches) for p in run.plans], "deg": run.degrees}
    return SimRun(cluster=cluster, dataset=name, strategy=strategy, batch=len(batches[0]) if n else batch,
                  step_s=np.asarray(rec["step"]), tokens=np.asarray(rec["tok"]),
                  utilisation=np.asarray(rec["util"]), solve_ms=np.asarray(rec["solve"]),
                  plan_wall_ms=np.asarray(rec["wall"]), num_micro_batches=np.asarray(rec["mbs"]),
                  degrees=rec["deg"])
