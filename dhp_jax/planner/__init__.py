"""The planner: cost model, memory-aware packing, degree allocation, placement, baselines, `Plan`.

Pure Python/NumPy (no jax import), so it can run in a loader thread or another process.
"""

from dhp_jax._lazy import lazy_attributes
from dhp_jax.planner.contract.plan import SCHEMA, Group, MicroBatch, Plan, PlanningError, PlanValidationError

_LAZY = {
    "CostModel": "dhp_jax.planner.cost.model",
    "plan_batch": "dhp_jax.planner.api",
    "STRATEGIES": "dhp_jax.planner.api",
    "step_time": "dhp_jax.planner.cost.pricing",
    "compare_strategies": "dhp_jax.planner.compare",
    "Comparison": "dhp_jax.planner.compare",
    "ProgramCache": "dhp_jax.planner.programs.cache",
}
__getattr__, __dir__ = lazy_attributes(__name__, _LAZY)
__all__ = ["SCHEMA", "Group", "MicroBatch", "Plan", "PlanningError", "PlanValidationError", *_LAZY]
