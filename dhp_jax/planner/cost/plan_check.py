"""A plan checked against a cost model: the contract's invariants and each group's memory.

`Plan.validate` checks what the plan alone says (the contract imports nothing above it);
`check_plan` adds what needs the cost model's memory accounting: every group fits its per-rank
budget. Whoever makes or accepts a plan for a batch of known lengths calls it before the plan runs.
"""

from __future__ import annotations

from typing import Any, Sequence

from dhp_jax.planner.contract.plan import Plan, PlanValidationError
from dhp_jax.planner.cost.memory import group_activation_bytes, over_budget


def check_memory(plan: Plan, cost: Any, lengths: Sequence[int]) -> Plan:
    """`plan`; `PlanValidationError` naming the first group that does not fit `cost.memory_budget`
    per rank by the planner's own criterion (`memory.over_budget`: its real tokens; the padded stream
    the bucket rule makes of them may round under 2 tokens a rank over the budget); the message
    gives the padded stream's bytes (`memory.group_activation_bytes`), what the rank holds."""
    budget = float(cost.memory_budget)
    for m, mb in enumerate(plan.micro_batches):
        for gi, g in enumerate(mb.groups):
            group = [int(lengths[s]) for s in g.samples]
            if over_budget(cost, sum(group), g.degree):
                need = float(group_activation_bytes(cost, group, g.degree))
                raise PlanValidationError(
                    f"micro-batch {m} group {gi} (ranks {list(g.ranks)}): needs {need / 2**30:.2f} GiB "
                    f"per rank for samples {list(g.samples)}, budget is {budget / 2**30:.2f} GiB")
    return plan


def check_plan(plan: Plan, cost: Any, lengths: Sequence[int], num_samples: int | None = None,
               num_devices: int | None = None) -> Plan:
    """`plan.validate(num_samples, cost, num_devices)` (the invariants, the heads of its attention
    kinds), then `check_memory`; returns `plan`."""
    plan.validate(num_samples=len(lengths) if num_samples is None else num_samples, cost=cost,
                  num_devices=num_devices)
    return check_memory(plan, cost, lengths)
