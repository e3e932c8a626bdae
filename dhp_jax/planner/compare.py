"""One strategy comparison: plan the same batches with several strategies and price every plan.

`compare_strategies` is the loop that `dhp plan`, `dhp analyze`, the simulator, the experiments and
the trainer's end-of-run summary share; its `Comparison` holds one `StrategyRun` per strategy and
answers `best_static()` and `speedup()`. Prices are `planner.cost.pricing.step_time` (simulated with the
cost model) unless the caller measured them and builds the `Comparison` from its own figures.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from dhp_jax.data.sample import sample_etas, sample_lengths
from dhp_jax.planner.api import plan_batch
from dhp_jax.planner.contract.plan import Plan, PlanningError
from dhp_jax.planner.cost.model import CostModel
from dhp_jax.planner.cost.pricing import step_time

__all__ = ["Comparison", "StrategyRun", "compare_strategies", "is_static"]


def is_static(strategy: str) -> bool:
    """A static baseline: one CP degree for the whole batch ("static-ring:<d|best>", ...)."""
    return strategy.startswith("static-")


@dataclasses.dataclass
class StrategyRun:
    """One strategy on a list of batches: a step time and a plan per batch (or the error that
    stopped it: a batch it cannot plan)."""

    strategy: str
    step_time_s: list[float] = dataclasses.field(default_factory=list)
    plans: list[Plan] = dataclasses.field(default_factory=list)
    plan_wall_ms: list[float] = dataclasses.field(default_factory=list)  # plan_batch wall time, this machine
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.step_time_s)

    @property
    def mean_step_time_s(self) -> float | None:
        return float(np.mean(self.step_time_s)) if self.ok else None

    @property
    def degrees(self) -> list[list[list[int]]]:
        return [p.degrees for p in self.plans]


@dataclasses.dataclass
class Comparison:
    """Strategies compared on the same batches, in the order they were run. Any run with a
    `mean_step_time_s` (None: infeasible) can be compared, simulated or measured."""

    runs: dict[str, Any]

    @classmethod
    def of_means(cls, means: Mapping[str, float | None]) -> "Comparison":
        """Figures already reduced to one mean step time per strategy (None: infeasible), e.g.
        measured ones."""
        return cls({s: StrategyRun(s, [m]) if m is not None else StrategyRun(s, error="infeasible")
                    for s, m in means.items()})

    def mean(self, strategy: str) -> float | None:
        run = self.runs.get(strategy)
        return None if run is None else run.mean_step_time_s

    def best_static(self, candidates: Iterable[str] | None = None) -> str | None:
        """The fastest feasible run among `candidates` (default: the static baselines)."""
        names = [s for s in self.runs if is_static(s)] if candidates is None else list(candidates)
        ok = [s for s in names if self.mean(s) is not None]
        return min(ok, key=lambda s: self.mean(s)) if ok else None

    def speedup(self, strategy: str = "dhp", over: str | None = None) -> float | None:
        """How many times faster `strategy` is than `over` (default: the best static); None when
        either is missing or infeasible."""
        over = self.best_static() if over is None else over
        mine, theirs = self.mean(strategy), (self.mean(over) if over else None)
        return theirs / mine if mine and theirs is not None else None

    def table(self) -> list[dict[str, Any]]:
        """One row per strategy: mean step time (None: infeasible, with the error), per-batch times."""
        return [{"strategy": s, "mean_step_time_s": r.mean_step_time_s, "step_time_s": list(r.step_time_s),
                 "error": getattr(r, "error", None)} for s, r in self.runs.items()]


def compare_strategies(batches: Sequence[Any], num_ranks: int, cost: CostModel, strategies: Sequence[str], *,
                       plan_options: Mapping[str, Mapping[str, Any]] | None = None, errors: str = "record",
                       price: Callable[[Plan, np.ndarray, CostModel, np.ndarray], float] | None = None,
                       **common: Any) -> Comparison:
    """Plan every batch with every strategy (strategy by strategy, batches in order) and price it.

    A batch is a list of `Sample`s or a `(lengths, etas)` pair. `plan_options[strategy]` and
    `common` are keyword arguments of `plan_batch`. A strategy that cannot plan a batch
    (`PlanningError`) stops there with `error` set (`errors="raise"` re-raises instead). `price`
    defaults to `step_time` (simulated).
    """
    if errors not in ("record", "raise"):
        raise ValueError(f"errors must be 'record' or 'raise', got {errors!r}")
    price = step_time if price is None else price
    prepared = []
    for b in batches:
        if isinstance(b, tuple):
            lengths, etas = np.asarray(b[0]), (None if b[1] is None else np.asarray(b[1]))
            prepared.append((lengths, lengths, etas))
        else:
            prepared.append((b, sample_lengths(b), sample_etas(b)))
    runs: dict[str, StrategyRun] = {}
    for s in strategies:
        run = runs[s] = StrategyRun(s)
        opts = {**common, **dict((plan_options or {}).get(s, {}))}
        for items, lengths, etas in prepared:
            t0 = time.perf_counter()
            try:
                if items is lengths:
                    plan = plan_batch(lengths, num_ranks, cost, s, etas=etas, **opts)
                else:
                    plan = plan_batch(items, num_ranks, cost, s, **opts)
            except PlanningError as e:
                if errors == "raise":
                    raise
                run.error = str(e)
                break
            run.plan_wall_ms.append((time.perf_counter() - t0) * 1e3)
            run.plans.append(plan)
            run.step_time_s.append(float(price(plan, lengths, cost, etas)))
    return Comparison(runs)
