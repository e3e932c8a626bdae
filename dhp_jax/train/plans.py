"""Where a step's plan comes from: a planner strategy, or a plan file replayed step by step.

Plan files make runs comparable and reproducible: a run writes `plans.jsonl` (one plan a step) and
`planner.plan_file=<that file>` replays it. The format and the replay rule are
`dhp_jax.planner.planfile`'s, shared with the torch backend.
"""

from __future__ import annotations

from typing import Any, Sequence

from dhp_jax.planner.plan import Plan
from dhp_jax.planner.planfile import PlanFileError, load_plan_file, plan_at

__all__ = ["PlanFileError", "PlanSource", "load_plan_file", "make_cost"]


class PlanSource:
    """`source(step, batch) -> Plan`: deterministic, so any process computes the same plan."""

    def __init__(self, num_ranks: int, cost: Any = None, strategy: str = "dhp",
                 plans: Sequence[Plan] | None = None, num_micro_batches: int | None = None,
                 ranks_per_node: int | None = None):
        self.num_ranks, self.cost, self.strategy = num_ranks, cost, strategy
        self.plans = list(plans) if plans else None
        self.num_micro_batches, self.ranks_per_node = num_micro_batches, ranks_per_node
        self.programs = None  # a planner.programs.ProgramCache: reuse compiled programs, price new ones
        if self.plans is None and cost is None:
            raise ValueError("a PlanSource needs a cost model or a list of plans")

    @property
    def label(self) -> str:
        return "plan-file" if self.plans is not None else self.strategy

    def __call__(self, step: int, batch: Any) -> Plan:
        if self.plans is not None:
            plan = plan_at(self.plans, step)
        else:
            from dhp_jax.planner import plan_batch

            kwargs: dict[str, Any] = {}
            if self.num_micro_batches is not None:
                kwargs["num_micro_batches"] = self.num_micro_batches
            if self.ranks_per_node is not None:
                kwargs["ranks_per_node"] = self.ranks_per_node
            if self.programs is not None and self.strategy == "dhp":
                kwargs["programs"] = self.programs
            plan = plan_batch(batch.samples, self.num_ranks, self.cost, strategy=self.strategy, **kwargs)
        return plan.validate(num_samples=len(batch.samples))


def make_cost(cost_profile: str | None, cost_model: str, hardware: str, ranks_per_node: int) -> Any:
    """The planning cost model: a `dhp profile` JSON when given, else a named preset."""
    from dhp_jax.planner.cli_args import cost_model as load

    if cost_profile:
        return load(cost_profile, profile=True)
    return load(cost_model, hardware, ranks_per_node=ranks_per_node)
