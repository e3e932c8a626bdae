"""Where a step's plan comes from: a planner strategy, or a plan file replayed step by step.

Plan files make runs comparable and reproducible: a run writes `plans.jsonl` (one plan a step) and
`planner.plan_file=<that file>` replays it. Accepted files: `.json` holding one plan (used for
every step) or `{"plans": [...]}`; `.jsonl` with one plan (or `{"step": t, "plan": {...}}`) a line.
Every plan in a file is parsed and validated against the run before the first step.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from dhp_jax.planner.plan import Plan, PlanValidationError


class PlanFileError(ValueError):
    """A plan file cannot be read or does not fit the run; the message names the file and plan."""


def load_plan_file(path: str | Path, num_samples: int, num_ranks: int, steps: int | None = None) -> list[Plan]:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise PlanFileError(f"cannot read plan file {str(path)!r}: {e.strerror or e}") from None
    raw: list[Any]
    try:
        if path.suffix == ".jsonl":
            raw = [json.loads(line) for line in text.splitlines() if line.strip()]
        else:
            data = json.loads(text)
            raw = data["plans"] if isinstance(data, dict) and "plans" in data else [data]
    except (json.JSONDecodeError, TypeError) as e:
        raise PlanFileError(f"plan file {str(path)!r} is not valid JSON: {e}") from None
    if not raw:
        raise PlanFileError(f"plan file {str(path)!r} holds no plans")
    plans = []
    for i, d in enumerate(raw):
        if isinstance(d, dict) and "plan" in d and "schema" not in d:
            d = d["plan"]
        try:
            plan = Plan.from_json(d, num_samples=num_samples)
        except PlanValidationError as e:
            raise PlanFileError(f"plan file {str(path)!r}, plan {i}: {e}") from None
        if plan.num_ranks != num_ranks:
            raise PlanFileError(f"plan file {str(path)!r}, plan {i}: plan is for {plan.num_ranks} ranks, "
                                f"the run has num_ranks={num_ranks}")
        plans.append(plan)
    if steps is not None and len(plans) > 1 and len(plans) < steps:
        raise PlanFileError(f"plan file {str(path)!r} holds {len(plans)} plans but the run has {steps} steps "
                            f"(give one plan, to reuse every step, or one per step)")
    return plans


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
            plan = self.plans[step] if len(self.plans) > 1 else self.plans[0]
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
